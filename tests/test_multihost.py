"""Scale-out on fake CPU devices: every mesh layout trains like one device, checkpoints move
between meshes and device counts, and two processes (jax.distributed over gloo) train like
one process with all the devices."""

import functools
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from bertjax.checkpoints import checkpoint
from bertjax.data import corpus, corpus_source, default_corpus
from bertjax.data.loaders import prepare_data
from bertjax.data.settings import DataSettings
from bertjax.models.bert.model import BertConfig, BertForPreTraining, example_inputs
from bertjax.runtime import distributed
from bertjax.training import objectives, optim, sharding, steps
from bertjax.training.settings import plan_phases
from bertjax.training.state import create_train_state

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 8 heads, and every sharded dimension divisible by 8, so tensor=8 is a valid layout.
MODEL = BertConfig(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=8,
    intermediate_size=128,
    max_position_embeddings=32,
)
EXAMPLE = (jnp.zeros((1, 8), jnp.int32),) * 3 + (jnp.zeros((1, 2), jnp.int32),)
BATCH, LENGTH, PREDICTIONS = 16, 16, 4
# The rules table, restated: which mesh axis each logical parameter axis must be split over.
EXPECTED_MESH_AXIS = {"vocab": "tensor", "embed": "fsdp", "qkv": "tensor", "mlp": "tensor"}


def _batches(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "input_ids": rng.integers(5, MODEL.vocab_size, (BATCH, LENGTH), dtype=np.int32),
            "input_mask": (np.arange(LENGTH) < rng.integers(8, LENGTH + 1, (BATCH, 1))).astype(
                np.int32
            ),
            "segment_ids": (np.arange(LENGTH) >= LENGTH // 2)
            .astype(np.int32)[None]
            .repeat(BATCH, 0),
            "masked_lm_positions": np.sort(rng.integers(1, 8, (BATCH, PREDICTIONS)), 1).astype(
                np.int32
            ),
            "masked_lm_ids": rng.integers(
                5, MODEL.vocab_size, (BATCH, PREDICTIONS), dtype=np.int32
            ),
            "masked_lm_weights": np.ones((BATCH, PREDICTIONS), np.float32),
            "next_sentence_labels": rng.integers(0, 2, (BATCH,), dtype=np.int32),
        }
        for _ in range(count)
    ]


def _tx():
    return optim.make_optimizer(
        optim.OptimizerConfig(peak_learning_rate=1e-3, warmup_steps=2, total_steps=20)
    )


@functools.cache
def _layout(axes: tuple[tuple[str, int], ...], num_devices: int):
    """Mesh, abstract state, shardings and the jitted step of a layout of the first
    `num_devices` (compiled once per test module)."""
    mesh = sharding.make_mesh(dict(axes), jax.devices()[:num_devices])
    model, tx = BertForPreTraining(MODEL), _tx()
    _, abstract, shardings = create_train_state(
        model, tx, jax.random.PRNGKey(0), EXAMPLE, mesh, materialize=False
    )
    return (
        mesh,
        abstract,
        shardings,
        steps.jit_train_step(steps.make_train_step(model, tx), shardings, mesh),
    )


@functools.cache
def _initial_state():
    """The initial state on the host (the same values as a sharded init on any mesh)."""
    mesh = sharding.make_mesh({}, jax.devices()[:1])
    state, _, _ = create_train_state(
        BertForPreTraining(MODEL), _tx(), jax.random.PRNGKey(0), EXAMPLE, mesh
    )
    return jax.device_get(state)


def _setup(axes: dict[str, int], num_devices: int = 8):
    """Mesh, a fresh state placed on it, the abstract state and the step of a layout."""
    mesh, abstract, shardings, step = _layout(tuple(sorted(axes.items())), num_devices)
    return mesh, jax.device_put(_initial_state(), shardings), abstract, step


def _train(mesh, state, step, batches) -> tuple[object, list[float]]:
    losses = []
    with sharding.activate(mesh):
        for batch in batches:
            state, metrics = step(state, sharding.global_batch_from_host(batch, mesh))
            losses.append(objectives.summarize(jax.device_get(metrics))["loss"])
    return state, losses


@pytest.fixture(scope="module")
def one_device_losses() -> list[float]:
    mesh, state, _, step = _setup({}, 1)
    return _train(mesh, state, step, _batches(3))[1]


