"""Padding before and after `data.packing` on a real corpus, through the project's own
preparation path (`data.pipeline.prepare`, the config's masking and instance settings).

    nice -n 19 python benchmarks/packing/padding.py \
        --input_files='$DATA/gutenberg/*.txt' \
        --vocab_file=$DATA/bert-base-uncased/vocab.txt \
        --out=benchmarks/packing/gutenberg_padding.json

Prepares the train split at 128 (20 predictions) and 512 (80) tokens with configs/base.py's data
settings (static masking, dupe_factor 10, short_seq_prob 0.1), for each `data.text_format`
asked for, then packs it with `packing.PackedLoader` for several `data.packing_max_instances`
and records how full the rows are. `auto` reads these books as `paragraphs` (a book is a
document); `lines` is the original script's reading (a line is a sentence, a blank line ends a
document: every paragraph becomes a document).
"""

import json
import os
import runpy
import sys
import tempfile
import time

from absl import app, flags

from bertjax.data import corpus_source, loaders, packing, pipeline
from bertjax.data.settings import DataSettings
from bertjax.training.phase_schedule import Phase

FLAGS = flags.FLAGS
flags.DEFINE_string("input_files", None, "Corpus files (comma-separated globs).")
flags.DEFINE_string("vocab_file", None, "WordPiece vocab.txt.")
flags.DEFINE_string(
    "cache_dir",
    os.path.join(tempfile.gettempdir(), "bertjax_packing_padding"),
    "Where the prepared data is cached (outside the project).",
)
flags.DEFINE_list("max_instances", ["2", "3", "4", "8"], "data.packing_max_instances to try.")
flags.DEFINE_list("text_formats", ["auto", "lines"], "data.text_format values to measure.")
flags.DEFINE_string("out", "", "Write the results as JSON here.")


def main(argv):
    del argv
    base = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "base.py"))
    data_cfg = base["get_config"]().data
    data_cfg.update(
        source="text",
        input_files=FLAGS.input_files,
        tokenizer="wordpiece",
        vocab_file=FLAGS.vocab_file,
        num_workers=1,
    )
    tokenizer = corpus_source.load_or_train_tokenizer(DataSettings.of(data_cfg), FLAGS.cache_dir)
    specials = corpus_source.specials_of(tokenizer, data_cfg.whole_word_mask)
    results = {
        "command": " ".join(["python", *sys.argv]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": data_cfg.to_dict(),
        "text_formats": {},
    }
    for text_format in FLAGS.text_formats:
        data_cfg.text_format = text_format
        results["text_formats"][text_format] = measure(
            DataSettings.of(data_cfg), tokenizer, specials.pad_id
        )
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=1)


def measure(data_cfg: DataSettings, tokenizer, pad_id):
    """Padding unpacked and packed at 128 and 512 tokens for one text format."""
    results = {}
    for length, predictions in ((128, 20), (512, 80)):
        phase = Phase(f"l{length}", length, predictions, 1, 0, 1)
        start = time.time()
        split = pipeline.prepare(data_cfg, phase, tokenizer, FLAGS.cache_dir)["train"]
        prepared_s = time.time() - start
        source = loaders.BatchLoader(split, 1, data_cfg.seed)
        rows = {}
        for max_instances in map(int, FLAGS.max_instances):
            start = time.time()
            loader = packing.PackedLoader(
                source,
                length,
                max_instances,
                packing.predictions_per_row(
                    length, predictions, data_cfg.masked_lm_prob, max_instances
                ),
                pad_id,
            )
            stats = loader.stats
            rows[max_instances] = {
                "rows": stats.rows,
                "instances_per_row": stats.instances_per_row,
                "padding_packed": stats.padding_packed,
                "plan_seconds": time.time() - start,
                "real_token_bound_gain": (1 - stats.padding_packed) / (1 - stats.padding_unpacked),
            }
            print(
                f"{data_cfg.text_format} L={length} K={max_instances}: {stats.summary()}",
                flush=True,
            )
        results[length] = {
            "instances": stats.instances,
            "real_tokens": stats.real_tokens,
            "mean_real_tokens": stats.real_tokens / stats.instances,
            "padding_unpacked": stats.padding_unpacked,
            "prepare_seconds": prepared_s,
            "packed": rows,
        }
    return results


if __name__ == "__main__":
    flags.mark_flags_as_required(["input_files", "vocab_file"])
    app.run(main)
