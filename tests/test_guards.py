"""Run guards: NaN steps skipped and counted, K in a row stop the run, no checkpoint from a
non-finite state, incompatible resumes refused (an intended phase switch allowed). (A
failing checkpoint write is tested in test_faults.py: it needs its own process)."""

import contextlib
import gc
import json
import os
import re
import shutil
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import injected_faults
from bertjax import train
from bertjax.checkpoints import checkpoint, checkpoint_checks
from bertjax.models.bert.model import BertConfig
from bertjax.training import nonfinite, optim, reporting, resume
from bertjax.training.settings import plan_phases
from test_train import base_config, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("guards_cache"))


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """The runs of this module compile the same programs: share them through JAX's cache."""
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = [getattr(jax.config, name) for name in names]
    for name, value in zip(names, (str(tmp_path_factory.mktemp("jax_cache")), 0, 0)):
        jax.config.update(name, value)
    yield
    for name, value in zip(names, saved):
        jax.config.update(name, value)


def saved_state(workdir, step: int) -> dict:
    return ocp.PyTreeCheckpointer().restore(str(workdir / "checkpoints" / str(step) / "state"))


def run(config, workdir) -> None:
    """Trains in-process on one device (the fastest to compile)."""
    train.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1])


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_nan_steps_are_skipped_counted_never_saved_and_k_in_a_row_stop(
    corpus_file, cache_dir, tmp_path, monkeypatch
):
    """NaN batches at steps 3, 5 and 6 with max_nonfinite_steps=2: step 3's update is skipped
    (its checkpoint equals step 2's but for the step counter), later losses are logged with
    the running count, and the second NaN in a row stops the run, naming step and batch."""
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{
            "train.total_steps": 8,
            "long_phase.fraction": 0.0,
            "train.checkpoint_every": 1,
            "train.keep_checkpoints": 8,
            "train.max_nonfinite_steps": 2,
        },
    )
    injected_faults.poison_batches(monkeypatch, "short", (2, 4, 5))  # steps 3, 5 and 6
    with pytest.raises(
        nonfinite.TrainingError,
        match=re.escape(
            "2 consecutive non-finite steps ending at step 6 (batch 5 of phase short), the last "
            "with non-finite inputs; the last checkpoint is intact. The batch holds NaN or Inf: "
            "check the data, then rerun to resume."
        ),
    ):
        run(config, tmp_path)
    records = read_metrics(tmp_path)
    assert [(m["step"], m["nonfinite_steps"]) for m in records] == [(1, 0), (2, 0), (4, 1)]
    before, after = saved_state(tmp_path, 2), saved_state(tmp_path, 3)
    assert int(before["step"]) == 2 and int(after["step"]) == 3
    for name in ("params", "opt_state"):
        for x, y in zip(*(jax.tree.leaves(s[name]) for s in (before, after))):
            np.testing.assert_array_equal(x, y)
            assert np.all(np.isfinite(x))


