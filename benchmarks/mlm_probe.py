"""MLM learning probe: does a small BERT learn from context as fast as Hugging Face's?

A synthetic task that context solves completely: each sequence is a run of consecutive ids, so
every masked id is its left neighbour + 1. The same 2-layer H64 model, batches and schedule
(lr 1e-3, 50 warmup steps, linear decay over 600 steps, global-norm clip 1.0) train in bertjax
(BERT Adam) or in PyTorch transformers (AdamW; needs the `parity` extra):

    python benchmarks/mlm_probe.py --impl=bertjax
    python benchmarks/mlm_probe.py --impl=hf

Prints step, MLM loss and MLM accuracy of the current batch every 50 steps.
"""

import argparse

import numpy as np

VOCAB, LENGTH, PREDICTIONS, BATCH, STEPS, WARMUP, LR = 200, 32, 5, 32, 600, 50, 1e-3
MASK_ID = 4
ARCH = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=64,
)


def batches(seed: int = 0):
    """Yields (input_ids, masked positions, masked ids, next-sentence labels) forever."""
    rng = np.random.default_rng(seed)
    while True:
        ids = rng.integers(5, VOCAB - LENGTH, (BATCH, 1)) + np.arange(LENGTH)
        positions = np.sort(
            np.stack(
                [
                    rng.choice(np.arange(1, LENGTH - 1), PREDICTIONS, replace=False)
                    for _ in range(BATCH)
                ]
            ),
            1,
        )
        labels = np.take_along_axis(ids, positions, 1)
        inputs = ids.copy()
        np.put_along_axis(inputs, positions, MASK_ID, 1)
        yield (
            inputs.astype(np.int32),
            positions.astype(np.int32),
            labels.astype(np.int32),
            rng.integers(0, 2, BATCH).astype(np.int32),
        )


def run_bertjax() -> None:
    import jax

    from bertjax.models.bert.model import BertConfig, BertForPreTraining, example_inputs
    from bertjax.training import optim, sharding, steps
    from bertjax.training.state import create_train_state

    model = BertForPreTraining(BertConfig(**ARCH))
    tx = optim.make_optimizer(
        optim.OptimizerConfig(peak_learning_rate=LR, warmup_steps=WARMUP, total_steps=STEPS)
    )
    mesh = sharding.make_mesh({"data": 1})
    state, _, shardings = create_train_state(
        model, tx, jax.random.PRNGKey(0), example_inputs(model), mesh
    )
    train_step = steps.jit_train_step(steps.make_train_step(model, tx), shardings, mesh)
    with sharding.activate(mesh):
        for step, (inputs, positions, labels, nsp) in zip(range(STEPS), batches()):
            batch = dict(
                input_ids=inputs,
                input_mask=np.ones_like(inputs),
                segment_ids=np.zeros_like(inputs),
                masked_lm_positions=positions,
                masked_lm_ids=labels,
                masked_lm_weights=np.ones(labels.shape, np.float32),
                next_sentence_labels=nsp,
            )
            state, metrics = train_step(state, sharding.global_batch_from_host(batch, mesh))
            if step % 50 == 0:
                weight = float(metrics["mlm_weight_sum"])
                print(
                    step,
                    float(metrics["mlm_loss_sum"]) / weight,
                    float(metrics["mlm_correct_sum"]) / weight,
                    flush=True,
                )


def run_hf() -> None:
    import torch
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(**ARCH)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=1e-6)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / WARMUP, max(0.0, (STEPS - s) / (STEPS - WARMUP)))
    )
    for step, (inputs, positions, labels, nsp) in zip(range(STEPS), batches()):
        targets = np.full(inputs.shape, -100)
        np.put_along_axis(targets, positions, labels, 1)
        out = model(input_ids=torch.tensor(inputs))
        mlm_loss = torch.nn.functional.cross_entropy(
            out.prediction_logits.reshape(-1, VOCAB), torch.tensor(targets).reshape(-1)
        )
        nsp_loss = torch.nn.functional.cross_entropy(
            out.seq_relationship_logits, torch.tensor(nsp).long()
        )
        optimizer.zero_grad()
        (mlm_loss + nsp_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0:
            predicted = out.prediction_logits.argmax(-1).detach().numpy()
            masked = targets != -100
            print(
                step,
                mlm_loss.item(),
                float((predicted[masked] == targets[masked]).mean()),
                flush=True,
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["bertjax", "hf"], required=True)
    {"bertjax": run_bertjax, "hf": run_hf}[parser.parse_args().impl]()
