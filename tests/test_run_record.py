"""The run record (bertjax.checkpoints.run_record): what checkpoints written before it was typed hold in
their `meta` item (literal dicts here, in the layout of train.run_metadata up to 6e5d96b)
reads back as a record and writes the same JSON, and a run resumes from such a checkpoint
exactly as from its own."""

import json
import os
import shutil

import jax
import pytest

from bertjax import train
from bertjax.checkpoints import checkpoint, checkpoint_checks
from bertjax.checkpoints.run_record import GLOBAL, RunRecord
from bertjax.data.settings import DataSettings
from bertjax.models import families
from bertjax.training import guards, run_schedule
from bertjax.training.settings import PretrainingSettings
from test_guards import compilation_cache  # noqa: F401 (autouse fixture)
from test_train import cache_dir, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixtures)

# A checkpoint's meta as bertjax wrote it before the typed record (keys in that order): the
# run's metadata, its schedule, the tokenizer's fingerprint, then the checkpointer's digest.
OLD_META = {
    "model": {"family": "bert", "hidden_size": 32, "num_hidden_layers": 2},
    "config": json.dumps({"train": {"total_steps": 4}, "data": {"masking": "original"}}),
    "data": {
        "source": {"files": [["/c/corpus.txt", 1]]},
        "corpus": [],
        "phases": {
            "short": {"max_seq_length": 64, "max_predictions_per_seq": 10, "global_batch_size": 16}
        },
    },
    "processes": 1,
    "schedule": {
        "phases": [
            {
                "name": "short",
                "max_seq_length": 64,
                "max_predictions_per_seq": 10,
                "global_batch_size": 16,
                "start_step": 0,
                "end_step": 4,
            }
        ],
        "optimizer": {
            "peak_learning_rate": 0.002,
            "warmup_steps": 4,
            "total_steps": 4,
            "earlier": [],
        },
    },
    "tokenizer": "3f2a",
    "state_digest": {"['params']['bias']": 12345},
}
# Older still: no process count, schedule or tokenizer recorded.
OLDER_META = {"model": {"hidden_size": 32}, "config": "{}", "data": {"source": {}}}


@pytest.mark.parametrize("meta", [OLD_META, OLDER_META])
def test_a_record_reads_and_writes_the_json_of_older_checkpoints(meta):
    record = RunRecord.of(meta)
    assert record.as_json() == meta and list(record.as_json()) == list(meta)
    assert record.processes == meta.get("processes")
    assert record.config_values == json.loads(meta["config"])


@pytest.mark.slow  # (two tiny runs: about 20 s of CPU)
def test_a_checkpoint_written_before_the_typed_record_resumes_exactly(
    corpus_file, cache_dir, tmp_path
):
    """A 4-step run, and a copy stopped at step 2 whose checkpoint's meta is rewritten as the
    code before the typed record wrote it (from the same values: equal to what is written
    now, key for key): the copy resumes from it and logs the uninterrupted run's steps 3 and
    4 bit for bit."""
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{
            "train.total_steps": 4,
            "train.checkpoint_every": 2,
            "long_phase.fraction": 0.0,
            "model.hidden_dropout_prob": 0.0,
            "model.attention_probs_dropout_prob": 0.0,
        },
    )
    straight = tmp_path / "straight"
    train.train_and_evaluate(config, str(straight), devices=jax.devices()[:1])
    stopped = tmp_path / "stopped"
    shutil.copytree(straight, stopped)
    shutil.rmtree(stopped / "checkpoints" / "4")
    os.remove(stopped / "final_metrics.json")
    path = stopped / "checkpoints" / "2" / "meta" / "metadata"
    written = json.loads(path.read_text())
    settings = PretrainingSettings.of(config)
    phases = settings.phases
    plan = run_schedule.planned(settings, config.optimizer)
    old = {
        "model": families.recorded_fields(settings.model_config),
        "config": config.to_json(),
        "data": guards.data_identity(DataSettings.of(config.data), phases),
        "processes": jax.process_count(),
    }  # (train.run_metadata before the change)
    old = {**old, "schedule": plan.record()}
    old["tokenizer"] = written["tokenizer"]
    old[checkpoint_checks.DIGEST] = written[checkpoint_checks.DIGEST]
    # what this code adds since: the device count and the data order (resume.check_shape)
    assert written.pop("devices") == 1 and written.pop("data_order") == GLOBAL
    assert list(written) == list(old) and written == json.loads(json.dumps(old))
    path.write_text(json.dumps(old))
    (stopped / "checkpoints" / "2" / checkpoint.CHECKSUMS).unlink(missing_ok=True)
    train.train_and_evaluate(config, str(stopped), devices=jax.devices()[:1])
    resumed = read_metrics(stopped)[4:]
    assert [m["step"] for m in resumed] == [3, 4]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in read_metrics(straight)[2:]]
