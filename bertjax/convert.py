"""`python -m bertjax.convert SRC DST [--to=tf|hf|bertjax]`: converts BERT checkpoints
between Google TF, Hugging Face and bertjax (formats in `bertjax.interop`).

    python -m bertjax.convert uncased_L-12_H-768_A-12 bert_base_bertjax      # TF -> bertjax
    python -m bertjax.convert bert_base_bertjax bert_base_hf                 # bertjax -> HF
    python -m bertjax.convert hf_dir out.ckpt --to=tf                        # HF -> TF
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time

from bertjax import pretrained
from bertjax.interop import hf, native, tf, tree

SAVERS = {"tf": tf.save_tf, "hf": hf.save_hf, "bertjax": native.save_bertjax}


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bertjax.convert",
        description="Convert BERT checkpoints between Google TF, Hugging Face and bertjax.")
    parser.add_argument("src", help="source checkpoint (format detected)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--to", choices=pretrained.FORMATS, default=None,
                        help="output format; default: bertjax for TF/HF sources, hf for bertjax")
    parser.add_argument("--scan_layers", action="store_true",
                        help="bertjax output with stacked (scanned) layers")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    try:
        source_format = pretrained.detect_format(args.src)
        target = args.to or ("hf" if source_format == "bertjax" else "bertjax")
        report = tree.LoadReport()
        config, params = pretrained.LOADERS[source_format](args.src, report)
        print(report.summary(), flush=True)
        if target == "bertjax":
            config = dataclasses.replace(config, scan_layers=args.scan_layers)
        SAVERS[target](config, params, args.dst)
    except (tree.ConversionError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    source_dir = args.src if os.path.isdir(args.src) else os.path.dirname(args.src)
    vocab = os.path.join(source_dir, "vocab.txt")
    if target != "bertjax" and os.path.isfile(vocab):
        shutil.copy(vocab, os.path.join(args.dst, "vocab.txt"))
    print(f"wrote {target} checkpoint {args.dst} ({report.mapped} tensors, "
          f"{time.perf_counter() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
