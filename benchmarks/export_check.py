"""Does a fine-tuned GLUE model exported by `python -m bertjax.convert` predict in
transformers as it does in bertjax? (benchmarks/exports.md)

    python benchmarks/export_check.py FINETUNE_WORKDIR HF_DIR [SPLIT]

Encodes the split (default `dev`) with bertjax's task reader from the workdir alone (its
tokenizer beside it, its best checkpoint) and with `AutoTokenizer.from_pretrained(HF_DIR)`
on the same texts; runs bertjax's model and `AutoModelForSequenceClassification`; prints
whether the input ids agree, the largest logit difference, how many predictions differ, and
the split's metrics both ways. Needs bertjax and the `parity` extra (torch, transformers).
"""

import json
import sys

import ml_collections
import numpy as np
import torch
import transformers

from bertjax.interop import pretrained
from bertjax.tasks import glue, glue_tasks
from bertjax.training import finetune_setup
from bertjax.training.finetune_settings import FinetuneSettings


def main(workdir: str, hf_dir: str, split: str = "dev") -> None:
    with open(f"{workdir}/config.json", encoding="utf-8") as f:
        config = ml_collections.ConfigDict(json.load(f))
    source = pretrained.Source(init_checkpoint=workdir)
    tokenizer = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
    bert_config, params = pretrained.read(workdir)
    task = finetune_setup.make_task(FinetuneSettings.of(config.to_dict()), tokenizer)
    data = task.load(split)
    f = data.features
    ours = np.asarray(
        task.model(bert_config).apply(
            {"params": params},
            f["input_ids"],
            f["segment_ids"],
            f["input_mask"],
            deterministic=True,
        )
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    texts = [(e.text_a, e.text_b) for e in data.examples]
    encoded = hf_tokenizer(
        [a for a, _ in texts],
        [b for _, b in texts] if texts[0][1] else None,
        padding="max_length",
        truncation="longest_first",
        max_length=config.max_seq_length,
        return_tensors="np",
    )
    same_ids = np.all(encoded["input_ids"] == f["input_ids"], axis=1)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        theirs = model(**{k: torch.tensor(v) for k, v in encoded.items()}).logits.numpy()
    spec = glue_tasks.get_task(config.task)
    ours_pred, theirs_pred = (glue.predictions_from_logits(spec, x) for x in (ours, theirs))
    print(
        f"{config.task} {split}: {len(texts)} examples; AutoTokenizer ids equal bertjax's for "
        f"{same_ids.sum()} (the others: pairs truncated differently, see exports.md); max "
        f"|logit difference| {np.abs(ours - theirs)[same_ids].max():.2e} on those, "
        f"{np.abs(ours - theirs).max():.2e} on all; predictions that differ: "
        f"{int((ours_pred != theirs_pred).sum())}"
    )
    print(f"  bertjax:      {glue.evaluate(spec, ours_pred, f['labels'])}")
    print(
        f"  transformers: {glue.evaluate(spec, theirs_pred, f['labels'])} "
        f"(labels {model.config.id2label})"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
