"""The start-up sharding/memory report, the mesh divisibility check, and `python -m bertjax.tools.aot`."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from bertjax.models.bert.model import BertConfig, BertForPreTraining
from bertjax.training import memory, optim, sharding
from bertjax.training.phase_schedule import Phase
from bertjax.training.state import create_train_state

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = (jnp.zeros((1, 8), jnp.int32),) * 3 + (jnp.zeros((1, 2), jnp.int32),)
PHASE = Phase("short", 32, 5, 16, 0, 10)


def _config(**overrides) -> BertConfig:
    fields = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return BertConfig(**{**fields, **overrides})


def _state(config: BertConfig, mesh, materialize=False):
    tx = optim.make_optimizer(
        optim.OptimizerConfig(peak_learning_rate=1e-3, warmup_steps=1, total_steps=10)
    )
    model = BertForPreTraining(config)
    return model, create_train_state(
        model, tx, jax.random.PRNGKey(0), EXAMPLE, mesh, materialize=materialize
    )


def test_report_names_every_sharding_and_counts_real_bytes():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    model, (state, abstract, _) = _state(_config(), mesh, materialize=True)
    # Bytes per device equal what device 0 really holds.
    for tree in (state.params, state.opt_state):
        held = sum(
            shard.data.nbytes
            for leaf in jax.tree.leaves(tree)
            for shard in leaf.addressable_shards
            if shard.device == jax.devices()[0]
        )
        assert memory.per_device_bytes(tree) == held
    text = memory.report(model, abstract, mesh, [PHASE])
    lines = {line.split()[0]: line for line in text.splitlines()[1:] if "/" in line.split()[0]}
    query = lines["bert/encoder/layer_*/attention/self/query/kernel"]
    assert "32x32 (x2)" in query and "(embed, qkv)" in query and "(fsdp, tensor)" in query
    assert query.endswith("1.00 KiB")  # 2 layers x 32 x 32 x 4 bytes / (2 x 4 devices)
    assert "(vocab, embed)" in lines["bert/embeddings/word_embeddings"]
    assert (
        "(norm)" in lines["bert/embeddings/LayerNorm/scale"]
        and "-> (-)" in lines["bert/embeddings/LayerNorm/scale"]
    )
    assert "phase short: 8 of 16 sequences x 32 tokens per device" in text
    total = re.search(r"total +([\d.]+ \w+)  \(phase short", text).group(1)
    assert memory.summary(model, abstract, mesh, [PHASE]).endswith(
        f"parameters; mesh data=1 fsdp=2 tensor=4 (8 devices); per device before XLA "
        f"temporaries: {total} (short)"
    )


def test_activation_estimate_follows_remat_and_tensor_split():
    full = memory.activation_estimate(_config(), PHASE, 8, 1)
    remat = memory.activation_estimate(_config(remat_policy="full"), PHASE, 8, 1)
    split = memory.activation_estimate(_config(), PHASE, 8, 4)
    deeper = memory.activation_estimate(_config(num_hidden_layers=4), PHASE, 8, 1)
    assert full.recompute == 0 and remat.recompute > 0
    assert remat.saved < full.saved / 3 and remat.total < full.total
    assert full.saved / 4 < split.saved < full.saved
    per_layer = (deeper.saved - full.saved) / 2
    # Each layer keeps at least its scores/probabilities and its FFN activations (float32).
    assert per_layer > 8 * 4 * 32 * 32 * 4 + 2 * 8 * 32 * 64 * 4


@pytest.mark.parametrize(
    "overrides, mesh_axes, devices, message",
    [
        ({}, {"tensor": 8}, 8, "mesh.tensor=8 does not divide model.num_attention_heads=4"),
        ({"vocab_size": 130}, {"tensor": 4}, 4, "--config.model.vocab_size=132"),
    ],
)
def test_mesh_that_cannot_split_the_model_is_named(overrides, mesh_axes, devices, message):
    mesh = sharding.make_mesh(mesh_axes, jax.devices()[:devices])
    model, (_, abstract, _) = _state(_config(**overrides), mesh)
    with pytest.raises(memory.MeshMismatch, match=message.replace(".", r"\.")):
        memory.check_shardable(model.config, abstract.params, mesh)


def _aot(*flags: str, out: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("XLA_FLAGS", None)  # the tool sets its own device count
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.tools.aot",
            "--config=configs/tiny.py",
            *([f"--out={out}"] if out else []),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_aot_compiles_for_sixteen_fake_devices(tmp_path):
    out = tmp_path / "aot.json"
    result = _aot(
        "--num_devices=16",
        "--config.mesh.data=2",
        "--config.mesh.fsdp=4",
        "--config.mesh.tensor=2",
        "--config.model.num_hidden_layers=1",
        "--config.model.hidden_size=32",
        "--config.model.intermediate_size=64",
        "--config.model.vocab_size=512",
        "--config.data.max_predictions_per_seq=4",
        "--config.train.global_batch_size=16",
        "--config.long_phase.fraction=0",
        out=str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("cpu x16 (cpu, 16 devices), mesh data=2 fsdp=4 tensor=2")
    assert lines[1].startswith(
        "Phase short (L=128, global batch 16, 2 per device): no memory "
        "verdict on fake CPU devices (compile for a --target)"
    )
    assert lines[2] == f"Details: {out}"
    details = json.loads(out.read_text())
    assert "Mesh {'data': 2, 'fsdp': 4, 'tensor': 2} (16 devices)" in details["startup_report"]
    assert details["phases"]["short"]["memory"]["argument"] > 0
    # Nothing but the summary on the console: JAX's and XLA's own lines go to the log.
    assert not result.stderr


def test_aot_names_a_sharding_error():
    result = _aot("--num_devices=8", "--config.mesh.data=1", "--config.mesh.tensor=8")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "does not divide model.num_attention_heads=2" in errors[0], (
        result.stderr[-2000:]
    )


def test_a_state_beyond_the_address_space_limit_is_one_line_before_allocating():
    """Under `ulimit -v` (set to what the process maps now plus 1 GiB), the state of a model
    whose parameters and Adam moments take 1.5 GiB is refused before it is allocated, naming
    both figures and the limit (XLA's CPU client waited for ever on it, past SIGTERM); the
    tiny model's passes."""
    script = """
import resource
import jax, ml_collections
import jax.numpy as jnp
from bertjax.training import memory, optim, sharding
from bertjax.models.bert.model import BertConfig, BertForPreTraining
from bertjax.training.state import create_train_state
mesh = sharding.make_mesh({'data': 1, 'fsdp': 1, 'tensor': 1}, jax.devices()[:1])
tx = optim.make_optimizer(optim.OptimizerConfig(peak_learning_rate=1e-3,
                                                         warmup_steps=1, total_steps=10))
states = {}
for hidden in (32, 2048):  # 0.04 MiB, then 1.2 GiB of parameters and moments
    config = BertConfig(vocab_size=128, hidden_size=hidden, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=4 * hidden,
                        max_position_embeddings=32)
    states[hidden] = create_train_state(
        BertForPreTraining(config), tx, jax.random.PRNGKey(0),
        (jnp.zeros((1, 8), jnp.int32),) * 3 + (jnp.zeros((1, 2), jnp.int32),), mesh,
        materialize=False)[1]
mapped = memory._proc_kib('/proc/self/status', 'VmSize') * 1024
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
for hidden, abstract in states.items():
    try:
        memory.check_host_memory(abstract, mesh)
        print(hidden, 'fits')
    except memory.WontFit as e:
        print(hidden, 'error:', e)
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": REPO_ROOT,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        },
        check=False,
    )
    lines = result.stdout.splitlines()
    assert lines[:1] == ["32 fits"], result.stdout + result.stderr
    assert re.fullmatch(
        r"2048 error: the training state \(parameters and optimizer moments\) "
        r"needs 1\.\d+ GiB on this host's 1 CPU device, but this process can "
        r"allocate only (1\.00 GiB|10\d\d\.\d+ MiB) more \(its address-space limit, ulimit "
        r"-v\); use a smaller model \(configs/tiny\.py\), raise the limit, or run "
        r"on an accelerator",
        lines[1],
    ), lines
