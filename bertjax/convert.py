"""`python -m bertjax.convert SRC DST [--to=tf|hf|bertjax]`: converts BERT checkpoints
between Google TF, Hugging Face and bertjax (formats in `bertjax.interop`).

    python -m bertjax.convert uncased_L-12_H-768_A-12 bert_base_bertjax      # TF -> bertjax
    python -m bertjax.convert bert_base_bertjax bert_base_hf                 # bertjax -> HF
    python -m bertjax.convert hf_dir out.ckpt --to=tf                        # HF -> TF

A ModernBERT run (`config.model.family="modernbert"`) exports to Hugging Face as a
`ModernBertForMaskedLM` (a fine-tuned one as its task's `ModernBertFor...` class); a
Hugging Face ModernBERT directory converts to a bertjax checkpoint with its BPE
`tokenizer.json` (docs/modernbert.md). ModernBERT has no TF form.
A fine-tuned model (a `python -m bertjax.finetune` workdir: its best seed) exports to the
transformers class of its task (`BertForSequenceClassification`, `BertForTokenClassification`,
`BertForQuestionAnswering`) with its label names. A Hugging Face export also holds the
checkpoint's tokenizer (what `AutoTokenizer` loads) and a model card (`README.md`); a TF export
holds the WordPiece `vocab.txt`; a bertjax export holds the tokenizer that every bertjax
command finds beside it.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bertjax import cli
from bertjax.errors import UserError
from bertjax.interop import export, finetuned, hf, native, pretrained, tree
from bertjax.models import families
from bertjax.runtime import console


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = cli.ArgumentParser(
        prog="python -m bertjax.convert",
        description="Convert BERT checkpoints between Google TF, Hugging Face and bertjax.",
    )
    parser.add_argument("src", help="source checkpoint (format detected)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument(
        "--to",
        choices=pretrained.FORMATS,
        default=None,
        help="output format; default: bertjax for TF/HF sources, hf for bertjax",
    )
    parser.add_argument(
        "--scan_layers", action="store_true", help="bertjax output with stacked (scanned) layers"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty DST whole (otherwise it is refused)",
    )
    parser.add_argument(
        "--verbosity", type=int, default=0, help="1: the libraries' full log (Orbax, JAX)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0912, PLR0915 (the command: each format pair in one sequence)
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    console.configure_console(args.verbosity)
    start = time.perf_counter()
    final_dst = args.dst
    try:
        pretrained.check_exists(args.src, "SRC")
        if os.path.isdir(args.dst) and os.listdir(args.dst) and not args.overwrite:
            raise FileExistsError(
                f"DST {args.dst} is not empty: choose another directory, or "
                "pass --overwrite to replace it whole"
            )
        if "://" not in final_dst:  # written beside it, then moved into place whole
            args.dst = f"{final_dst.rstrip('/')}.tmp{os.getpid()}"
            shutil.rmtree(args.dst, ignore_errors=True)
        source_format = pretrained.detect_format(args.src)
        target = args.to or ("hf" if source_format == "bertjax" else "bertjax")
        report = tree.LoadReport()
        config, params = pretrained.read(args.src, report)
        print(report.summary(), flush=True)
        if source_format == "bertjax":
            directory = native.checkpoint_dir(args.src)
            print(
                f"step {native.latest_step(directory)}: the latest checkpoint in {directory}",
                flush=True,
            )
        family = families.of(config)
        family.check_export(config, params, args.src, source_format, target, args.scan_layers)
        if (target == "hf" and family.hf is None) or (target == "tf" and family.tf is None):
            raise tree.ConversionError(
                f"{args.src} holds a {family.title} model, which has no "
                f"{'transformers class' if target == 'hf' else 'Google TF form'}: pass --to=bertjax"
            )
        task_config = native.finetuned_config(args.src) if source_format == "bertjax" else None
        head = (
            finetuned.hf_head(task_config, params, family.hf_form)
            if task_config and target == "hf"
            else None
        )
        if target == "hf" and not task_config and family.encoder_only(params):
            head = finetuned.encoder_only(family.hf_form)  # (imported from a fine-tuned model)
        if target == "bertjax":
            config = families.with_layout(config, args.scan_layers)
        num_params = sum(int(np.size(v)) for v in tree.flatten(params).values())
        tokenizer = export.checkpoint_tokenizer(args.src, source_format, args.dst)
        if tokenizer is not None:
            config = export.with_tokenizer_padding(config, tokenizer)
        save: Callable[..., Any] = (
            functools.partial(
                family.hf_form.write, pad_token_id=tokenizer.pad_id if tokenizer else 0
            )
            if target == "hf"
            else family.tf_form.write
            if target == "tf"
            else native.save_bertjax
        )
        if head:
            num_params = save(config, params, args.dst, head)
            print(
                f"{'fine-tuned model' if task_config else 'encoder only'}: {head.architecture}"
                + (
                    f", labels {list(head.config['id2label'].values())}"
                    if "id2label" in head.config
                    else ""
                ),
                flush=True,
            )
        else:
            save(config, params, args.dst)
        facts = export.export_tokenizer(tokenizer, config, target, args.dst) if tokenizer else []
        if target == "hf":
            facts.append(("converted from", f"`{args.src}` ({source_format})"))
            if source_format == "bertjax":
                facts += export.run_facts(args.src)
            hf.write_model_card(
                args.dst,
                config,
                num_params,
                facts,
                head,
                os.path.basename(os.path.normpath(final_dst)),
            )
        if args.dst != final_dst:
            shutil.rmtree(final_dst, ignore_errors=True)  # (empty, or --overwrite)
            os.replace(args.dst, final_dst)
            args.dst = final_dst
    except (UserError, FileNotFoundError, FileExistsError) as e:
        console.error(str(e))
        return 1
    finally:
        if args.dst != final_dst:
            shutil.rmtree(args.dst, ignore_errors=True)
    print(
        f"wrote {target} checkpoint {args.dst} ({report.mapped} tensors, "
        f"{time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
