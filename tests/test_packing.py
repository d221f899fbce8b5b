"""`data.packing`: whole instances packed into rows compute exactly what they compute alone
(both heads, the loss and a train step), the packer places every instance once within the row
limits, and packed batches are deterministic and resumable like unpacked ones.

Instances come from the real preparation code (`pipeline.make_features`: the original NSP
pairs, short sequences and masking) on random token documents.
"""

import json
import os
import pathlib
import runpy
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from bertjax import train
from bertjax.checkpoints.run_record import RunRecord
from bertjax.data import batch as batch_spec, instances, loaders, packing, pipeline
from bertjax.data.settings import DataSettings
from bertjax.models import families
from bertjax.models.bert.model import BertConfig, BertForPreTraining, example_inputs
from bertjax.training import guards
from bertjax.training.phase_schedule import Phase
from test_train import cache_dir, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixtures)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB, SEQ, PREDS, MAX_INSTANCES = 97, 64, 10, 4
SPECIALS = instances.SpecialTokens(
    cls_id=2, sep_id=3, mask_id=4, pad_id=0, vocab_size=VOCAB, never_mask=frozenset({0, 1})
)
CONFIG = BertConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=SEQ,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def data_config(**overrides):
    data = runpy.run_path(str(REPO_ROOT / "configs" / "base.py"))["get_config"]().data
    data.update(short_seq_prob=0.5, **overrides)  # many short instances: much to pack
    return data


def prepared_split(masked: bool, dupe_factor: int = 2) -> pipeline.PreparedSplit:
    """Instances of 40 random documents (3-12 sentences of 2-14 tokens), as prepared."""
    rng = np.random.default_rng(0)
    documents = [
        [
            rng.integers(5, VOCAB, rng.integers(2, 15)).astype(np.int32)
            for _ in range(rng.integers(3, 13))
        ]
        for _ in range(40)
    ]
    features = pipeline.make_features(
        documents,
        Phase("short", SEQ, PREDS, 8, 0, 10),
        DataSettings.of(data_config()),
        SPECIALS,
        dupe_factor,
        masked,
        seed=7,
    )
    return pipeline.PreparedSplit([features], masked)


def packed_loader(masked: bool, batch: int = 8, shuffle: bool = True):
    masking = (SPECIALS, 0.15, PREDS, False)
    source = loaders.BatchLoader(
        prepared_split(masked), batch, seed=5, shuffle=shuffle, masking=None if masked else masking
    )
    predictions = packing.predictions_per_row(SEQ, PREDS, 0.15, MAX_INSTANCES)
    return source, packing.PackedLoader(source, SEQ, MAX_INSTANCES, predictions, SPECIALS.pad_id)


# ----------------------------------------------------------------------------- the packer


def test_best_fit_decreasing_on_a_hand_example():
    lengths = np.array([30, 64, 10, 40, 30, 24])
    rows = packing.plan_rows(lengths, np.arange(6), 64, 3)
    assert sorted(tuple(sorted(lengths[r[r >= 0]].tolist())) for r in rows) == [
        (10,),
        (24, 40),
        (30, 30),
        (64,),
    ]


@pytest.mark.parametrize("max_instances", [1, 2, 5])
def test_plan_places_every_instance_once_within_the_row_limits(max_instances):
    rng = np.random.default_rng(max_instances)
    lengths = np.concatenate([np.full(300, 128), rng.integers(5, 129, 700)])
    plans = [
        packing.plan_rows(lengths, rng.permutation(1000), 128, max_instances) for _ in range(2)
    ]
    for rows in plans:
        members = rows[rows >= 0]
        assert sorted(members.tolist()) == list(range(1000))
        assert rows.shape[1] == max_instances
        assert np.where(rows >= 0, lengths[np.maximum(rows, 0)], 0).sum(axis=1).max() <= 128
    # The row shapes come from the lengths alone: every epoch has as many rows.
    assert len(plans[0]) == len(plans[1])
    if max_instances == 1:
        assert len(plans[0]) == 1000
    else:  # close to the volume bound: at most 1% more rows than ceil(tokens / 128)
        assert len(plans[0]) <= 1.01 * np.ceil(lengths.sum() / 128) + 1


def test_predictions_per_row_holds_every_packed_instance():
    """Whatever instances share a row, their masked positions fit its prediction slots."""
    _, loader = packed_loader(masked=True)
    for index in range(loader.batches_per_epoch):
        assert loader.batch(index)["masked_lm_weights"].sum(axis=1).max() <= loader.max_predictions
    assert packing.predictions_per_row(128, 20, 0.15, 4) == 23
    assert packing.predictions_per_row(512, 80, 0.15, 4) == 80