def test_host_stops_on_repeated_non_finite_steps_or_at_once_on_a_non_finite_state():
    """Cause 2 (loss or gradients) counts towards max_nonfinite_steps and the error names it;
    cause 3 (a non-finite state before the step) stops at once, whatever the limit: named
    "state" (a damaged checkpoint) on the run's first step, "update" (the learning rate)
    after a finite step of this run, since restored states are checked."""
    config = tiny_config("", "", **{"train.total_steps": 10, "long_phase.fraction": 0.0})
    phases = plan_phases(config.train, config.data, config.long_phase)

    def progress(limit):
        return reporting.Progress(
            phases,
            nonfinite.NonFiniteSteps(limit, 0),
            optim.optimizer_config(config.optimizer, 10),
            BertConfig.from_dict(config.model.to_dict()),
            None,
            0,
            None,
        )

    def add(to, step, cause):
        to.add(
            step,
            {
                "nonfinite": float(cause),
                "grad_norm": 1.0,
                "mlm_loss_sum": 1.0,
                "mlm_correct_sum": 0.0,
                "mlm_weight_sum": 1.0,
                "nsp_loss_sum": 1.0,
                "nsp_correct_sum": 0.0,
                "nsp_count": 1.0,
            },
            16,
            f"batch {step - 1}",
        )

    repeated = progress(2)
    add(repeated, 1, 2)  # one skipped step: training goes on
    add(repeated, 2, 0)
    add(repeated, 3, 2)
    with pytest.raises(
        nonfinite.TrainingError,
        match=re.escape(
            "2 consecutive non-finite steps ending at step 4 (batch 3), the last with non-finite "
            "loss or gradients; the last checkpoint is intact. Lower "
            "optimizer.peak_learning_rate or check the data, then rerun"
        ),
    ):
        add(repeated, 4, 2)
    with pytest.raises(
        nonfinite.TrainingError,
        match=re.escape(
            "1 consecutive non-finite steps ending at step 1 (batch 0), the last with "
            "non-finite state; the last checkpoint is intact. The parameters or optimizer state "
            "held NaN or Inf before the step"
        ),
    ):
        add(progress(100), 1, 3)
    after_finite = progress(100)
    add(after_finite, 1, 0)
    with pytest.raises(
        nonfinite.TrainingError,
        match=re.escape(
            "1 consecutive non-finite steps ending at step 2 (batch 1), the last with "
            "non-finite update; the last checkpoint is intact. An update of this run made the "
            "state non-finite from finite gradients: lower optimizer.peak_learning_rate or set "
            "optimizer.clip_global_norm, then rerun"
        ),
    ):
        add(after_finite, 2, 3)
    assert after_finite.nonfinite.total == 1


def test_no_checkpoint_from_a_non_finite_state():
    state = types.SimpleNamespace(
        params={"w": jnp.array([1.0, jnp.inf])}, opt_state=(jnp.zeros(2), jnp.int32(3))
    )
    with pytest.raises(nonfinite.NonFiniteState, match="step 7: the params hold NaN or Inf"):
        nonfinite.check_finite(state, 7)
    nonfinite.check_finite(types.SimpleNamespace(params={"w": jnp.ones(2)}, opt_state=()), 7)


@pytest.fixture(scope="module")
def stopped_run(corpus_file, cache_dir, tmp_path_factory):
    """A run of 16 steps (12 short, 4 long) stopped after step 6: checkpoints 4 and 6."""
    workdir = tmp_path_factory.mktemp("stopped")
    config = tiny_config(corpus_file, cache_dir, **{"train.stop_after_steps": 6})
    run(config, workdir)
    return workdir


@pytest.fixture
def workdir(stopped_run, tmp_path):
    shutil.copytree(stopped_run, tmp_path / "run")
    return tmp_path / "run"