SLOW = pytest.mark.slow  # (CI's `slow` stage: 2-2-2, every axis at once, stays in the default)


@pytest.mark.parametrize(
    "axes",
    [
        pytest.param(dict(data=8), marks=SLOW),
        dict(data=2, fsdp=2, tensor=2),
        pytest.param(dict(fsdp=8), marks=SLOW),
        pytest.param(dict(tensor=8), marks=SLOW),
    ],
    ids=["8-1-1", "2-2-2", "1-8-1", "1-1-8"],
)
def test_sharded_equals_unsharded(axes, one_device_losses):
    mesh, state, _, step = _setup(axes)
    boxed = jax.eval_shape(lambda: BertForPreTraining(MODEL).init(jax.random.PRNGKey(0), *EXAMPLE))[
        "params"
    ]  # carries the logical axis names
    logical = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    leaves = jax.tree_util.tree_leaves_with_path(state.params)
    assert len(logical) == len(leaves)
    for (path, leaf), names in zip(leaves, logical):
        expected = PartitionSpec(*[EXPECTED_MESH_AXIS.get(name) for name in names.names])
        assert leaf.sharding.spec == expected, (path, leaf.sharding.spec, expected)
        shard_shape = tuple(d // (mesh.shape[a] if a else 1) for d, a in zip(leaf.shape, expected))
        assert {s.data.shape for s in leaf.addressable_shards} == {shard_shape}, path
    if axes.get("tensor") == 8:  # 8 heads on 8 devices: one head's columns each
        query = state.params["bert"]["encoder"]["layer_0"]["attention"]["self"]["query"]["kernel"]
        assert query.addressable_shards[0].data.shape == (64, 8)
    _, losses = _train(mesh, state, step, _batches(3))
    np.testing.assert_allclose(losses, one_device_losses, rtol=2e-5)


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_restore_onto_other_meshes_and_device_counts(tmp_path):
    """Saved on 8 devices (2,2,2) after two steps; restored on 4, 2, 1 devices and on another
    8-device layout: params and optimizer state identical, and the next steps' losses equal
    those of the run that never stopped."""
    batches = _batches(4)
    mesh, state, _, step = _setup(dict(data=2, fsdp=2, tensor=2))
    state, _ = _train(mesh, state, step, batches[:2])
    saved = jax.device_get(state)
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=2, keep_latest=1)
    assert ckpt.save(2, state, {"phase": "short", "batch_index": 2}, {})
    ckpt.close()
    _, expected = _train(mesh, state, step, batches[2:])

    for axes, devices in [(dict(fsdp=4), 4), (dict(data=2), 2), ({}, 1), (dict(tensor=8), 8)]:
        mesh, _, abstract, step = _setup(axes, devices)
        ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=2, keep_latest=1)
        restored, position, _ = ckpt.restore(2, abstract, {})
        ckpt.close()
        assert position["batch_index"] == 2
        kernel = restored.params["bert"]["encoder"]["layer_0"]["intermediate"]["dense"]["kernel"]
        assert kernel.sharding.mesh.size == devices and len(kernel.addressable_shards) == devices
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), saved)
        _, losses = _train(mesh, restored, step, batches[2:])
        np.testing.assert_allclose(losses, expected, rtol=2e-5, err_msg=str(axes))


# ----------------------------------------------------------------------------- two processes

TINY_OVERRIDES = {
    "model.vocab_size": 512,
    "model.hidden_size": 32,
    "model.num_hidden_layers": 1,
    "model.num_attention_heads": 4,
    "model.intermediate_size": 64,
    "model.max_position_embeddings": 64,
    "data.source": "text",
    "data.sentencepiece_vocab_size": 512,
    "data.max_seq_length": 64,
    "data.max_predictions_per_seq": 10,
    "data.dupe_factor": 2,
    "data.eval_fraction": 0.0,
    "long_phase.fraction": 0.0,
    "train.global_batch_size": 16,
    "train.total_steps": 4,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.eval_batches": 1,
    "train.checkpoint_every": 2,
    "optimizer.warmup_steps": 2,
}


