"""bertjax's own checkpoints (Orbax, through `bertjax.checkpoints.checkpoint`) as host parameters: a
pretraining workdir or its `checkpoints/` folder, a fine-tuning workdir (its best seed) or a
seed's folder, or a params-only checkpoint written by `save_bertjax` (what `python -m
bertjax.convert` writes for `train.init_checkpoint`). A directory's tokenizer lives beside
its checkpoints (`save_tokenizer`), so that it stands alone."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from bertjax.checkpoints import checkpoint
from bertjax.data import bpe, tokenization
from bertjax.interop import hf_tokenizer, tree
from bertjax.models import families
from bertjax.runtime import files

TOKENIZER_FILE = "bertjax_tokenizer.json"  # which file beside it is the tokenizer, and how
SENTENCEPIECE_FILE = hf_tokenizer.SENTENCEPIECE_FILES[0]


def seed_dirs(path: str) -> list[str]:
    """The `seed_N` folders of a fine-tuning workdir (none for any other path)."""
    names = files.listdir(path) if files.isdir(path) else []
    return [
        os.path.join(path, n)
        for n in sorted(names, key=lambda n: n[5:].zfill(9))
        if n.startswith("seed_") and files.isdir(os.path.join(path, n, "checkpoints"))
    ]


def best_seed(workdir: str, seeds: list[str]) -> str:
    """The seed of a fine-tuning run with the best dev score of the task's main metric (its
    `summary.json`), else the first."""
    try:
        with files.open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
        scores = {
            f"seed_{r['seed']}": next(iter(r["dev"].values()))[summary["main_metric"]]
            for r in summary["seeds"]
        }
    except (OSError, ValueError, KeyError, StopIteration):
        return seeds[0]
    ranked = [s for s in seeds if os.path.basename(s) in scores]
    return max(ranked, key=lambda s: scores[os.path.basename(s)]) if ranked else seeds[0]


def checkpoint_dir(path: str) -> str:
    """A workdir holds its checkpoints in `checkpoints/`, a fine-tuning workdir in
    `seed_N/checkpoints/` (the best seed is taken); accept all."""
    inner = os.path.join(path, "checkpoints")
    if files.isdir(inner):
        return inner
    seeds = seed_dirs(path)
    return os.path.join(best_seed(path, seeds), "checkpoints") if seeds else path


def latest_step(directory: str) -> int:
    """The step of the latest checkpoint in the checkpoint directory `directory` (Orbax names
    a step's folder by its number once its save has finished)."""
    return max((int(name) for name in files.listdir(directory) if name.isdigit()), default=0)


def config_from_meta(meta: dict, directory: str) -> families.ModelConfig:
    """The model config a checkpoint recorded: a fine-tuning run's `bert_config`, a
    pretraining run's full model config, else the architecture of a params-only checkpoint;
    of the family its record names (`families.from_record`: BERT's records name none)."""
    if "family" in meta.get("model", {}):  # (recorded since families)
        return families.from_record(
            json.loads(meta["config"])["model"] if "config" in meta else meta["model"]
        )
    if "bert_config" in meta:  # fine-tuned
        return families.from_record(meta["bert_config"])
    run = json.loads(meta["config"]) if "config" in meta else {}
    if "model" in run:
        return families.from_record(run["model"])
    if "model" in meta:
        return families.from_record(meta["model"])
    raise tree.ConversionError(
        f"{directory} is a fine-tuning checkpoint from a bertjax that did not record its model "
        "there; fine-tune again (same command, a new --workdir) to make one that can be read"
    )


def config_of(directory: str) -> families.ModelConfig:
    """The model config of the latest checkpoint in `directory` (see `config_from_meta`)."""
    return config_from_meta(checkpoint.read_meta(directory), directory)


def finetuned_config(path: str) -> dict | None:
    """The fine-tuning config (task, kind, ...) of a fine-tuned checkpoint; None for others."""
    meta = checkpoint.read_meta(checkpoint_dir(path))
    return json.loads(meta["config"]) if "task" in meta else None


def load_bertjax(
    path: str, report: tree.LoadReport | None = None
) -> tuple[families.ModelConfig, dict[str, Any]]:
    """Reads every parameter of the latest bertjax checkpoint in a checkpoint directory or
    workdir onto the host (numpy), with unrolled layers: BertForPreTraining's (or
    ModernBertForMaskedLM's), or a fine-tuned model's encoder (`bert`) and output layer."""
    report = report if report is not None else tree.LoadReport()
    directory = checkpoint_dir(path)
    config = config_of(directory)
    restored = checkpoint.restore_params(directory, checkpoint.stored_params(directory))
    params = tree.unstack_layers(jax.tree.map(np.asarray, restored))
    report.source, report.format = directory, "bertjax"
    report.found = report.mapped = len(tree.flatten(params))
    return families.with_layout(config, False), params  # (read unrolled)


def save_bertjax(config: families.ModelConfig, params: dict[str, Any], path: str) -> None:
    """Writes a params-only bertjax checkpoint that `train.init_checkpoint` (and
    `pretrained_weights.load_pretrained`) reads, in the layer layout of `config` (`families.scanned` (a
    family without scanned layers: unrolled), its record `families.as_record`."""
    params = tree.unstack_layers(params)
    if families.scanned(config):
        params = tree.stack_layers(params)
    checkpoint.save_params(path, params, {"model": families.as_record(config)})


def save_tokenizer(tokenizer: tokenization.Tokenizer, directory: str) -> list[str]:
    """Writes the tokenizer (`vocab.txt` or `tokenizer.model`) and `TOKENIZER_FILE` (kind,
    casing, fingerprint) into `directory`; returns the names written."""
    files.makedirs(directory)
    spec: dict[str, Any] = {"fingerprint": tokenizer.fingerprint()}
    if isinstance(tokenizer, tokenization.WordPieceTokenizer):
        names = hf_tokenizer.save_vocab(tokenizer, directory)
        spec.update(
            kind="wordpiece",
            file=names[0],
            do_lower_case=tokenizer.do_lower_case,
            strip_accents=tokenizer.strip_accents,
            max_input_chars_per_word=tokenizer.max_input_chars_per_word,
        )
    elif isinstance(tokenizer, bpe.BpeTokenizer):
        names = bpe.save(tokenizer, directory)
        spec.update(kind="bpe", file=names[0])
    elif isinstance(tokenizer, tokenization.SentencePieceTokenizer):
        with files.open(os.path.join(directory, SENTENCEPIECE_FILE), "wb") as f:
            f.write(tokenizer.model_proto())
        names = [SENTENCEPIECE_FILE]
        spec.update(kind="sentencepiece", file=SENTENCEPIECE_FILE)
    else:
        raise tree.ConversionError(
            f"a {type(tokenizer).__name__} cannot be written beside a checkpoint"
        )
    tree.write_json(os.path.join(directory, TOKENIZER_FILE), spec)
    return [*names, TOKENIZER_FILE]


def tokenizer_beside(path: str) -> tokenization.Tokenizer | None:
    """The tokenizer `save_tokenizer` wrote beside the checkpoint at `path` (in it, or in the
    workdir above a seed's or a `checkpoints/` folder); None if there is none."""
    directories, path = [path], path.rstrip("/")
    for _ in range(2):  # WORKDIR/seed_N/checkpoints -> WORKDIR/seed_N -> WORKDIR
        if os.path.basename(path) != "checkpoints" and not os.path.basename(path).startswith(
            "seed_"
        ):
            break
        path = os.path.dirname(path)
        directories.append(path)
    for directory in directories:
        spec_path = os.path.join(directory, TOKENIZER_FILE)
        if files.isfile(spec_path):
            spec = tree.read_json_config(spec_path, "bertjax tokenizer")
            tokenizer = (
                bpe.BpeTokenizer(os.path.join(directory, spec["file"]))
                if spec["kind"] == "bpe"
                else tokenization.load_tokenizer(
                    spec["kind"],
                    os.path.join(directory, spec["file"]),
                    spec.get("do_lower_case", True),
                    spec.get("strip_accents"),
                    spec.get("max_input_chars_per_word", 200),
                )
            )
            if tokenizer.fingerprint() != spec["fingerprint"]:
                raise tree.ConversionError(
                    f"{os.path.join(directory, spec['file'])} is not the "
                    f"tokenizer {spec_path} recorded (its fingerprint "
                    "differs): the file was changed or replaced"
                )
            return tokenizer
    return None