@contextlib.contextmanager
def edited(path: str, edit):
    """`path` rewritten by `edit(text)` for the block, then restored with its mtime (the data
    cache of the other tests is keyed by it)."""
    original, stat = Path(path).read_text(), os.stat(path)
    try:
        with open(path, "w") as f:
            f.write(edit(original))
        yield
    finally:
        with open(path, "w") as f:
            f.write(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


CORPUS_EDITS = {
    "other corpus": None,
    "same-size edit": lambda text: text.replace(" the ", " tho ", 1),
    "appended corpus": lambda text: text + "\nOne more document.\n",
}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train.global_batch_size": 32}, "global_batch_size: 16 -> 32"),
        ({"data.max_seq_length": 32}, "max_seq_length: 64 -> 32"),
        ({"data.sentencepiece_vocab_size": 400}, "data.sentencepiece_vocab_size: 512 -> 400"),
        ({"data.seed": 7}, "data.seed: 12345 -> 7"),
        ({"data.dupe_factor": 3}, "data.dupe_factor: 2 -> 3"),
        ({"data.masking": "dynamic"}, "data.masking: 'static' -> 'dynamic'"),
        ({"data.masked_lm_prob": 0.2}, "data.masked_lm_prob: 0.15 -> 0.2"),
        ("other corpus", "data source: {'files': "),
        ("same-size edit", r"corpus file .*corpus.txt: content changed \(same size\)"),
        ("appended corpus", r"corpus file .*corpus.txt: \d+ -> \d+ bytes"),
        ({"data.whole_word_mask": True}, "data.whole_word_mask: False -> True"),
        ({"data.short_seq_prob": 0.2}, "data.short_seq_prob: 0.1 -> 0.2"),
        ({"data.mask_token_prob": 0.7}, "data.mask_token_prob: 0.8 -> 0.7"),
        ({"data.random_token_prob": 0.05}, "data.random_token_prob: 0.1 -> 0.05"),
        ({"data.max_predictions_per_seq": 8}, "max_predictions_per_seq: 10 -> 8"),
    ],
    ids=[
        "global batch",
        "sequence length",
        "vocabulary",
        "data seed",
        "dupe_factor",
        "masking",
        "masked_lm_prob",
        "other corpus",
        "same-size edit",
        "appended corpus",
        "whole_word_mask",
        "short_seq_prob",
        "mask token share",
        "random token share",
        "predictions per phase",
    ],
)
def test_incompatible_resume_is_refused_before_preparation(
    overrides, message, corpus_file, cache_dir, workdir
):
    """Each change of a phase's batches, masks or corpus in the middle of it is refused,
    naming it, before any data is prepared (the cache is left as it was)."""
    config, edit = tiny_config(corpus_file, cache_dir), contextlib.nullcontext()
    if overrides == "other corpus":
        other = workdir.parent / "other.txt"
        other.write_text(Path(corpus_file).read_text() + "\nOne more document.\n")
        config.data.input_files = str(other)
    elif isinstance(overrides, str):
        edit = edited(corpus_file, CORPUS_EDITS[overrides])
    else:
        config = tiny_config(corpus_file, cache_dir, **overrides)
    cache = sorted(os.listdir(cache_dir))
    with edit, pytest.raises(checkpoint_checks.CheckpointMismatch, match=message) as refused:
        run(config, workdir)
    assert "--config.train.allow_changed_data=True" in str(refused.value)
    assert sorted(os.listdir(cache_dir)) == cache


def test_a_changed_model_is_refused(corpus_file, cache_dir, workdir):
    """Another architecture cannot resume the checkpoint, even with allow_changed_data; the
    refusal names both models and comes before any data is prepared."""
    cache = sorted(os.listdir(cache_dir))
    config = tiny_config(
        corpus_file, cache_dir, **{"model.num_hidden_layers": 3, "train.allow_changed_data": True}
    )
    before = listing(workdir)
    with pytest.raises(
        checkpoint_checks.CheckpointMismatch,
        match=(
            rf"checkpoint {workdir}/checkpoints/6 was written with a different model:\n"
            r"  checkpoint: \{.*'num_hidden_layers': 2, .*\n  this run:   \{.*"
            r"'num_hidden_layers': 3, .*\nUse a new --workdir, or the settings of the run"
        ),
    ):
        run(config, workdir)
    assert sorted(os.listdir(cache_dir)) == cache
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "6"]
    assert listing(workdir) == before  # (config.json not rewritten: nothing changed)