def _tiny_config(corpus_file: str, cache_dir: str) -> ml_collections.ConfigDict:
    config = runpy.run_path(os.path.join(REPO_ROOT, "configs", "tiny.py"))["get_config"]()
    for key, value in {
        **TINY_OVERRIDES,
        "data.input_files": corpus_file,
        "data.cache_dir": cache_dir,
    }.items():
        section, field = key.split(".")
        config[section][field] = value
    return config


@pytest.mark.slow  # over a minute end to end (docs/testing.md)
def test_two_processes_train_like_one(tmp_path):
    corpus_file = tmp_path / "corpus.txt"
    documents = [doc for doc in default_corpus.default_corpus() if len(doc) >= 2][:200]
    corpus_file.write_text("\n\n".join("\n".join(doc) for doc in documents) + "\n")
    cache_dir, workdir = str(tmp_path / "cache"), str(tmp_path / "run")
    config = _tiny_config(str(corpus_file), cache_dir)
    tokenizer = corpus_source.load_or_train_tokenizer(
        DataSettings.of(config.data), cache_dir
    )  # shared by both

    port = distributed.free_port()
    flags = [
        f"--config.{k}={v}"
        for k, v in {
            **TINY_OVERRIDES,
            "data.input_files": corpus_file,
            "data.cache_dir": cache_dir,
        }.items()
    ]
    env = {
        **os.environ,
        "PYTHONPATH": REPO_ROOT,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bertjax.train",
                "--config=configs/tiny.py",
                f"--workdir={workdir}",
                f"--coordinator_address=localhost:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                *flags,
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            proc.kill()
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {i}:\n{out[-3000:]}"
    # Only process 0 reports progress; metrics and TensorBoard exist once, written by it.
    assert "step 4/4" in outputs[0] and "step 4/4" not in outputs[1]
    assert "per device before XLA temporaries" in outputs[0]
    assert "per device before XLA temporaries" not in outputs[1]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        logged = [row for row in map(json.loads, f) if row["split"] == "train"]
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    with open(os.path.join(workdir, "final_metrics.json")) as f:  # the supervisor's end mark
        assert json.load(f)["step"] == 4

    # Both processes prepared the whole corpus alike: one cache entry (issue 53).
    prepared = [
        d
        for d in os.listdir(cache_dir)
        if d.startswith("short_") and os.path.exists(os.path.join(cache_dir, d, "meta.json"))
    ]
    assert len(prepared) == 1, prepared
    documents = len(
        list(corpus_source.read_documents(DataSettings.of(config.data), 0, 1, corpus.CorpusStats()))
    )
    assert json.loads(Path(os.path.join(cache_dir, prepared[0], "meta.json")).read_text())[
        "documents"
    ] == (documents)

    # One process, 8 devices, the same global batches (process 0's rows, then process 1's).
    phases = plan_phases(config.train, config.data, config.long_phase)
    loaders = [
        pd[0].train
        for pd in (
            prepare_data(
                DataSettings.of(config.data),
                phases,
                config.model.vocab_size,
                tokenizer,
                cache_dir,
                i,
                2,
            )
            for i in range(2)
        )
    ]
    mesh = sharding.make_mesh(config.mesh.to_dict())
    model = BertForPreTraining(BertConfig.from_dict(config.model.to_dict()))
    tx = optim.make_optimizer(optim.optimizer_config(config.optimizer, config.train.total_steps))
    example = example_inputs(model)
    state, abstract, shardings = create_train_state(
        model, tx, jax.random.PRNGKey(config.train.seed), example, mesh
    )
    step = steps.jit_train_step(steps.make_train_step(model, tx), shardings, mesh)
    losses = []
    with sharding.activate(mesh):
        for index in range(4):
            parts = [loader.batch(index) for loader in loaders]
            batch = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
            state, metrics = step(state, sharding.global_batch_from_host(batch, mesh))
            losses.append(objectives.summarize(jax.device_get(metrics))["loss"])
    assert losses[-1] != losses[0]  # the steps trained
    np.testing.assert_allclose([m["loss"] for m in logged], losses, rtol=2e-5)

    # The checkpoint both processes wrote restores in one process onto 8 devices.
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), 2, 3)
    assert ckpt.latest_step() == 4
    restored, _, _ = ckpt.restore(4, abstract, {})
    ckpt.close()
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        jax.device_get(restored.params),
        jax.device_get(state.params),
    )
