"""Orbax checkpoints: round trip onto another mesh, compatibility checks, params-only
restore for init_checkpoint, and unfinished saves are never restored."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.checkpoints import checkpoint, checkpoint_checks
from bertjax.models.bert.model import BertConfig, BertForPreTraining
from bertjax.training import optim, sharding
from bertjax.training.state import create_train_state

CONFIG = BertConfig(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
)
EXAMPLE = (jnp.zeros((1, 8), jnp.int32),) * 3 + (jnp.zeros((1, 2), jnp.int32),)
META = {"model": {"hidden_size": 16}, "tokenizer": "abc"}


def _state(mesh, materialize=True, seed=0):
    tx = optim.make_optimizer(
        optim.OptimizerConfig(peak_learning_rate=1e-3, warmup_steps=1, total_steps=10)
    )
    return create_train_state(
        BertForPreTraining(CONFIG),
        tx,
        jax.random.PRNGKey(seed),
        EXAMPLE,
        mesh,
        materialize=materialize,
    )


def _assert_trees_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip_onto_another_mesh(tmp_path):
    mesh8 = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state, _, _ = _state(mesh8)
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=5, keep_latest=2)
    assert ckpt.save(5, state, {"phase": "short", "batch_index": 5}, META)
    ckpt.close()

    mesh4 = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 1}, jax.devices()[:4])
    _, abstract, shardings = _state(mesh4, materialize=False)
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=5, keep_latest=2)
    assert ckpt.latest_step() == 5
    restored, position, meta = ckpt.restore(5, abstract, META)
    ckpt.close()
    assert position == {"phase": "short", "batch_index": 5} and meta["tokenizer"] == "abc"
    _assert_trees_equal(restored, state)
    kernel = restored.params["bert"]["encoder"]["layer_0"]["intermediate"]["dense"]["kernel"]
    assert (
        kernel.sharding
        == shardings.params["bert"]["encoder"]["layer_0"]["intermediate"]["dense"]["kernel"]
    )
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


def test_incompatible_checkpoint_is_refused(tmp_path):
    mesh = sharding.make_mesh({"data": -1})
    state, abstract, _ = _state(mesh)
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=1, keep_latest=1)
    ckpt.save(1, state, {"phase": "short", "batch_index": 1}, META)
    ckpt.wait()
    with pytest.raises(checkpoint_checks.CheckpointMismatch, match="different tokenizer"):
        ckpt.restore(1, abstract, {**META, "tokenizer": "other"})
    ckpt.close()


def test_init_checkpoint_restores_params_only(tmp_path):
    mesh = sharding.make_mesh({"data": -1})
    source, _, _ = _state(mesh, seed=1)
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=1, keep_latest=1)
    ckpt.save(3, source, {"phase": "short", "batch_index": 3}, META)
    ckpt.close()
    _fresh, abstract, _ = _state(mesh, seed=2)
    params = checkpoint.restore_params(str(tmp_path), abstract.params)
    _assert_trees_equal(params, source.params)
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        checkpoint.restore_params(str(tmp_path / "empty"), abstract.params)


def test_unfinished_save_is_ignored_and_can_be_redone(tmp_path):
    mesh = sharding.make_mesh({"data": -1})
    state, _, _ = _state(mesh)
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=1, keep_latest=3)
    ckpt.save(2, state, {"phase": "short", "batch_index": 2}, META)
    ckpt.close()
    # What a kill -9 during an async save leaves behind.
    os.makedirs(tmp_path / "4.orbax-checkpoint-tmp" / "state")
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=1, keep_latest=3)
    assert ckpt.latest_step() == 2
    assert ckpt.save(4, state, {"phase": "short", "batch_index": 4}, META)
    ckpt.wait()
    assert ckpt.latest_step() == 4
    ckpt.close()


def test_relative_directory_works(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mesh = sharding.make_mesh({"data": -1})
    state, abstract, _ = _state(mesh)
    ckpt = checkpoint.Checkpointer("relative/checkpoints", save_every=1, keep_latest=1)
    ckpt.save(1, state, {"phase": "short", "batch_index": 1}, META)
    ckpt.close()
    assert (tmp_path / "relative" / "checkpoints" / "1").is_dir()
    np.testing.assert_array_equal(
        checkpoint.restore_params("relative/checkpoints", abstract.params)["bert"]["pooler"][
            "dense"
        ]["kernel"],
        state.params["bert"]["pooler"]["dense"]["kernel"],
    )


def test_older_checkpoints_are_compared_on_the_model_fields_they_record():
    """A checkpoint written before `layer_norm_eps` was recorded still resumes; a field it
    records must still match."""
    run = {"model": {"hidden_size": 8, "layer_norm_eps": 1e-12}, "tokenizer": "abc"}
    checkpoint_checks.check_compatible(
        {"model": {"hidden_size": 8}, "tokenizer": "abc"}, run, "old"
    )
    with pytest.raises(checkpoint_checks.CheckpointMismatch, match="different model"):
        checkpoint_checks.check_compatible(
            {"model": {"hidden_size": 16}, "tokenizer": "abc"}, run, "old"
        )
    with pytest.raises(checkpoint_checks.CheckpointMismatch, match="different tokenizer"):
        checkpoint_checks.check_compatible(
            {"model": {"hidden_size": 8}, "tokenizer": "xyz"}, run, "old"
        )


def test_a_save_interrupted_in_its_announcement_is_announced_once(tmp_path):
    """Ctrl-C while `on_commit` prints (before: the close that follows sealed and announced
    the step a second time)."""
    announced = []

    def on_commit(step):
        announced.append(step)
        if len(announced) == 1:
            raise KeyboardInterrupt

    state, _, _ = _state(sharding.make_mesh({"data": -1}))
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=1, keep_latest=1, on_commit=on_commit)
    ckpt.save(1, state, {"phase": "short", "batch_index": 1}, META)
    with pytest.raises(KeyboardInterrupt):
        ckpt.wait()
    ckpt.close()
    assert announced == [1] and checkpoint.verify(f"{tmp_path}/1") == (True, None)


def test_half_written_init_checkpoint_is_one_line(tmp_path):
    """An init_checkpoint whose latest step lost its state files before its seal (a kill
    mid-save on an object store, where Orbax writes into the final directory): one line
    naming the step and what to do, not TensorStore's traceback."""
    mesh = sharding.make_mesh({"data": -1})
    source, abstract, _ = _state(mesh, seed=1)
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=1, keep_latest=2)
    for step in (3, 6):
        ckpt.save(step, source, {"phase": "short", "batch_index": step}, META)
    ckpt.close()
    os.remove(tmp_path / "6" / checkpoint.CHECKSUMS)
    shutil.rmtree(tmp_path / "6" / "state" / "d")
    with pytest.raises(checkpoint_checks.CheckpointMismatch) as raised:
        checkpoint.restore_params(str(tmp_path), abstract.params)
    message = str(raised.value)
    assert (
        message.startswith(
            f"init_checkpoint {tmp_path}: its latest checkpoint {tmp_path}/6 cannot be read ("
        )
        and "\n" not in message
    )
    assert message.endswith(
        "; it has no checksums, so its save may never have finished: move "
        "it out of the way to start from the step before it, or finish "
        "that run"
    )