def listing(directory) -> dict[str, tuple[int, int]]:
    """`{relative path: (size, mtime_ns)}` of every file under `directory` but the lock's
    own (which every run writes its pid into while it holds it)."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


def test_a_run_refused_in_a_new_directory_leaves_none(corpus_file, cache_dir, tmp_path):
    """A mesh that does not fit the devices is refused after the workdir's lock was taken:
    the directory the run created is removed again (no run.lock, no config.json)."""
    config = tiny_config(corpus_file, cache_dir)
    config.mesh.data = 2  # (one device)
    with pytest.raises(train.ConfigError):
        run(config, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_where_the_data_is_prepared_and_by_how_many_workers_may_change(
    corpus_file, cache_dir, workdir, tmp_path
):
    """data.cache_dir and data.num_workers do not change the batches: the run resumes."""
    run(
        tiny_config(
            corpus_file,
            str(tmp_path / "elsewhere"),
            **{"data.num_workers": 2, "train.stop_after_steps": 1},
        ),
        workdir,
    )
    assert [m["step"] for m in read_metrics(workdir)][-1] == 7
    assert os.listdir(tmp_path / "elsewhere")


def test_a_change_can_be_accepted(corpus_file, cache_dir, workdir):
    """With train.allow_changed_data=True the changed run goes on from the checkpoint."""
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{"data.seed": 7, "train.allow_changed_data": True, "train.stop_after_steps": 1},
    )
    run(config, workdir)
    assert [m["step"] for m in read_metrics(workdir)][-1] == 7


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_a_new_phase_may_change_its_batch(corpus_file, cache_dir, workdir):
    """Continuing to the end of the short phase (step 12), then starting the long phase with
    another global batch is an intended phase switch; changing it mid-phase is refused."""
    run(tiny_config(corpus_file, cache_dir, **{"train.stop_after_steps": 6}), workdir)
    switched = tiny_config(corpus_file, cache_dir, **{"train.stop_after_steps": 1})
    switched.long_phase.global_batch_size = 32
    run(switched, workdir)
    assert [m["step"] for m in read_metrics(workdir)][-2:] == [12, 13]
    switched.long_phase.global_batch_size = 8
    with pytest.raises(checkpoint_checks.CheckpointMismatch, match="global_batch_size: 32 -> 8"):
        run(switched, workdir)


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {  # what happens to checkpoint 6 (the latest) before the rerun
    "truncated": lambda step: truncate(largest_file(step / "state")),
    "deleted _METADATA": lambda step: (step / "state" / "_METADATA").unlink(),
    "deleted manifest": lambda step: (step / "state" / "manifest.ocdbt").unlink(),
    "bit flip": lambda step: flip_a_byte(largest_file(step / "state")),
    "truncated, no checksums": lambda step: (
        (step / checkpoint.CHECKSUMS).unlink(),
        truncate(largest_file(step / "state")),
    ),
    # (a kill between the save and its seal; the flip still decodes: found by the digest)
    "bit flip, no checksums": lambda step: (
        (step / checkpoint.CHECKSUMS).unlink(),
        flip_a_byte(largest_file(step / "state")),
    ),
}


# Orbax's restore of a damaged checkpoint fails in one of its reads and leaves the others'
# coroutines to the garbage collector, which reports them ("Exception ignored in"): expected
# here, collected before the test ends, and silenced for these tests alone.
PLANTED_DAMAGE_LEFTOVERS = "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning"


@pytest.mark.filterwarnings(PLANTED_DAMAGE_LEFTOVERS)
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_set_aside_and_the_previous_one_resumed(
    damage, corpus_file, cache_dir, workdir, capsys
):
    """Damage in the latest checkpoint (6) is found (by its checksums, or for a checkpoint
    without them by the failed restore or the state digest), reported by name, moved to checkpoints_quarantine;
    the run resumes from checkpoint 4, says it costs 2 steps, and steps 5 and 6 get the
    losses they had before."""
    DAMAGE[damage](workdir / "checkpoints" / "6")
    run(tiny_config(corpus_file, cache_dir, **{"train.stop_after_steps": 2}), workdir)
    out = capsys.readouterr().out
    assert f"Checkpoint {workdir}/checkpoints/6 is damaged" in out
    assert "Resuming from step 4 instead of 6: 2 steps will be trained again" in out
    assert os.listdir(workdir / "checkpoints_quarantine") == ["6"]
    losses = [(m["step"], m["loss"]) for m in read_metrics(workdir)]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6, 5, 6]
    assert losses[4:6] == losses[6:8]
    gc.collect()  # (the failed restore's leftovers, within this test's filter)


def test_a_renamed_step_directory_is_set_aside_and_later_saves_happen(
    corpus_file, cache_dir, workdir, capsys
):
    """Checkpoint 6 renamed to 10 (its name disagrees with the step it holds) is set aside
    by name; the run resumes from 4 and its saves at 8 and 10 are made, not skipped."""
    (workdir / "checkpoints" / "6").rename(workdir / "checkpoints" / "10")
    run(tiny_config(corpus_file, cache_dir, **{"train.stop_after_steps": 6}), workdir)
    out = capsys.readouterr().out
    assert (
        f"Checkpoint {workdir}/checkpoints/10 is damaged: its directory is named 10 but it "
        "holds step 6 (renamed?); moved to"
    ) in out
    assert os.listdir(workdir / "checkpoints_quarantine") == ["10"]
    assert {"8", "10"} <= set(os.listdir(workdir / "checkpoints"))
    assert f"checkpoint step 8 -> {workdir}/checkpoints/8" in out
    assert [m["step"] for m in read_metrics(workdir)][-6:] == [5, 6, 7, 8, 9, 10]
    # the record names the devices the run trained on (its mesh's), not the host's eight
    assert checkpoint.read_meta(str(workdir / "checkpoints"))["devices"] == 1


def record_peak_learning_rate(step_dir, rate: float) -> float:
    """Rewrites the peak learning rate that the checkpoint in `step_dir` records for its
    schedule (unsealing it: its checksums no longer hold); returns the one it recorded."""
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    config = json.loads(meta["config"])
    recorded = config["optimizer"]["peak_learning_rate"]
    config["optimizer"]["peak_learning_rate"] = rate
    meta["config"] = json.dumps(config)
    meta["schedule"]["optimizer"]["peak_learning_rate"] = rate
    path.write_text(json.dumps(meta))
    (step_dir / checkpoint.CHECKSUMS).unlink(missing_ok=True)
    return recorded


@pytest.mark.slow  # (three runs, one compiling another optimizer: about 60 s)
def test_non_finite_steps_right_after_a_resume_fall_back_once_to_the_checkpoint_before(
    corpus_file, cache_dir, workdir, tmp_path, capsys
):
    """Checkpoint 6 replaced by one whose parameters are finite but huge (steps 5-6 trained
    with a learning rate of 1e30 in a copy of the run whose checkpoint 4 was made to record
    that rate, since a run refuses another schedule; copied back recording the run's own):
    the rerun's steps 7-9 are non-finite, so step 8 saves nothing (keep_checkpoints=2 would
    have pruned 4), then it sets 6 aside in one line and resumes from 4, where steps 5 and 6
    get their original losses."""
    original = {m["step"]: m["loss"] for m in read_metrics(workdir)}
    shutil.rmtree(workdir / "checkpoints" / "6")
    side = tmp_path / "huge_rate"
    shutil.copytree(workdir, side)
    rate = record_peak_learning_rate(side / "checkpoints" / "4", 1e30)
    run(
        tiny_config(
            corpus_file,
            cache_dir,
            **{"train.stop_after_steps": 2, "optimizer.peak_learning_rate": 1e30},
        ),
        side,
    )
    shutil.copytree(side / "checkpoints" / "6", workdir / "checkpoints" / "6")
    record_peak_learning_rate(workdir / "checkpoints" / "6", rate)
    capsys.readouterr()
    run(
        tiny_config(
            corpus_file, cache_dir, **{"train.stop_after_steps": 4, "train.max_nonfinite_steps": 3}
        ),
        workdir,
    )
    out = capsys.readouterr().out
    assert (
        f"Checkpoint {workdir}/checkpoints/6 is damaged: every step since resuming from it "
        "was non-finite; falling back (once) to the checkpoint before it; moved to "
        f"{workdir}/checkpoints_quarantine/6"
    ) in out, out
    assert f"Resuming from {workdir}/checkpoints at step 4" in out.split("falling back")[1]
    assert "checkpoint step 8 ->" in out and "Lower optimizer" not in out
    assert os.listdir(workdir / "checkpoints_quarantine") == ["6"]
    assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["4", "8"]
    again = {m["step"]: m["loss"] for m in read_metrics(workdir)[-4:]}
    assert sorted(again) == [5, 6, 7, 8] and (again[5], again[6]) == (original[5], original[6])


def test_pruning_keeps_the_resumed_checkpoint_until_a_newer_one_is_sealed(
    corpus_file, cache_dir, workdir
):
    """keep_checkpoints=1, resumed from 6: saving 8 keeps 6 (8 is not sealed when the pruning
    decides); saving 10, after 8 was sealed, removes both."""
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{"train.keep_checkpoints": 1, "train.checkpoint_every": 2, "train.stop_after_steps": 2},
    )
    run(config, workdir)
    assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["6", "8"]
    config.train.stop_after_steps = 4
    run(config, workdir)
    assert os.listdir(workdir / "checkpoints") == ["12"]


@pytest.mark.parametrize(
    "resumed_at, blamed", [(6, "checkpoint"), (None, "learning rate"), (4, "learning rate")]
)
def test_non_finite_steps_right_after_a_resume_name_the_checkpoint(resumed_at, blamed):
    """Non-finite loss in every step since a resume (at step 6) names the checkpoint resumed
    from, not the learning rate; in a fresh run, or after finite steps, the learning rate."""
    config = base_config()
    phases = plan_phases(config.train, config.data, config.long_phase)
    progress = reporting.Progress(
        phases,
        nonfinite.NonFiniteSteps(2, resumed_at or 4, "/w/checkpoints/6" if resumed_at else None),
        optim.optimizer_config(config.optimizer, config.train.total_steps),
        BertConfig.from_dict(config.model.to_dict()),
        None,
        resumed_at or 4,
        None,
    )
    metrics = {
        "nonfinite": 0.0,
        "grad_norm": 1.0,
        "mlm_loss_sum": 1.0,
        "mlm_correct_sum": 0.0,
        "mlm_weight_sum": 1.0,
        "nsp_loss_sum": 1.0,
        "nsp_correct_sum": 0.0,
        "nsp_count": 1.0,
    }
    for step in range((resumed_at or 4) + 1, 7):
        progress.add(step, metrics, tokens=1)
    progress.add(7, {**metrics, "nonfinite": 2.0}, tokens=1)
    with pytest.raises(nonfinite.TrainingError) as stopped:
        progress.add(8, {**metrics, "nonfinite": 2.0}, tokens=1)
    advice = str(stopped.value).split("intact. ")[1]
    assert advice.startswith(
        "Every step since resuming from checkpoint /w/checkpoints/6 was non-finite"
        if blamed == "checkpoint"
        else "Lower optimizer.peak"
    )


@pytest.mark.filterwarnings(PLANTED_DAMAGE_LEFTOVERS)
def test_no_usable_checkpoint_names_the_choices(corpus_file, cache_dir, workdir):
    for step in ("4", "6"):
        flip_a_byte(largest_file(workdir / "checkpoints" / step / "state"))
    with pytest.raises(
        resume.UnusableCheckpoint,
        match=r"no usable checkpoint .* step\(s\) 6, 4 "
        r"were damaged and moved to .*checkpoints_quarantine. Choices: rerun to "
        r"start from step 0",
    ):
        run(tiny_config(corpus_file, cache_dir), workdir)
    assert sorted(os.listdir(workdir / "checkpoints_quarantine")) == ["4", "6"]
    gc.collect()


def test_a_full_disk_under_a_writer_stops_the_run_with_a_checkpoint(
    corpus_file, cache_dir, workdir
):
    """metrics.jsonl on a full device (/dev/full: every write fails with ENOSPC): the run
    stops at its first report with one message naming the file, after saving the step."""
    (workdir / "metrics.jsonl").unlink()
    (workdir / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(
        nonfinite.TrainingError,
        match=rf"No space left on device: {workdir}/"
        r"metrics.jsonl \(free some space, .*\); saved a checkpoint at step 7",
    ):
        run(tiny_config(corpus_file, cache_dir, **{"train.stop_after_steps": 4}), workdir)
    assert "7" in os.listdir(workdir / "checkpoints")
