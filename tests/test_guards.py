"""Run guards: NaN steps skipped and counted, K in a row stop the run, no checkpoint from a
non-finite state, incompatible resumes refused (an intended phase switch allowed). (A
failing checkpoint write is tested in test_faults.py: it needs its own process)."""
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bertjax import checkpoint, guards, reporting, train
from test_train import corpus_file, read_metrics, tiny_config  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("guards_cache"))


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """The runs of this module compile the same programs: share them through JAX's cache."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
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


def test_nan_steps_are_skipped_counted_never_saved_and_k_in_a_row_stop(corpus_file, cache_dir,
                                                                       tmp_path):
    """NaN batches at steps 3, 5 and 6 with max_nonfinite_steps=2: step 3's update is skipped
    (its checkpoint equals step 2's but for the step counter), later losses are logged with
    the running count, and the second NaN in a row stops the run, naming step and batch."""
    config = tiny_config(corpus_file, cache_dir, **{
        "train.total_steps": 8, "long_phase.fraction": 0.0, "train.checkpoint_every": 1,
        "train.keep_checkpoints": 8, "train.max_nonfinite_steps": 2,
        "train.debug_nan_steps": (3, 5, 6)})
    with pytest.raises(reporting.TrainingError, match=r"2 consecutive non-finite steps ending at "
                                                  r"step 6 \(batch 5 of phase short\)"):
        run(config, tmp_path)
    records = read_metrics(tmp_path)
    assert [(m["step"], m["nonfinite_steps"]) for m in records] == [(1, 0), (2, 0), (4, 1)]
    before, after = saved_state(tmp_path, 2), saved_state(tmp_path, 3)
    assert int(before["step"]) == 2 and int(after["step"]) == 3
    for name in ("params", "opt_state"):
        for x, y in zip(*(jax.tree.leaves(s[name]) for s in (before, after))):
            np.testing.assert_array_equal(x, y)
            assert np.all(np.isfinite(x))


def test_no_checkpoint_from_a_non_finite_state():
    state = types.SimpleNamespace(params={"w": jnp.array([1.0, jnp.inf])},
                                  opt_state=(jnp.zeros(2), jnp.int32(3)))
    with pytest.raises(guards.NonFiniteState, match="step 7: the params hold NaN or Inf"):
        guards.check_finite(state, 7)
    guards.check_finite(types.SimpleNamespace(params={"w": jnp.ones(2)}, opt_state=()), 7)


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


@pytest.mark.parametrize("overrides, message", [
    ({"train.global_batch_size": 32}, "global_batch_size: 16 -> 32"),
    ({"data.max_seq_length": 32}, "max_seq_length: 64 -> 32"),
    ({"data.sentencepiece_vocab_size": 400}, "different tokenizer"),
    ({"data.input_files": "other"}, "data source: {'files': "),
], ids=["global batch", "sequence length", "vocabulary", "data source"])
def test_incompatible_resume_says_what_changed(overrides, message, corpus_file, cache_dir,
                                                workdir):
    if overrides.get("data.input_files") == "other":
        other = workdir.parent / "other.txt"
        other.write_text(open(corpus_file).read() + "\nOne more document.\n")
        overrides = {"data.input_files": str(other)}
    config = tiny_config(corpus_file, cache_dir, **overrides)
    with pytest.raises(checkpoint.CheckpointMismatch, match=message):
        run(config, workdir)


def test_a_new_phase_may_change_its_batch(corpus_file, cache_dir, workdir):
    """Continuing to the end of the short phase (step 12), then starting the long phase with
    another global batch is an intended phase switch; changing it mid-phase is refused."""
    run(tiny_config(corpus_file, cache_dir, **{"train.stop_after_steps": 6}), workdir)
    switched = tiny_config(corpus_file, cache_dir, **{"train.stop_after_steps": 1})
    switched.long_phase.global_batch_size = 32
    run(switched, workdir)
    assert [m["step"] for m in read_metrics(workdir)][-2:] == [12, 13]
    switched.long_phase.global_batch_size = 8
    with pytest.raises(checkpoint.CheckpointMismatch, match="global_batch_size: 32 -> 8"):
        run(switched, workdir)
