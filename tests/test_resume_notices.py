"""What a resume says about the checkpoint it continues from, on real Orbax checkpoints of a
tiny TrainState (`resume.Resume` over a `checkpoint.Checkpointer`): a checkpoint without
checksums is named with what was checked instead, and a refusal names an older checkpoint
that these settings can resume from."""

import json

import jax
import pytest

from bertjax.checkpoints import checkpoint, checkpoint_checks
from bertjax.checkpoints.run_record import RunRecord
from bertjax.training import resume, sharding
from test_checkpoint import _state

RECORD = RunRecord(model={"hidden_size": 16, "intermediate_size": 32}, tokenizer="abc")


def _workdir(tmp_path, steps=(4, 8)) -> tuple[resume.Resume, object]:
    """Checkpoints `steps` of the tiny state (each holding its step) with `RECORD`; the
    Resume over them and the abstract state to restore onto."""
    mesh = sharding.make_mesh({"data": -1})
    state, abstract, _ = _state(mesh)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), save_every=1, keep_latest=5)
    for step in steps:
        position = {"phase": "short", "batch_index": step}
        ckpt.save(step, state.replace(step=step), position, RECORD.as_json())
    ckpt.wait()
    return resume.Resume(ckpt, str(tmp_path / resume.QUARANTINE)), abstract


def test_an_unsealed_checkpoint_is_resumed_with_a_notice(tmp_path, capsys):
    """Issue 53: a worker frozen inside the save of step 8 (Orbax committed it, bertjax's
    checksums were never written): the relaunch resumed from it without a word. It says
    now that the checkpoint was not sealed and what was checked instead."""
    resume_from, abstract = _workdir(tmp_path)
    (tmp_path / "checkpoints" / "8" / checkpoint.CHECKSUMS).unlink()
    found = resume_from.newest()
    assert found is not None and found.step == 8 and not found.sealed
    _, position = resume_from.restore(found, abstract, RECORD, lambda found: None)
    assert position.batch_index == 8
    arrays = len(jax.tree.leaves(abstract))
    assert (
        f"Checkpoint {tmp_path}/checkpoints/8 was not sealed (no {checkpoint.CHECKSUMS}: its "
        "run stopped between its save and its seal), so its files were not checked; checked "
        f"instead: its restored state matches the digest recorded at its save ({arrays} "
        "arrays, bit for bit) and is finite\n"
    ) in capsys.readouterr().out
    resume_from.checkpointer.close()


def test_a_sealed_checkpoint_is_resumed_without_the_notice(tmp_path, capsys):
    resume_from, abstract = _workdir(tmp_path)
    found = resume_from.newest()
    assert found is not None and found.sealed
    resume_from.restore(found, abstract, RECORD, lambda found: None)
    assert "was not sealed" not in capsys.readouterr().out
    resume_from.checkpointer.close()


def _record_intermediate_size(step_dir, size: int) -> None:
    """Rewrites the model's intermediate_size in the record of checkpoint `step_dir` and
    removes its checksums (a tampered record that nothing else gives away)."""
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["model"]["intermediate_size"] = size
    path.write_text(json.dumps(meta))
    (step_dir / checkpoint.CHECKSUMS).unlink()


def test_a_refused_record_names_an_older_checkpoint_that_matches(tmp_path):
    """Issue 53: checkpoint 8's record said another intermediate_size (its checksums
    removed); the refusal said to use a new --workdir or the old settings, though
    checkpoint 4 was good. It names checkpoint 4 now, and how to resume from it."""
    resume_from, _ = _workdir(tmp_path)
    _record_intermediate_size(tmp_path / "checkpoints" / "8", 64)
    found = resume_from.newest()
    assert found is not None and found.step == 8
    with pytest.raises(checkpoint_checks.CheckpointMismatch) as refused:
        resume_from.check(found, RECORD, None, [], allow_changed_data=False)
    where = f"{tmp_path}/checkpoints"
    assert str(refused.value).startswith(
        f"checkpoint {where}/8 was written with a different model:"
    )
    assert str(refused.value).endswith(
        f"\nCheckpoint {where}/4 matches these settings: move {where}/8 aside (e.g. into "
        f"{tmp_path}/{resume.QUARANTINE}) and rerun to resume from step 4."
    )
    resume_from.checkpointer.close()


def test_a_refusal_names_no_older_checkpoint_when_none_matches(tmp_path):
    """Another model asked of every checkpoint (the usual mistake): the refusal stays as it
    was, with no checkpoint to fall back on."""
    resume_from, _ = _workdir(tmp_path)
    found = resume_from.newest()
    other = RunRecord(model={"hidden_size": 16, "intermediate_size": 64}, tokenizer="abc")
    with pytest.raises(checkpoint_checks.CheckpointMismatch) as refused:
        resume_from.check(found, other, None, [], allow_changed_data=False)
    assert str(refused.value).endswith(
        "Use a new --workdir, or the settings of the run that wrote it."
    )
    resume_from.checkpointer.close()


# The error of a truncated array file as TensorStore raised it (issue 53), abridged: its
# message ends with the repr of the array's TensorStore, on many lines.
TENSORSTORE_ERROR = """\
Encountered error while reading array index: (slice(16, 32, 1), slice(0, 32, 1)). See full \
TensorStore details: <bound method pybind11_detail_function_record_v1_system_libstdcpp_gxx_abi\
_1xxx_use_cxx11_abi_1.spec of TensorStore({
  'base': {
    'driver': 'zarr',
    'kvstore': {
      'base': {
        'driver': 'file',
        'path': '/w/checkpoints/8/state/',
      },
      'driver': 'ocdbt',
      'manifest': {'driver': 'file', 'path': '/w/checkpoints/8/state/'},
      'path': 'params.bert.encoder.layer_0.attention.self.value.kernel/',
    },
    'metadata': {'chunks': [16, 32], 'dtype': '<f4'},
  },
  'driver': 'cast',
})>."""


def test_a_failed_read_is_named_by_its_array_without_tensorstore_repr():
    """Issue 53: the line was TensorStore's repr, cut off. It names the array now."""
    assert checkpoint_checks.unreadable_problem(RuntimeError(TENSORSTORE_ERROR)) == (
        "its array params.bert.encoder.layer_0.attention.self.value.kernel: Encountered error "
        "while reading array index: (slice(16, 32, 1), slice(0, 32, 1))."
    )
    assert (
        checkpoint_checks.unreadable_problem(ValueError("Expecting value\nmore"))
        == "Expecting value"
    )