# ----------------------------------------------------------------------------- equivalence


def test_packed_rows_give_each_instance_its_own_logits_loss_and_gradient():
    """Each instance of a packed row gets the MLM and NSP logits it gets alone in an unpacked
    row (float32, same parameters, dropout off); the loss, its metric sums and its gradient
    equal those of the unpacked batch of the same instances."""
    source, loader = packed_loader(masked=True)
    epoch, plan = loader.rows_of(3)
    assert (plan >= 0).sum() > len(plan)  # rows that hold several instances
    alone = source.features(plan[plan >= 0], epoch)
    packed = loader.batch(3)
    model = BertForPreTraining(CONFIG)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), *example_inputs(model)))

    @jax.jit
    def run(params, batch):
        def loss_fn(params):
            extra = {name: batch[name] for name in batch_spec.PACKED_INPUTS if name in batch}
            mlm, nsp = model.apply(
                params,
                batch["input_ids"],
                batch["segment_ids"],
                batch["input_mask"],
                batch["masked_lm_positions"],
                **extra,
            )
            loss, sums = families.of(model).pretraining_loss((mlm, nsp), batch)
            return loss, (mlm, nsp, sums)

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    (loss_alone, (mlm_alone, nsp_alone, sums_alone)), grads_alone = run(params, alone)
    (loss_packed, (mlm_packed, nsp_packed, sums_packed)), grads_packed = run(params, packed)
    real = alone["masked_lm_weights"] > 0
    np.testing.assert_allclose(
        mlm_packed[packed["masked_lm_weights"] > 0], mlm_alone[real], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        nsp_packed[packed["next_sentence_weights"] > 0], nsp_alone, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(loss_packed, loss_alone, rtol=1e-6)
    for name, value in sums_alone.items():
        np.testing.assert_allclose(sums_packed[name], value, rtol=1e-5, err_msg=name)
    assert float(sums_packed["nsp_count"]) == len(nsp_alone) == real.shape[0]
    for got, want in zip(jax.tree.leaves(grads_packed), jax.tree.leaves(grads_alone)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- loading


def test_packed_batches_are_deterministic_resumable_and_reshuffled():
    """Batch k depends only on (seed, k): a fresh loader (a resumed run) gives the same
    batches in any order, across an epoch boundary; each epoch uses every instance at most once
    and packs them differently; dynamic masks are those the instance gets unpacked."""
    source, loader = packed_loader(masked=False)
    _, fresh = packed_loader(masked=False)
    per_epoch = loader.batches_per_epoch
    indices = [0, per_epoch - 1, per_epoch, per_epoch + 1, 1]
    first = {k: loader.batch(k) for k in indices}
    for k in reversed(indices):  # another access order, another loader object
        for name, value in fresh.batch(k).items():
            np.testing.assert_array_equal(value, first[k][name], err_msg=f"batch {k} {name}")
    plans = [
        np.concatenate([loader.rows_of(e * per_epoch + k)[1] for k in range(per_epoch)])
        for e in (0, 1)
    ]
    for plan in plans:
        members = plan[plan >= 0]
        assert len(np.unique(members)) == len(members)
        assert len(members) >= len(loader.lengths) - MAX_INSTANCES * loader.local_batch_size
    assert not np.array_equal(plans[0], plans[1])
    epoch, plan = loader.rows_of(per_epoch + 1)
    alone = source.features(plan[plan >= 0], epoch)
    packed = first[per_epoch + 1]
    np.testing.assert_array_equal(
        packed["masked_lm_ids"][packed["masked_lm_weights"] > 0],
        alone["masked_lm_ids"][alone["masked_lm_weights"] > 0],
    )
    real = packed["input_mask"] > 0
    np.testing.assert_array_equal(
        packed["input_ids"][real], alone["input_ids"][alone["input_mask"] > 0]
    )


def test_packed_rows_layout():
    """Positions restart at 0 in every instance, instance ids count 1..K then 0 at padding,
    each NSP position is its instance's [CLS], masked positions land inside their instance."""
    _, loader = packed_loader(masked=True, shuffle=False)
    batch = loader.batch(0)
    for row in range(len(batch["input_ids"])):
        ids = batch["instance_ids"][row]
        count = int(batch["next_sentence_weights"][row].sum())
        assert sorted(set(ids.tolist()) - {0}) == list(range(1, count + 1))
        starts = batch["next_sentence_positions"][row, :count]
        assert (batch["input_ids"][row, starts] == SPECIALS.cls_id).all()
        assert (batch["position_ids"][row, starts] == 0).all()
        assert (np.diff(batch["position_ids"][row][ids > 0]) != 1).sum() == count - 1
        assert (batch["input_ids"][row][ids == 0] == SPECIALS.pad_id).all()
        masked = batch["masked_lm_positions"][row][batch["masked_lm_weights"][row] > 0]
        assert (ids[masked] > 0).all() and (np.diff(masked) > 0).all()
    stats = loader.stats
    assert stats.padding_packed < stats.padding_unpacked and stats.instances_per_row > 1.5


# ----------------------------------------------------------------------------- training


def test_a_resume_that_turns_packing_on_or_off_mid_phase_is_refused():
    phases = [Phase("short", SEQ, PREDS, 8, 0, 10)]
    unpacked, packed = data_config(source="default"), data_config(source="default", packing=True)
    before_packing = data_config(source="default")  # a config of a run older than data.packing
    del before_packing["packing"], before_packing["packing_max_instances"]
    assert guards.data_identity(DataSettings.of(unpacked), phases) == guards.data_identity(
        DataSettings.of(before_packing, recorded=True), phases
    )

    def resume(old, new, batch_index: int) -> None:  # a checkpoint written with `old`
        meta = {
            "data": guards.data_identity(DataSettings.of(old, recorded=True), phases),
            "config": json.dumps({"data": json.loads(old.to_json())}),
        }
        new = DataSettings.of(new)
        guards.check_resume(
            RunRecord.of(meta),
            guards.data_identity(new, phases),
            new,
            {"phase": "short", "batch_index": batch_index},
            "short",
            "ckpt",
            allow_changes=False,
        )

    for old, new in (
        (unpacked, packed),
        (packed, unpacked),
        (packed, data_config(source="default", packing=True, packing_max_instances=2)),
    ):
        with pytest.raises(guards.IncompatibleResume, match=r"data\.packing"):
            resume(old, new, 3)
    resume(unpacked, packed, 0)  # a phase's start
    resume(before_packing, unpacked, 3)  # a checkpoint older than data.packing


@pytest.mark.slow
def test_packed_pretraining_resumes_exactly_and_refuses_a_packing_change(
    corpus_file, cache_dir, tmp_path, capsys
):
    """`bertjax.train` with data.packing prints the packing rate; a run resumed from its step-2
    checkpoint (the step-4 one lost, as in a crash) logs the uninterrupted run's losses bit for
    bit; resuming that phase unpacked is refused, naming data.packing."""
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{
            "data.packing": True,
            "train.total_steps": 4,
            "train.checkpoint_every": 2,
            "long_phase.fraction": 0.0,
        },
    )
    train.train_and_evaluate(config, str(tmp_path / "straight"))
    assert "Packing short train:" in capsys.readouterr().out
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    train.train_and_evaluate(config, str(tmp_path / "resumed"))
    straight = read_metrics(tmp_path / "straight")
    records = read_metrics(tmp_path / "resumed")
    assert [m["step"] for m in records] == [1, 2, 3, 4, 3, 4]
    assert [m["loss"] for m in records[4:]] == [m["loss"] for m in straight[2:]]
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    config.data.packing = False
    with pytest.raises(guards.IncompatibleResume, match=r"data\.packing"):
        train.train_and_evaluate(config, str(tmp_path / "resumed"))


def test_the_packing_rate_is_one_console_line(tmp_path):
    """The packing rate reaches the console once (it was both logged and printed: every line
    twice on the console and in log.txt), under `cli.run` as every entry point."""
    script = (
        "from bertjax import cli\n"
        "from bertjax.data import loaders\n"
        "from bertjax.data.settings import DataSettings\n"
        "import test_packing as t\n"
        "def main(argv):\n"
        "    source = loaders.BatchLoader(t.prepared_split(True), 8, seed=5, shuffle=True)\n"
        "    loaders.packed_loaders(source, None, DataSettings.of(t.data_config()),\n"
        "                           t.Phase('short', t.SEQ, t.PREDS, 8, 0, 10), 0)\n"
        "cli.run(main, None)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]),
        },
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if line.startswith("Packing")] == [
        next(line for line in lines if line.startswith("Packing short train:"))
    ]
