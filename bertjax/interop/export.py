"""What a converted checkpoint holds beside its weights: the source's tokenizer (a bertjax
run's own, else the one beside the weights) written in the target format's layout, the
padding id a family's config takes from it, and the model-card rows about the bertjax run
that wrote the source (`python -m bertjax.convert`)."""

from __future__ import annotations

import json
import os

from bertjax.data import tokenization
from bertjax.interop import hf_tokenizer, native, pretrained, tree
from bertjax.models import families
from bertjax.runtime import console, files


def source_tokenizer(src: str, source_format: str) -> tokenization.Tokenizer:
    """The tokenizer of the checkpoint at `src`: a bertjax run's own, else the `vocab.txt` or
    SentencePiece model beside the weights (Google, Hugging Face or a converted bertjax
    checkpoint), WordPiece lower-cased unless the directory's name or the vocabulary says it
    is cased."""
    if source_format == "bertjax":
        source = pretrained.Source(init_checkpoint=src)
        run = pretrained.pretraining_run(source)
        if run.config is not None or native.tokenizer_beside(src) is not None:
            return pretrained.tokenizer_of(source, run)
    return pretrained.checkpoint_tokenizer(src, None, source_format=source_format)


def run_facts(src: str) -> list[tuple[str, str]]:
    """Model-card rows about the bertjax run that wrote `src`: data, steps, final metrics."""
    directory = native.checkpoint_dir(src)
    run = pretrained.pretraining_run(pretrained.Source(init_checkpoint=src))
    facts = []
    if run.config is not None:
        data, train = run.config.data, run.config.train
        corpus = {
            "default": "the embedded default corpus (Python standard library documentation)",
            "text": f"text files `{data.input_files}`",
            "tfds": f"tfds `{data.tfds_name}`",
        }.get(data.source, data.source)
        steps = native.latest_step(directory)
        facts += [
            ("pretraining data", corpus),
            (
                "steps",
                f"{steps:,} of {train.total_steps:,}, global batch "
                f"{train.global_batch_size}, sequence length {data.max_seq_length}"
                + (
                    f" ({run.config.long_phase.fraction:.0%} of the steps at "
                    f"{run.config.long_phase.max_seq_length})"
                    if run.config.long_phase.fraction
                    else ""
                ),
            ),
        ]
    seed_summary = os.path.join(os.path.dirname(directory.rstrip("/")), "summary.json")
    if run.finetuned_task and files.isfile(seed_summary):
        with files.open(seed_summary, encoding="utf-8") as f:
            seed = json.load(f)
        facts.append(
            (
                "fine-tuning",
                f"{run.finetuned_task}, seed {seed['seed']}, best epoch "
                f"{seed['best_epoch']}: "
                + "; ".join(
                    f"{split} " + ", ".join(f"{k} {v:.4f}" for k, v in values.items())
                    for split, values in seed["dev"].items()
                ),
            )
        )
    final = os.path.join(os.path.dirname(directory.rstrip("/")), "final_metrics.json")
    if files.isfile(final):
        with files.open(final, encoding="utf-8") as f:
            values = json.load(f)
        facts.append(
            (
                "final held-out metrics",
                ", ".join(f"{k} {v:.4f}" for k, v in sorted(values.items()) if k != "step"),
            )
        )
    return facts


def _tokenizer_failed(dst: str, error: Exception) -> None:
    console.warning(f"no tokenizer written to {dst}: {error}")


def checkpoint_tokenizer(src: str, source_format: str, dst: str) -> tokenization.Tokenizer | None:
    """`source_tokenizer`, or None with a warning that `dst` gets none."""
    try:
        return source_tokenizer(src, source_format)
    except (pretrained.PretrainedError, tree.ConversionError, ValueError) as e:
        _tokenizer_failed(dst, e)
        return None


def with_tokenizer_padding(
    config: families.ModelConfig, tokenizer: tokenization.Tokenizer
) -> families.ModelConfig:
    """The config of a family whose config names the tokenizer's [PAD] (`Family.tokenizer_pad`:
    ModernBERT) with its tokenizer's padding id, what the export's config.json names (a run
    recorded before this was checked may say otherwise; the id does not change what the
    weights compute)."""
    family = families.of(config)
    pad_token_id = family.pad_id(config)
    if not family.tokenizer_pad or pad_token_id == tokenizer.pad_id:
        return config
    console.say(
        f"pad_token_id={tokenizer.pad_id}: the tokenizer's [PAD] (the checkpoint's config "
        f"says {pad_token_id}, another token there)"
    )
    return family.with_pad_id(config, tokenizer.pad_id)


def export_tokenizer(
    tokenizer: tokenization.Tokenizer, config: families.ModelConfig, target: str, dst: str
) -> list[tuple[str, str]]:
    """Writes the tokenizer files `target` holds into `dst`; returns model-card rows."""
    try:
        if target == "hf":
            names = hf_tokenizer.save_tokenizer(
                tokenizer,
                dst,
                config.max_position_embeddings,
                token_type_ids=families.of(config).token_type_ids,
            )
        elif target == "bertjax":  # found beside the checkpoint by every bertjax command
            names = native.save_tokenizer(tokenizer, dst)
        elif isinstance(tokenizer, tokenization.WordPieceTokenizer):  # Google's layout
            names = hf_tokenizer.save_vocab(tokenizer, dst)
        else:
            return []
    except (tree.ConversionError, ValueError) as e:
        _tokenizer_failed(dst, e)
        return []
    kind = type(tokenizer).__name__.replace("Tokenizer", "")
    if isinstance(tokenizer, tokenization.WordPieceTokenizer):
        kind += ", lower-cased" if tokenizer.do_lower_case else ", cased"
    console.say(f"tokenizer ({kind}): {', '.join(names)}")
    return [("tokenizer", f"{kind}, {tokenizer.vocab_size:,} tokens (`{names[0]}`)")]
