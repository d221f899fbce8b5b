"""The instances' statistics of Google's original `create_pretraining_data.py` and of bertjax on
the same text and settings, per seed, as mean +- sigma across seeds (sigma: the sample
standard deviation of the per-seed values; the standard error of the difference of the two
means is sqrt(sigma_original^2 / seeds + sigma_bertjax^2 / seeds)):

    python benchmarks/data_prep/original_statistics.py ORIGINAL VOCAB CORPUS \
        [--bytes=3000000] [--seeds=5] [--dupe_factor=3] [--whole_word_mask]

ORIGINAL is a checkout of https://github.com/google-research/bert (its
`create_pretraining_data.py` and `tokenization.py`; not part of this repository). Its
`create_training_instances` runs in this process with a stand-in `tensorflow` module that
provides only what it touches (`tf.flags`, `tf.logging`, `tf.gfile`), so no TensorFlow is
needed and nothing is written. bertjax prepares the same text with `pipeline.prepare`. CORPUS
is cut at the first document boundary after `--bytes`. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib
import logging
import os
import random
import runpy
import sys
import tempfile
import types

import numpy as np
from absl import flags as absl_flags

from bertjax.data import pipeline, tokenization
from bertjax.training.phase_schedule import Phase

MAX_SEQ_LENGTH, MAX_PREDICTIONS, MASKED_LM_PROB, SHORT_SEQ_PROB = 128, 20, 0.15, 0.1
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stand_in_tensorflow() -> types.ModuleType:
    """A module named `tensorflow` with the few names the original reads."""
    tf = types.ModuleType("tensorflow")
    values = absl_flags.FlagValues()
    tf.flags = types.SimpleNamespace(
        FLAGS=values,
        **{
            name: functools.partial(getattr(absl_flags, name), flag_values=values)
            for name in ("DEFINE_string", "DEFINE_bool", "DEFINE_integer", "DEFINE_float")
        },
    )
    log = logging.getLogger("original")
    tf.logging = types.SimpleNamespace(info=log.info, set_verbosity=log.setLevel, INFO=logging.INFO)
    tf.gfile = types.SimpleNamespace(GFile=open, Glob=glob.glob)
    return tf


def original_module(checkout: str, whole_word_mask: bool) -> types.ModuleType:
    sys.modules["tensorflow"] = _stand_in_tensorflow()
    sys.path.insert(0, checkout)
    module = importlib.import_module("create_pretraining_data")
    module.FLAGS.mark_as_parsed()
    module.FLAGS.do_whole_word_mask = whole_word_mask
    return module


def original_rows(
    module: types.ModuleType, tokenizer, corpus: str, seed: int, dupe_factor: int
) -> dict[str, np.ndarray]:
    """The original's instances for `seed`, as bertjax's stored arrays."""
    made = module.create_training_instances(
        [corpus],
        tokenizer,
        MAX_SEQ_LENGTH,
        dupe_factor,
        SHORT_SEQ_PROB,
        MASKED_LM_PROB,
        MAX_PREDICTIONS,
        random.Random(seed),
    )
    vocab, n = tokenizer.vocab, len(made)
    rows = {
        "input_ids": np.zeros((n, MAX_SEQ_LENGTH), np.int64),
        "masked_lm_positions": np.zeros((n, MAX_PREDICTIONS), np.int64),
        "masked_lm_ids": np.zeros((n, MAX_PREDICTIONS), np.int64),
    }
    for name in ("lengths", "b_starts", "num_predictions", "next_sentence_labels"):
        rows[name] = np.zeros(n, np.int64)
    for i, instance in enumerate(made):
        tokens = instance.tokens
        rows["input_ids"][i, : len(tokens)] = [vocab[t] for t in tokens]
        rows["lengths"][i] = len(tokens)
        rows["b_starts"][i] = instance.segment_ids.index(1)
        k = len(instance.masked_lm_positions)
        rows["num_predictions"][i] = k
        rows["masked_lm_positions"][i, :k] = instance.masked_lm_positions
        rows["masked_lm_ids"][i, :k] = [vocab[t] for t in instance.masked_lm_labels]
        rows["next_sentence_labels"][i] = int(instance.is_random_next)
    return rows


def bertjax_rows(
    vocab_file: str, corpus: str, seed: int, dupe_factor: int, whole_word_mask: bool, cache_dir: str
) -> dict[str, np.ndarray]:
    config = runpy.run_path(os.path.join(REPO, "configs/base.py"))["get_config"]()
    d = config.data
    d.source, d.input_files, d.text_format, d.vocab_file = "text", corpus, "lines", vocab_file
    d.dupe_factor, d.eval_fraction, d.num_workers, d.seed = dupe_factor, 0.0, 1, seed
    d.masked_lm_prob, d.short_seq_prob, d.whole_word_mask = (
        MASKED_LM_PROB,
        SHORT_SEQ_PROB,
        whole_word_mask,
    )
    try:  # (a checkout with typed data settings, or one before them)
        from bertjax.data.settings import DataSettings

        d = DataSettings.of(d)
    except ImportError:
        pass
    tokenizer = tokenization.load_tokenizer("wordpiece", vocab_file, True, None)
    phase = Phase("short", MAX_SEQ_LENGTH, MAX_PREDICTIONS, 256, 0, 10)
    stored = pipeline.prepare(d, phase, tokenizer, cache_dir)["train"].stored
    return {name: np.asarray(array, np.int64) for name, array in stored.items()}


def statistics(
    rows: dict[str, np.ndarray], continuation: np.ndarray, mask_id: int
) -> dict[str, float]:
    lengths, b_starts, counts = rows["lengths"], rows["b_starts"], rows["num_predictions"]
    n, width = rows["input_ids"].shape
    slot = np.arange(MAX_PREDICTIONS)[None] < counts[:, None]
    row_of = np.repeat(np.arange(n), counts)
    positions, labels = rows["masked_lm_positions"][slot], rows["masked_lm_ids"][slot]
    shown = rows["input_ids"][row_of, positions]
    original = rows["input_ids"].copy()
    original[row_of, positions] = labels
    masked = np.zeros((n, width), bool)
    masked[row_of, positions] = True
    # Words as the original's whole-word rule groups them: a "##" piece joins the one before.
    starts = ~continuation[original] | (np.arange(width)[None] == 0)
    word_of = np.maximum.accumulate(np.where(starts, np.arange(width)[None], 0), axis=1)
    flat_word = np.arange(n)[:, None] * width + word_of
    real = np.arange(width)[None] < lengths[:, None]
    size = np.bincount(flat_word[real], minlength=n * width)
    covered = np.bincount(flat_word[masked], minlength=n * width)
    words = flat_word[row_of, positions]
    multi = size[words] > 1
    wanted = np.minimum(MAX_PREDICTIONS, np.maximum(1, np.rint(lengths * MASKED_LM_PROB)))
    return {
        "instances": n,
        "tokens per instance": lengths.mean(),
        "share shorter than the maximum": (lengths < MAX_SEQ_LENGTH).mean(),
        "tokens in segment A": (b_starts - 2).mean(),
        "tokens in segment B": (lengths - b_starts - 1).mean(),
        "share random next (NSP label 1)": rows["next_sentence_labels"].mean(),
        "masked positions per instance": counts.mean(),
        "share of instances with fewer than the rule's count": (counts < wanted).mean(),
        "share [MASK]": (shown == mask_id).mean(),
        "share random token": ((shown != mask_id) & (shown != labels)).mean(),
        "share kept": (shown == labels).mean(),
        "share of masked positions in a multi-piece word": multi.mean(),
        "share of those whose whole word is masked": (
            covered[words][multi] == size[words][multi]
        ).mean(),
    }


def cut(corpus: str, size: int, directory: str) -> str:
    """The first documents of `corpus`, up to the first blank line after `size` bytes."""
    with open(corpus, encoding="utf-8") as f:
        text = f.read()
    end = text.find("\n\n", size)
    path = os.path.join(directory, "corpus.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text if end < 0 else text[: end + 2])
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("original", help="a checkout of github.com/google-research/bert")
    parser.add_argument("vocab")
    parser.add_argument("corpus")
    parser.add_argument("--bytes", type=int, default=3_000_000)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--dupe_factor", type=int, default=3)
    parser.add_argument("--whole_word_mask", action="store_true")
    args = parser.parse_args()
    module = original_module(args.original, args.whole_word_mask)
    tokenizer = module.tokenization.FullTokenizer(args.vocab, do_lower_case=True)
    tokenizer.tokenize = functools.lru_cache(maxsize=None)(tokenizer.tokenize)  # same ids
    vocab_words = list(tokenizer.vocab)
    continuation = np.zeros(max(tokenizer.vocab.values()) + 1, bool)
    continuation[[tokenizer.vocab[w] for w in vocab_words if w.startswith("##")]] = True
    mask_id = tokenizer.vocab["[MASK]"]
    results: dict[str, list[dict[str, float]]] = {"original": [], "bertjax": []}
    with tempfile.TemporaryDirectory() as scratch:
        corpus = cut(args.corpus, args.bytes, scratch)
        print(
            f"{os.path.getsize(corpus):,} bytes; L={MAX_SEQ_LENGTH}, {MAX_PREDICTIONS} "
            f"predictions, masked_lm_prob {MASKED_LM_PROB}, dupe_factor {args.dupe_factor}, "
            f"whole_word_mask {args.whole_word_mask}, seeds 1-{args.seeds}",
            flush=True,
        )
        for seed in range(1, args.seeds + 1):
            results["original"].append(
                statistics(
                    original_rows(module, tokenizer, corpus, seed, args.dupe_factor),
                    continuation,
                    mask_id,
                )
            )
            results["bertjax"].append(
                statistics(
                    bertjax_rows(
                        args.vocab,
                        corpus,
                        seed,
                        args.dupe_factor,
                        args.whole_word_mask,
                        os.path.join(scratch, f"bertjax_{seed}"),
                    ),
                    continuation,
                    mask_id,
                )
            )
            print(f"seed {seed} done", file=sys.stderr, flush=True)
    print(
        "| statistic | original | bertjax | difference / original's sigma | within 3 sigma "
        "| difference / its standard error |"
    )
    print("|---|---|---|---|---|---|")
    for name in results["original"][0]:
        o = np.array([r[name] for r in results["original"]], float)
        b = np.array([r[name] for r in results["bertjax"]], float)
        sigma, error = o.std(ddof=1), np.sqrt(o.var(ddof=1) / len(o) + b.var(ddof=1) / len(b))
        print(
            f"| {name} | {o.mean():.5g} ± {sigma:.2g} | {b.mean():.5g} ± {b.std(ddof=1):.2g} "
            f"| {_ratio(b.mean() - o.mean(), sigma):+.2f} "
            f"| {'yes' if abs(_ratio(b.mean() - o.mean(), sigma)) <= 3 else '**no**'} "
            f"| {_ratio(b.mean() - o.mean(), error):+.2f} |"
        )


def _ratio(difference: float, sigma: float) -> float:
    return difference / sigma if sigma > 0 else (0.0 if difference == 0 else float("inf"))


if __name__ == "__main__":
    main()
