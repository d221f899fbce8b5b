"""MRPC with transformers on CPU, bertjax's GLUE recipe, for comparison with bertjax's run
from the same shipped checkpoint (benchmarks/shipped_checkpoints.md).

Recipe as configs/finetune/glue.py: BertForSequenceClassification (pooled [CLS], dropout 0.1),
max_seq_length 128 (pairs truncated longest first), batch 32, AdamW lr 5e-5 with weight decay
0.01 except LayerNorm and biases, 10% linear warmup then linear decay, one seed. Dev F1 and
accuracy after every epoch.

  python benchmarks/shipped_checkpoints.py --model=MINILM/model \
      --data_dir=GLUE/MRPC --epochs=3 --seed=1
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time

import torch
import transformers


def read_mrpc(path: str) -> list[tuple[str, str, int]]:
    """(sentence 1, sentence 2, label) rows of a GLUE MRPC tsv."""
    with open(path, encoding="utf-8-sig") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    return [(r[3], r[4], int(r[0])) for r in rows]


def batches(tokenizer, rows, size: int, max_len: int, shuffle: torch.Generator | None):
    order = torch.randperm(len(rows), generator=shuffle).tolist() if shuffle else range(len(rows))
    order = list(order)
    for start in range(0, len(order), size):
        chunk = [rows[i] for i in order[start : start + size]]
        enc = tokenizer(
            [a for a, _, _ in chunk],
            [b for _, b, _ in chunk],
            truncation="longest_first",
            max_length=max_len,
            padding=True,
            return_tensors="pt",
        )
        yield enc, torch.tensor([label for _, _, label in chunk])


def evaluate(model, tokenizer, rows, max_len: int) -> dict[str, float]:
    model.eval()
    predicted = []
    with torch.no_grad():
        for enc, _ in batches(tokenizer, rows, 32, max_len, None):
            predicted += model(**enc).logits.argmax(-1).tolist()
    gold = [label for _, _, label in rows]
    tp = sum(p == g == 1 for p, g in zip(predicted, gold))
    precision, recall = tp / max(sum(predicted), 1), tp / max(sum(gold), 1)
    return {
        "f1": 2 * precision * recall / max(precision + recall, 1e-12),
        "accuracy": sum(p == g for p, g in zip(predicted, gold)) / len(gold),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.BertForSequenceClassification.from_pretrained(args.model, num_labels=2)
    train, dev = (read_mrpc(f"{args.data_dir}/{s}.tsv") for s in ("train", "dev"))
    steps = math.ceil(len(train) * args.epochs / args.batch)
    decay = [p for n, p in model.named_parameters() if "LayerNorm" not in n and "bias" not in n]
    rest = [p for n, p in model.named_parameters() if "LayerNorm" in n or "bias" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=args.lr,
        eps=1e-6,
    )
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, int(0.1 * steps), steps)
    shuffle, step, started = torch.Generator().manual_seed(args.seed), 0, time.time()
    while step < steps:
        model.train()
        for enc, labels in batches(tokenizer, train, args.batch, args.max_seq_length, shuffle):
            loss = model(**enc, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(), schedule.step(), optimizer.zero_grad()
            step += 1
            if step % 20 == 0:
                print(
                    f"step {step}/{steps} loss {loss.item():.4f} {time.time() - started:.0f}s",
                    flush=True,
                )
            if step == steps:
                break
        print(
            json.dumps(
                {
                    "step": step,
                    "dev": evaluate(model, tokenizer, dev, args.max_seq_length),
                    "seconds": round(time.time() - started),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
