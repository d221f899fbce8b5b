"""`python -m bertjax.probe --init_checkpoint=DIR --task=conll2003,sst2 --workdir=DIR`: which
layer knows what. Freezes the encoder, trains one small probe per layer (embeddings, 1..N)
and per combination of the paper's Table 7 on each task, with the same budget and seeds, and
writes `probe.json` (dev metric per layer and combination: mean, std, median, per seed) and
`probe.png` (metric against layer, one line per task). Needs matplotlib (`pip install -e
'.[plot]'`) for the picture.

The checkpoint is a bertjax run, a Google TF or a Hugging Face directory; `--random_init`
probes the same architecture with fresh weights (the floor a pretrained encoder must beat).
Data as for fine-tuning: `--glue_dir` (GLUE download layout), `--conll_dir` (CoNLL files), or
tfds when empty.
"""

from __future__ import annotations

import json
import os

from absl import flags

from bertjax import cli
from bertjax.errors import UserError
from bertjax.interop import pretrained, pretrained_weights
from bertjax.models import families
from bertjax.runtime import files
from bertjax.tasks import features, probing

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("init_checkpoint", None, "bertjax run, Google TF or Hugging Face dir")
    flags.DEFINE_string("task", "conll2003", "comma-separated: conll2003 and/or GLUE tasks")
    flags.DEFINE_string("workdir", None, "where probe.json and probe.png are written")
    flags.DEFINE_bool("random_init", False, "the checkpoint's architecture, random weights")
    flags.DEFINE_string("glue_dir", "", "GLUE data (download layout); empty = tfds glue/<task>")
    flags.DEFINE_string("conll_dir", "", "CoNLL-2003 files; empty = tfds conll2003")
    flags.DEFINE_string("tfds_data_dir", "", "tfds data_dir; empty = tfds default")
    flags.DEFINE_string("vocab_file", "", "overrides the checkpoint's tokenizer")
    flags.DEFINE_bool("do_lower_case", True, "for vocab_file / Google and HF checkpoints")
    flags.DEFINE_integer("max_seq_length", 128, "tokens per sequence")
    flags.DEFINE_integer("max_train_examples", 0, "random subset of each training set; 0 = all")
    flags.DEFINE_string("seeds", "1,2,3", "one probe per seed, layer and combination")
    flags.DEFINE_integer("epochs", 10, "passes over the training features per probe")
    flags.DEFINE_integer("batch_size", 64, "probe batch (examples; tokens for conll2003)")
    flags.DEFINE_float("learning_rate", 1e-3, "probe learning rate (Adam)")
    flags.DEFINE_integer("hidden_size", 0, "0: linear probes; else one ReLU hidden layer")
    flags.mark_flags_as_required(["init_checkpoint", "workdir"])


def write_outputs(record: dict, workdir: str, title: str) -> str:
    """Writes `probe.json` and (with matplotlib) `probe.png` into `workdir` (a local path or a
    URL, through `bertjax.runtime.files`); returns the line saying what was written."""
    files.makedirs(workdir)
    files.write_text(os.path.join(workdir, "probe.json"), json.dumps(record, indent=1))
    try:
        probing.plot(record, os.path.join(workdir, "probe.png"), title)
    except ImportError as e:  # the plot is optional; the numbers are in probe.json
        return f"Wrote {workdir}/probe.json; no probe.png: {e}"
    return f"Wrote {workdir}/probe.json and probe.png"


def main(argv: list[str]) -> None:
    del argv
    try:
        seeds = tuple(cli.integers("seeds", FLAGS.seeds))
        settings = probing.ProbeSettings(
            seeds, FLAGS.epochs, FLAGS.batch_size, FLAGS.learning_rate, FLAGS.hidden_size
        )
        source = pretrained.Source.frozen(
            FLAGS.init_checkpoint, FLAGS.vocab_file, FLAGS.do_lower_case
        )
        model, params, tokenizer = pretrained_weights.load_encoder(source, FLAGS.random_init)
        if not families.of(model).probes:
            raise pretrained.PretrainedError(
                f"--init_checkpoint={FLAGS.init_checkpoint} holds a "
                f"{families.of(model).title} model; the probes "
                "read BERT's layers only (for now)"
            )
        cli.check_max_seq_length(FLAGS.max_seq_length, model.config.max_position_embeddings)
        tasks = [t.strip() for t in FLAGS.task.split(",") if t.strip()]
        record = {
            "init_checkpoint": FLAGS.init_checkpoint,
            "random_init": FLAGS.random_init,
            "num_layers": model.config.num_hidden_layers,
            "settings": {
                "seeds": list(seeds),
                "epochs": settings.epochs,
                "batch_size": settings.batch_size,
                "learning_rate": settings.learning_rate,
                "hidden_size": settings.hidden_size,
                "max_seq_length": FLAGS.max_seq_length,
                "max_train_examples": FLAGS.max_train_examples,
            },
            "tasks": {},
        }
        for task in tasks:
            options = features.TaskOptions(
                data_dir=FLAGS.conll_dir if task == "conll2003" else FLAGS.glue_dir,
                tfds_data_dir=FLAGS.tfds_data_dir,
                max_seq_length=FLAGS.max_seq_length,
                max_train_examples=FLAGS.max_train_examples,
                do_lower_case=FLAGS.do_lower_case,
            )
            record["tasks"].update(
                probing.run_probes(model, params, tokenizer, [task], options, settings)
            )
            print("\n".join(probing.table(task, record["tasks"][task])), flush=True)
        title = os.path.basename(FLAGS.init_checkpoint.rstrip("/"))
        print(
            write_outputs(
                record, FLAGS.workdir, title + (" (random init)" if FLAGS.random_init else "")
            ),
            flush=True,
        )
    except (UserError, OSError) as e:
        cli.leave_on(e)


if __name__ == "__main__":
    define_flags()
    cli.run(main, config_flag=None)
