"""Load a pretrained BERT or ModernBERT and its tokenizer from any checkpoint: a bertjax
pretraining run (workdir or `checkpoints/`), a params-only bertjax checkpoint, a Google TF
checkpoint or a Hugging Face directory (BERT or ModernBERT, told by config.json's
`model_type`). The one place that reads pretrained weights (`read`: numpy, unrolled layers)
and decides which architecture (`model_config_of`) and tokenizer (`tokenizer_of`) go with
them; `pretrained_weights` places them for a model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_collections

from bertjax.checkpoints import checkpoint
from bertjax.data import bpe, corpus_source, hf_json, pipeline, tokenization
from bertjax.data.settings import DataSettings
from bertjax.errors import UserError
from bertjax.interop import hf, hf_tokenizer, native, staging, tokenizer_fit, tree
from bertjax.interop.tree import ConversionError
from bertjax.models import families
from bertjax.runtime import files

FORMATS = ("tf", "hf", "bertjax")


def hf_family(path: str) -> families.Family:
    """The family of the Hugging Face directory at `path` (its config.json's `model_type`)."""
    values = tree.read_json_config(os.path.join(path, "config.json"), "Hugging Face")
    return families.by_hf_type(values.get("model_type", ""))


def load_hf(
    path: str, report: tree.LoadReport | None = None
) -> tuple[families.ModelConfig, dict[str, Any]]:
    """A Hugging Face directory of any family with a transformers form (`model_type`)."""
    return hf_family(path).hf_form.read(path, report)


def load_tf(
    path: str, report: tree.LoadReport | None = None
) -> tuple[families.ModelConfig, dict[str, Any]]:
    """A Google TF checkpoint, read by the family whose form it is (`families.tf_form`)."""
    return families.tf_form().read(path, report)


Loader = Callable[[str, tree.LoadReport], tuple[families.ModelConfig, dict[str, Any]]]
LOADERS: dict[str, Loader] = {"tf": load_tf, "hf": load_hf, "bertjax": native.load_bertjax}


class PretrainedError(UserError, ValueError):
    """No model or tokenizer can be taken from the given sources; the message says what to set."""


def detect_format(path: str) -> str:
    """'tf', 'hf' or 'bertjax', from the files at `path`."""
    if files.isfile(path + ".index") or path.endswith(".index"):
        return "tf"
    if files.isdir(path):
        names = set(files.listdir(path))
        if "config.json" in names and names & set(hf.HF_WEIGHT_FILES):
            return "hf"
        if any(n.endswith(".index") for n in names):
            return "tf"
        if "checkpoints" in names or any(n.isdigit() for n in names) or native.seed_dirs(path):
            return "bertjax"
    if not files.exists(path):
        raise ConversionError(f"{path} does not exist")
    raise ConversionError(
        "cannot tell the checkpoint format of " + path + ": expected a Google TF checkpoint "
        "(bert_config.json + bert_model.ckpt.index/.data-*), a Hugging Face directory "
        "(config.json + model.safetensors or pytorch_model.bin) or a bertjax checkpoint directory "
        "(a pretraining or fine-tuning workdir)"
    )


def exists(path: str) -> bool:
    """Whether a checkpoint is at `path` (a directory, or a TF checkpoint prefix)."""
    return bool(path) and (files.exists(path) or files.exists(path + ".index"))


def check_exists(path: str, field: str) -> None:
    """Refuses a checkpoint path that does not exist, before anything reads (or creates)
    it; `field` names the config field in the message."""
    if not exists(path):
        raise PretrainedError(
            f"{field}={path!r} does not exist; give a bertjax pretraining "
            "workdir, a Google TF or a Hugging Face checkpoint directory"
        )


def checkpoint_format(path: str) -> str:
    """`detect_format`, where a path that is no checkpoint at all reads as "bertjax" (whose
    reader names the problem)."""
    try:
        return detect_format(path)
    except ConversionError:
        return "bertjax"


def read(
    path: str, report: tree.LoadReport | None = None
) -> tuple[families.ModelConfig, dict[str, Any]]:
    """Any supported checkpoint (format detected; local or a URL) as `(config, numpy params)`,
    unrolled layers."""
    report = report if report is not None else tree.LoadReport()
    source_format = detect_format(path)
    local = staging.local_checkpoint(path, source_format)
    found = LOADERS[source_format](local, report)
    report.source = path if local != path else report.source
    return found


@functools.lru_cache(maxsize=1)
def read_once(path: str) -> tuple[families.ModelConfig, dict[str, Any]]:
    """`read(path)`, once per process (every fine-tuning seed loads the same weights)."""
    return read(path)


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a model and its tokenizer come from, and what a run changes of the model: the
    fields of the same names in a fine-tuning config (configs/finetune/common.py)."""

    init_checkpoint: str = ""  # bertjax run, Google TF or Hugging Face checkpoint
    model_config: str = ""  # bert_config.json: architecture without (or overriding) one
    vocab_file: str = ""  # overrides the checkpoint's tokenizer
    tokenizer: str = ""  # "wordpiece" | "sentencepiece" | "bpe" for vocab_file; empty = by name
    do_lower_case: bool = True
    dtype: str = "float32"
    vocab_flag: str = "--config.vocab_file"  # the flag that sets vocab_file, for messages
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    classifier_pooling: str = ""  # ModernBERT: "cls" | "mean"; empty = the checkpoint's

    @classmethod
    def frozen(cls, init_checkpoint: str, vocab_file: str, do_lower_case: bool) -> Source:
        """A model read for its features (extract_features, probe): no dropout, and the
        tokenizer overridden by a `--vocab_file` flag."""
        return cls(
            init_checkpoint=init_checkpoint,
            vocab_file=vocab_file,
            do_lower_case=do_lower_case,
            vocab_flag="--vocab_file",
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )


class PretrainingRun(NamedTuple):
    """What a run takes from `init_checkpoint`: architecture fields, and for a bertjax run
    its pretraining config and the fingerprint of the tokenizer it was trained with (and for
    a fine-tuned model, the task it was fine-tuned on: a run takes only its encoder)."""

    model: dict
    config: ml_collections.ConfigDict | None = None
    tokenizer_fingerprint: str | None = None
    finetuned_task: str = ""
    format: str = ""  # "tf", "hf" or "bertjax", detected once (`checkpoint_format`); "": none


def architecture_of(path: str) -> families.ModelConfig:
    """The model config of the checkpoint at `path` (any format; local or a URL), from its
    config file alone: a Hugging Face `config.json`, Google's `bert_config.json` (its
    family's `TfForm`), a bertjax run's recorded config. No weights are read."""
    return _architecture(path, detect_format(path))


def _architecture(path: str, source_format: str) -> families.ModelConfig:
    """`architecture_of` the checkpoint at `path`, in `source_format`."""
    if source_format == "bertjax":
        return native.config_of(native.checkpoint_dir(path))
    if source_format == "hf":
        values = tree.read_json_config(os.path.join(path, "config.json"), "Hugging Face")
        return families.by_hf_type(values.get("model_type", "")).hf_form.config(values, path)
    return families.tf_form().config(path if files.isdir(path) else os.path.dirname(path))


def pretraining_run(source: Source) -> PretrainingRun:
    """The architecture (and bertjax run metadata) of `source.init_checkpoint`."""
    if not source.init_checkpoint:
        return PretrainingRun({})
    path = source.init_checkpoint
    check_exists(path, "init_checkpoint")
    source_format = checkpoint_format(path)
    if source_format != "bertjax":  # architecture from bert_config.json/config.json
        return PretrainingRun(
            families.as_record(_architecture(path, source_format)),
            finetuned_task=hf.finetuned_task(path) if source_format == "hf" else "",
            format=source_format,
        )
    directory = native.checkpoint_dir(source.init_checkpoint)
    try:
        meta = checkpoint.read_meta(directory)
    except FileNotFoundError as e:
        raise PretrainedError(f"init_checkpoint={source.init_checkpoint!r}: {e}") from e
    if "task" in meta:  # a fine-tuned model: its encoder and tokenizer
        return PretrainingRun(
            families.as_record(native.config_from_meta(meta, directory)),
            tokenizer_fingerprint=meta.get("tokenizer_fingerprint"),
            finetuned_task=meta["task"] or json.loads(meta["config"])["kind"],
            format=source_format,
        )
    config = json.loads(meta["config"]) if "config" in meta else None  # None: params-only
    return PretrainingRun(
        meta["model"],
        config and ml_collections.ConfigDict(config),
        meta.get("tokenizer"),
        format=source_format,
    )


def model_config_of(source: Source, pretrain: PretrainingRun) -> families.ModelConfig:
    """Architecture from the checkpoint (or `model_config` JSON), dropout/dtype from `source`,
    as its family takes them (`Family.finetune_config`)."""
    values = dict(pretrain.config.model.to_dict()) if pretrain.config else {}
    values.update(pretrain.model)
    return families.get(families.family(values)).finetune_config(values, source)


def tokenizer_of(
    source: Source,
    pretrain: PretrainingRun,
    configured: Callable[[], tokenization.Tokenizer] | None = None,
) -> tokenization.Tokenizer:
    """The one rule of every entry point (train, finetune, extract_features, probe): the
    tokenizer `source.vocab_file` names, else init_checkpoint's own (`own_tokenizer`), else
    `configured()` (pretraining's: a named vocab file, or a SentencePiece model trained on the
    corpus; without one, refused). Refused unless its ids are the checkpoint's
    (`tokenizer_fit.check`): the same fingerprint as a bertjax run recorded, the same token
    at every id as the tokenizer beside it, and no more ids than its embedding rows."""
    if source.vocab_file:
        named = (
            configured()
            if configured and not files.isdir(source.vocab_file)
            else _vocab_file_tokenizer(source)
        )
        if source.init_checkpoint and isinstance(named, tokenization.WordPieceTokenizer):
            try:
                tokenizer_fit.validate_case(
                    source.init_checkpoint,
                    named.do_lower_case,
                    source.vocab_file,
                    source.vocab_flag.replace("vocab_file", "do_lower_case"),
                )
            except ConversionError as e:
                raise PretrainedError(str(e)) from None
        what = f"{source.vocab_flag}={source.vocab_file}"
        own = own_tokenizer(source, pretrain, rebuild=False) if source.init_checkpoint else None
    else:
        own = own_tokenizer(source, pretrain, rebuild=True, required=configured is None)
        if own is None:
            assert configured is not None  # (else own_tokenizer refused)
            named = configured()
        else:
            named = own
        what = (
            "the tokenizer rebuilt from the pretraining corpus"
            if pretrain.config is not None
            else f"the tokenizer of {source.init_checkpoint}"
            if own
            else "the run's tokenizer"
        )
    record = pretrain.model  # (the checkpoint's architecture)
    found = source.init_checkpoint and tokenizer_fit.problem(
        named,
        what,
        own,
        pretrain.tokenizer_fingerprint,
        record.get("vocab_size"),
        source.init_checkpoint,
        source.vocab_flag,
    )
    if found:
        raise PretrainedError(found)
    return named


def own_tokenizer(
    source: Source, pretrain: PretrainingRun, rebuild: bool, required: bool = False
) -> tokenization.Tokenizer | None:
    """The tokenizer `source.init_checkpoint` comes with: the one beside it (Google, Hugging
    Face, a converted or fine-tuned bertjax directory), else its pretraining run's (`rebuild`:
    trained again from that run's corpus where it is not cached; otherwise None). None where
    the checkpoint has none, unless `required` (then refused, naming what to pass)."""
    path = source.init_checkpoint
    if not path:
        if required:
            raise PretrainedError(
                f"set {source.vocab_flag} (no init_checkpoint to take the tokenizer from)"
            )
        return None
    if pretrain.config is not None:  # a bertjax pretraining run
        return _pretraining_tokenizer(source, pretrain, rebuild)
    source_format = pretrain.format or checkpoint_format(path)
    beside = native.tokenizer_beside(path) if source_format == "bertjax" else None
    if beside is None and (required or tokenizer_fit.files_beside(path)):
        beside = checkpoint_tokenizer(
            path, source.do_lower_case, source.vocab_flag, pretrain.format
        )
    return beside


def _vocab_file_tokenizer(source: Source) -> tokenization.Tokenizer:
    """The tokenizer `source.vocab_file` names: a file of `source.tokenizer`'s kind (else the
    kind its content shows), a tokenizer.json read as transformers reads it, or a directory
    holding one (as a Hugging Face checkpoint does: `checkpoint_tokenizer`)."""
    path = source.vocab_file
    try:
        if files.isdir(path) or (not source.tokenizer and path.endswith(".json")):
            return _tokenizer_from(
                path,
                hf_tokenizer.tokenizer_file(path)
                if files.isdir(path)
                else hf_tokenizer.json_tokenizer_file(path),
                source.do_lower_case,
                source.vocab_flag,
            )
        kind = (
            source.tokenizer
            or tokenization.file_kind(path)
            or ("sentencepiece" if path.endswith(".model") else "wordpiece")
        )
        return tokenization.load_tokenizer(
            kind,
            path,
            source.do_lower_case,
            flag_prefix=source.vocab_flag.removesuffix("vocab_file"),
        )
    except (ValueError, FileNotFoundError) as e:  # (e.g. not a SentencePiece model)
        raise PretrainedError(f"{source.vocab_flag}={path}: {e}") from e


def checkpoint_tokenizer(
    path: str, do_lower_case: bool | None, vocab_flag: str = "", source_format: str = ""
) -> tokenization.Tokenizer:
    """The `vocab.txt`, SentencePiece model or `tokenizer.json` beside the Google / Hugging Face
    checkpoint at `path` (local or a URL; `source_format`: its format, if known):
    `_tokenizer_from`."""
    try:
        local = staging.local_checkpoint(path, source_format or detect_format(path))
        found = hf_tokenizer.tokenizer_file(local if files.isdir(local) else os.path.dirname(local))
    except (ConversionError, pipeline.DataError) as e:
        raise PretrainedError(f"{e}; pass {vocab_flag}=PATH" if vocab_flag else str(e)) from None
    try:
        return _tokenizer_from(path, found, do_lower_case, vocab_flag)
    except UserError:
        raise
    except ValueError as e:  # (e.g. a vocab.txt without BERT's special tokens)
        raise PretrainedError(f"{e}; pass {vocab_flag}=PATH" if vocab_flag else str(e)) from None


def _tokenizer_from(
    path: str,
    found: tuple[str, str, hf_json.Casing | None],
    do_lower_case: bool | None,
    vocab_flag: str,
) -> tokenization.Tokenizer:
    """The tokenizer of `found` (`hf_tokenizer.tokenizer_file`'s answer for `path`). WordPiece
    from `vocab.txt` is lower-cased as `do_lower_case` says (checked against the checkpoint's
    name), or for None as the name or else the vocabulary says; a `tokenizer.json` cases as it
    says (`do_lower_case` must agree)."""
    kind, vocab, casing = found
    if kind == "bpe":
        try:
            return bpe.BpeTokenizer(vocab)
        except pipeline.DataError as e:
            raise PretrainedError(
                f"{e}; pass {vocab_flag}=PATH" if vocab_flag else str(e)
            ) from None
    if kind == "sentencepiece":
        return tokenization.SentencePieceTokenizer(vocab)
    flag = (vocab_flag or "--vocab_file").replace("vocab_file", "do_lower_case")
    if casing is not None:  # a tokenizer.json, which says how it cases text
        if do_lower_case is not None and do_lower_case != casing.do_lower_case:
            raise PretrainedError(
                f"the tokenizer.json of {path} is {'un' if casing.do_lower_case else ''}cased "
                f"but do_lower_case={do_lower_case}; set {flag}={casing.do_lower_case}"
            )
        return tokenization.WordPieceTokenizer(vocab, **casing._asdict())
    if do_lower_case is None:
        do_lower_case = tokenizer_fit.checkpoint_case(path)
    if do_lower_case is None:
        try:
            tokenizer_fit.validate_case(path, True, vocab, flag)
            do_lower_case = True
        except ConversionError:  # upper-case tokens: a cased vocabulary
            do_lower_case = False
    tokenizer_fit.validate_case(path, do_lower_case, vocab, flag)
    return tokenization.load_tokenizer("wordpiece", vocab, do_lower_case)


def _pretraining_tokenizer(
    source: Source, pretrain: PretrainingRun, rebuild: bool = True
) -> tokenization.Tokenizer | None:
    """The pretraining run's tokenizer: its vocab_file, else the SentencePiece model in its
    data cache whose fingerprint the checkpoint recorded (found even if the corpus has since
    moved or been touched), else (`rebuild`; otherwise None) one trained again from the
    corpus."""
    assert pretrain.config is not None  # (a bertjax run's: read with its config)
    data = pretrain.config.data
    workdir = os.path.dirname(native.checkpoint_dir(source.init_checkpoint).rstrip("/"))
    cache_dir = data.cache_dir or files.local_cache_dir(workdir)
    if not data.vocab_file and pretrain.tokenizer_fingerprint and os.path.isdir(cache_dir):
        for name in sorted(os.listdir(cache_dir)):
            if name.startswith("sentencepiece_") and name.endswith(".model"):
                candidate = tokenization.SentencePieceTokenizer(os.path.join(cache_dir, name))
                if candidate.fingerprint() == pretrain.tokenizer_fingerprint:
                    return candidate
    if not rebuild and not data.vocab_file:
        return None
    if not data.vocab_file and not os.path.isdir(cache_dir):
        raise PretrainedError(
            f"the pretraining run's SentencePiece model is not in {cache_dir}; "
            f"pass {source.vocab_flag}=PATH.model"
        )
    try:
        return corpus_source.load_or_train_tokenizer(
            DataSettings.of(data, recorded=True), cache_dir
        )
    except (pipeline.DataError, OSError) as e:
        raise PretrainedError(
            f"cannot rebuild the tokenizer of init_checkpoint="
            f"{source.init_checkpoint!r} ({e}); pass "
            f"{source.vocab_flag}=PATH"
        ) from e
