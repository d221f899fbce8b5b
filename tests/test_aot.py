"""`python -m bertjax.tools.aot --target=...`: the kernel census of optimized HLO, the verdict
and the compiler's refusal, target names, and "auto" resolved for the target's devices.

The cross-compiles themselves (libtpu, the CUDA plugin: `pip install -e '.[aot]'`) are
marked `aot`: `python -m pytest -m aot tests/test_aot.py` (a stage of .ci/run)."""

import json
import os
import subprocess
import sys
import types

import jax
import ml_collections
import pytest

from bertjax.models import attention, compile_target
from bertjax.models.bert import model as bert_model
from bertjax.models.bert.model import BertConfig, BertForPreTraining
from bertjax.runtime import backend_env, targets
from bertjax.tools import fit_verdict, hlo_census, phase_compile, tpu_estimate
from bertjax.training import autofit, memory, optim, sharding
from bertjax.training.phase_schedule import Phase
from bertjax.training.state import create_train_state
from test_modernbert_io import hf_dir  # noqa: F401 (fixture)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An elementwise fusion, and a loop body that runs it (BODY_ATTRS: its metadata).
LOOP = """%fused_add (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %add.1 = f32[1024]{0} add(%p0, %p0)
}

%body (arg: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %arg = (s32[], f32[1024]{0}) parameter(0)
  %v = f32[1024]{0} get-tuple-element(%arg), index=1
  %i = s32[] get-tuple-element(%arg), index=0
  %add = f32[1024]{0} fusion(%v), kind=kLoop, calls=%fused_addBODY_ATTRS
  ROOT %t = (s32[], f32[1024]{0}) tuple(%i, %add)
}

%cond (arg: (s32[], f32[1024])) -> pred[] {
  %arg = (s32[], f32[1024]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}
"""

# A step in miniature: a gemm fusion and a cuBLAS gemm, cuDNN attention forward and
# backward, a loop of 3 trips around a small elementwise fusion, a conditional whose costlier
# branch counts, a copy; parameters, tuples and get-tuple-element launch nothing.
HLO = (
    """HloModule jit_step, is_scheduled=true

%fused_dot (p0: bf16[64,128], p1: bf16[128,256]) -> bf16[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

"""
    + LOOP.replace("BODY_ATTRS", "")
    + """
%cheap (p: f32[1024]) -> f32[1024] {
  ROOT %p = f32[1024]{0} parameter(0)
}

%costly (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %twice = f32[1024]{0} fusion(%p), kind=kLoop, calls=%fused_add
}

ENTRY %main (a: bf16[64,128], b: bf16[128,256], q: bf16[2,128,4,64], w: f32[1024], flag: pred[]) -> f32[1024] {
  %a = bf16[64,128]{1,0} parameter(0)
  %b = bf16[128,256]{1,0} parameter(1)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(2)
  %w = f32[1024]{0} parameter(3)
  %flag = pred[] parameter(4)
  %gemm = bf16[64,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  %cublas = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %fwd = (bf16[2,128,4,64]{3,2,1,0}, f32[2,4,128]{2,1,0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmaxDropout"
  %bwd = (bf16[2,128,4,64]{3,2,1,0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmaxDropoutBackward"
  %init = (s32[], f32[1024]{0}) tuple(%flag, %w)
  %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %picked = f32[1024]{0} conditional(%flag, %w, %w), true_computation=%cheap, false_computation=%costly
  ROOT %copy.1 = f32[1024]{0} copy(%picked)
}
"""
)


def test_census_counts_kernels_flops_and_bytes():
    result = hlo_census.census(HLO, peak_tflops=1.0, bandwidth_bytes_per_second=1e9)
    assert dict(result.kernels) == {"matmul": 2, "attention": 2, "fusion:kLoop": 4, "copy": 1}
    matmul_flops = 2 * 64 * 256 * 128
    attention_flops = (4 + 10) * 2 * 4 * 128 * 128 * 64
    assert result.flops == 2 * matmul_flops + attention_flops
    gemm_bytes = 2 * (64 * 128 + 128 * 256 + 64 * 256)
    qkv = 2 * 128 * 4 * 64 * 2
    attention_bytes = (3 * qkv + qkv + 2 * 4 * 128 * 4) + (3 * qkv + qkv)
    elementwise = 4 * 1024 * 2  # f32[1024] in and out
    assert result.matmul_bytes == 2 * gemm_bytes + 4194304 + attention_bytes
    assert result.non_matmul_bytes == 5 * elementwise  # 3 loop trips, the costly branch, copy
    assert result.small_kernels == 5
    per_head = 2 * 4 * 128 * 128 * 64
    expected = (
        max(matmul_flops / 1e12, gemm_bytes / 1e9)  # each kernel's roofline
        + max(matmul_flops / 1e12, (gemm_bytes + 4194304) / 1e9)  # + the workspace
        + max(4 * per_head / 1e12, (4 * qkv + 4096) / 1e9)
        + max(10 * per_head / 1e12, 4 * qkv / 1e9)
        + 5 * elementwise / 1e9
    )
    assert result.seconds == pytest.approx(expected)


def test_census_of_a_module_without_entry_is_an_error():
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo_census.census("HloModule empty\n", 1.0, 1.0)


def test_parse_refusal_reads_the_tpu_compilers_numbers():
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (23.90G) exceeds available HBM (15.75G)."
    )
    assert fit_verdict.parse_refusal(message) == (23.90 * 2**30, 15.75 * 2**30)
    other = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 40.31G of 30.75G hbm."
    assert fit_verdict.parse_refusal(other) == (40.31 * 2**30, 30.75 * 2**30)
    assert fit_verdict.parse_refusal("INVALID_ARGUMENT: shapes do not match") is None


def _config(remat="none", accumulation=1, fsdp=1):
    return ml_collections.ConfigDict(
        {
            "mesh": {"data": -1, "fsdp": fsdp, "tensor": 1},
            "train": {"grad_accum_steps": accumulation},
            "model": {"remat_policy": remat},
        }
    )


def test_verdict_fits_or_refused_with_candidates_cheapest_first():
    gib = 2**30
    sizes = {"argument": 4 * gib, "output": 4 * gib, "alias": 4 * gib, "temp": 6 * gib}
    fits = fit_verdict.verdict(sizes, None, 16 * gib, _config(), 32, 4 * gib)
    assert (
        fits["fits"]
        and "peak 10.0 GiB of 16.00 GiB per device, 6.0 GiB headroom" in fits["text"]
        and "candidates" not in fits
    )
    refused = fit_verdict.verdict(None, (24 * gib, 15.75 * gib), None, _config(), 32, 4 * gib)
    assert refused["fits"] is False
    assert refused["text"] == "does NOT fit: the compiler needs 24.0 GiB of 15.75 GiB per device"
    # 20 GiB of activations for 11.75: split the batch at least 1.7 times (2 and 4 of 32
    # per device), then recompute, then shard the state.
    assert [c["flags"] for c in refused["candidates"]] == [
        "--config.train.grad_accum_steps=2",
        "--config.train.grad_accum_steps=4",
        "--config.model.remat_policy=dots",
        "--config.model.remat_policy=full",
        "--config.mesh.fsdp=-1 --config.mesh.data=1",
    ]
    assert refused["candidates"][0]["overrides"] == {"train.grad_accum_steps": 2}
    # Already 2 micro-batches of a batch of 72 (36 each), 3.2 times the activations' room:
    # 8 and 9 micro-batches are the first that can be enough (a divisor of 72).
    assert [
        c["flags"]
        for c in fit_verdict.candidates(35 * gib, 13 * gib, 3 * gib, _config("dots", 2, 1), 72, 2)
    ][:3] == [
        "--config.train.grad_accum_steps=8",
        "--config.train.grad_accum_steps=9",
        "--config.model.remat_policy=full",
    ]
    # Parameters and optimizer state over half the memory: shard them first.
    assert fit_verdict.verdict(None, (20 * gib, 16 * gib), None, _config(), 32, 10 * gib)[
        "candidates"
    ][0]["overrides"] == {"mesh.fsdp": -1, "mesh.data": 1}
    # Already full remat, sharded, and no batch to split further: nothing to try.
    assert fit_verdict.candidates(40 * gib, 16 * gib, gib, _config("full", 1, 8), 1) == []
    assert (
        fit_verdict.verdict({}, None, None, _config(), 32, gib)["fits"] is None
    )  # fake CPU devices


def test_advice_only_what_the_compiler_confirmed_and_exit_status(tmp_path):
    """A phase that does not fit a tight budget (fake CPU devices, the CPU compiler's
    figures): the candidates are compiled cheapest first and the first that fits is the
    advice; the exit status says it did not fit as configured."""
    result = _aot(
        "--num_devices=2",
        "--memory_gib=0.0028",
        "--config.model.dtype=float32",
        "--config.model.vocab_size=128",
        "--config.data.max_seq_length=32",
        "--config.data.max_predictions_per_seq=4",
        out=str(tmp_path / "cpu.json"),
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "does NOT fit: peak" in lines[1], result.stdout
    assert lines[2].startswith("  --config.train.grad_accum_steps=2: fits: peak"), result.stdout
    assert lines[3] == "  advice, confirmed by the compiler: --config.train.grad_accum_steps=2"
    advice = json.loads((tmp_path / "cpu.json").read_text())["phases"]["short"]["advice"]
    assert advice["fits_with"] == "--config.train.grad_accum_steps=2"
    assert advice["untried"][0] == "--config.train.grad_accum_steps=4"


def test_targets_by_name_and_raw_topology():
    assert targets.parse("tpu-v5e-8").topology == "v5e:2x4"
    raw = targets.parse("v5p:2x2x2")
    assert (raw.topology, raw.chip_config, raw.hbm_bytes) == (
        "v5:2x2x2",
        "megacore",
        targets.TARGETS["tpu-v5p-8"].hbm_bytes,
    )
    assert targets._host_bounds(targets.parse("v5e:4x4")) == (2, 4, 1)
    assert targets._host_bounds(targets.parse("v4:2x2x1")) == (2, 2, 1)
    with pytest.raises(targets.TargetError, match="choose one of"):
        targets.parse("v9:2x2")
    h100 = targets.gpu_target_config("h100")
    assert "NVIDIA H100 80GB HBM3" in h100 and targets._cudnn_version(h100) == 91000


def test_auto_attention_resolves_for_the_target_device_not_the_host():
    gpu = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    tpu = types.SimpleNamespace(platform="tpu")
    assert attention.resolve_impl("auto", "bfloat16", 64, dropout_rate=0.1) == "einsum"  # host
    with compile_target.target_device(gpu):
        assert (
            attention.resolve_impl("auto", "bfloat16", 64, dropout_rate=0.0, packed=True) == "cudnn"
        )
    with compile_target.target_device(tpu):
        assert attention.resolve_impl("auto", "bfloat16", 64, dropout_rate=0.0) == "pallas"
    assert compile_target.target_platform() == "cpu"
    mesh = sharding.make_mesh({"data": -1})
    with sharding.activate(mesh):
        assert compile_target._TARGET_DEVICE.get() is mesh.devices.flat[0]


def test_auto_accumulation_fits_the_devices_memory(monkeypatch):
    config = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:2])
    tx = optim.make_optimizer(
        optim.OptimizerConfig(peak_learning_rate=1e-3, warmup_steps=1, total_steps=10)
    )
    _, state, _ = create_train_state(
        BertForPreTraining(config),
        tx,
        jax.random.PRNGKey(0),
        bert_model.example_inputs(BertForPreTraining(config)),
        mesh,
        materialize=False,
    )
    phases = [Phase("short", 16, 2, 64, 0, 9), Phase("long", 64, 4, 64, 9, 10)]
    assert autofit.accumulation(0, config, state, mesh, phases) == {"short": 1, "long": 1}  # CPU
    assert autofit.accumulation(4, config, state, mesh, phases) == {"short": 4, "long": 4}
    state_bytes = 2 * memory.per_device_bytes(state.params) + memory.per_device_bytes(
        state.opt_state
    )
    long_32 = memory.activation_estimate(config, phases[1], 32, 1).total
    # Memory for the state and a little more than 8 long sequences' activations per device.
    budget = (state_bytes + long_32 / 4 * 1.1) / autofit.MEMORY_MARGIN
    monkeypatch.setattr(autofit, "device_memory", lambda device: budget)
    chosen = autofit.accumulation(0, config, state, mesh, phases)
    assert chosen == {"short": 1, "long": 4}  # 32 per device: 8 long ones at a time


@pytest.mark.parametrize(
    "record", ["large_tpu-v5e-8_at_4e78998.json", "large_tpu-v4-8_long_at_4e78998.json"]
)
def test_the_tpu_activation_factor_covers_what_libtpu_compiled(record):
    """autofit's estimate for a TPU (the state, the gradients and ACTIVATION_FACTOR times JAX's
    count of the saved activations) is at least the memory libtpu needed for BERT-large's
    L=512 step in one micro-batch (the records; 0.5 let v5e-8 through at 15.2 of 15.75 GiB)."""
    with open(os.path.join(REPO_ROOT, "benchmarks", "aot", record), encoding="utf-8") as f:
        compiled = json.load(f)["phases"]["long"]
    assert compiled["grad_accum_steps"] == 1
    config = BertConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        dtype="bfloat16",
        attention_impl="pallas",
    )
    phase = Phase("long", 512, 80, 256, 0, 1)
    counted = memory.activation_estimate(config, phase, compiled["per_device_batch"], 1).total
    state = compiled["memory"]["argument"]  # parameters and Adam's two moments, float32 each
    estimate = state + state / 3 + autofit.ACTIVATION_FACTOR["tpu"] * counted
    assert estimate >= compiled["verdict"]["required_bytes"]


def _aot(*flags: str, out: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(name, None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.tools.aot",
            "--config=configs/tiny.py",
            "--config.model.num_hidden_layers=1",
            "--config.model.hidden_size=64",
            "--config.model.num_attention_heads=2",
            "--config.model.intermediate_size=128",
            "--config.model.vocab_size=512",
            "--config.model.dtype=bfloat16",
            "--config.long_phase.fraction=0",
            f"--out={out}",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )


@pytest.mark.aot
def test_cross_compile_for_h100_and_a_tpu_slice(tmp_path):
    # Without attention dropout "auto" is cuDNN's kernel on a GPU (with it, the reference).
    h100 = _aot(
        "--target=h100",
        "--config.model.attention_probs_dropout_prob=0",
        out=str(tmp_path / "h100.json"),
    )
    assert h100.returncode == 0, h100.stderr[-3000:]
    lines = h100.stdout.splitlines()
    assert "attention cudnn" in lines[0]  # resolved for the H100, not for this CPU host
    assert lines[1].startswith("Phase short (L=128, global batch 16, 16 per device): fits: peak")
    assert lines[2].startswith("  estimate (roofline x 1.6 calibration, not measured):")
    assert len(lines) == 4 and not h100.stderr  # the compiler's log went to the file
    census = json.loads((tmp_path / "h100.json").read_text())["phases"]["short"]["gpu"]
    assert census["by_kind"]["attention"] == 2 and census["by_kind"]["matmul"] > 0
    assert 0 < census["estimated_mfu"] < 1

    # 16M x 64 embeddings: 4 GiB of parameters, 16 GiB with gradients and Adam's moments:
    # refused; sharding the state (the first candidate then) is compiled and fits.
    tpu = _aot(
        "--target=tpu-v5e-8", "--config.model.vocab_size=16000000", out=str(tmp_path / "v5e.json")
    )
    assert tpu.returncode == 2, tpu.stderr[-3000:]  # does not fit as configured
    assert "attention pallas" in tpu.stdout  # the recipe's attention dropout: flash_dropout
    record = json.loads((tmp_path / "v5e.json").read_text())["phases"]["short"]
    assert record["verdict"]["fits"] is False
    assert record["verdict"]["available_bytes"] == 15.75 * 2**30
    assert "does NOT fit: the compiler needs" in tpu.stdout
    assert record["advice"]["fits_with"] == "--config.mesh.fsdp=-1 --config.mesh.data=1"
    assert tpu.stdout.splitlines()[-2] == (
        "  advice, confirmed by the compiler: --config.mesh.fsdp=-1 --config.mesh.data=1"
    )


@pytest.mark.aot
@pytest.mark.parametrize("dropout", ["0", "0.1"])
def test_pallas_attention_with_remat_compiles_for_a_tpu_slice(dropout, tmp_path):
    """The recipe on a TPU ("auto": JAX's Pallas kernel without attention dropout, bertjax's
    flash_dropout with it) and with remat, which a real run on a long phase needs: it
    compiles. Before, the parameters' shapes were traced at 8 tokens (the kernel takes
    multiples of 128), and the memory estimate ran the kernel in interpret mode, whose host
    callbacks remat refuses."""
    result = _aot(
        "--target=tpu-v5e-8",
        f"--config.model.attention_probs_dropout_prob={dropout}",
        "--config.model.remat_policy=dots",
        out=str(tmp_path / "v5e.json"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "attention pallas, remat dots" in result.stdout.splitlines()[0]
    assert "fits: peak" in result.stdout


@pytest.mark.aot
def test_tpu_estimate_of_a_micro_batch_loop_is_scaled(tmp_path):
    """libtpu's cost analysis counts the micro-batch loop's body once: the tool's estimate of
    a step in 2 micro-batches has the FLOPs of the step in one (plus the accumulation's),
    not half of them, and its time scaled likewise. Also the calibration and estimate
    lines."""
    runs = {}
    for steps in (1, 2):
        result = _aot(
            "--target=tpu-v5p-8",
            f"--config.train.grad_accum_steps={steps}",
            out=str(tmp_path / f"v5p{steps}.json"),
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[steps] = json.loads((tmp_path / f"v5p{steps}.json").read_text())
    one, two = (runs[s]["phases"]["short"]["tpu"] for s in (1, 2))
    assert (
        "estimate (libtpu's cost model, not measured, the loop's body counted 2 times)"
        in result.stdout
        and "8192^3 bfloat16 matmul at" in result.stdout
    )
    assert two["compiler_flops"] == pytest.approx(one["compiler_flops"], rel=0.05)
    assert two["loop_trips"] == 2 and two["time_scale"] > 1.3
    # flash_dropout's two kernels, compiled alone, take their own time (their custom calls
    # have no cycles), half a batch each micro-batch; the rest shares the step's remainder.
    assert 0 < two["kernel_seconds"] == pytest.approx(one["kernel_seconds"], rel=0.05)
    assert two["optimal_seconds"] == pytest.approx(
        (two["compiler_optimal_seconds"] - two["kernel_seconds"] / 2) * two["time_scale"]
        + two["kernel_seconds"]
    )
    assert any(g["op"].startswith("custom-call") and g["seconds"] > 0 for g in one["census"])
    assert 0 < one["estimated_mfu"] < 1 and one["census"][0]["seconds"] > 0
    # The vector unit beside it: every Pallas kernel's jaxpr matched to its custom call.
    assert one["vector_unmatched_kernels"] == [] and one["vector_seconds"] > 0
    assert one["vector_aware_seconds"] >= one["optimal_seconds"]
    assert "  vector unit (not in libtpu's figure): " in result.stdout


@pytest.mark.aot
@pytest.mark.parametrize(
    "module, args",
    [
        ("bertjax.train", ["--config=configs/tiny.py", "--config.train.init_checkpoint={m}"]),
        ("bertjax.finetune", ["--config=configs/finetune/glue.py", "--config.init_checkpoint={m}"]),
    ],
)
def test_the_aot_extra_changes_nothing_an_entry_point_prints(module, args, tmp_path):
    """With libtpu and the CUDA plugin installed, an entry point on a host without
    accelerators prints what it prints with JAX_PLATFORMS=cpu: here its one error line (a
    missing checkpoint), not the plugins' start-up tracebacks before it."""
    pytest.importorskip("libtpu")
    if backend_env.present(backend_env.ACCELERATOR_FILES):
        pytest.skip("this host has an accelerator: its plugins start")
    names = {"m": tmp_path / "missing"}
    command = [
        sys.executable,
        "-m",
        module,
        f"--workdir={tmp_path}/w",
        *(a.format(**names) for a in args),
    ]
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = REPO_ROOT
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env, check=False
    )
    cpu = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**env, "JAX_PLATFORMS": "cpu"},
        check=False,
    )
    assert result.returncode == cpu.returncode == 1, result.stderr[-3000:]
    assert (result.stdout, result.stderr) == (cpu.stdout, cpu.stderr), result.stderr[-3000:]
    assert (
        result.stdout == ""
        and result.stderr.startswith("error: ")
        and result.stderr.count("\n") == 1
    ), result.stderr[-3000:]


# A TPU step in miniature: the compiler's estimated cycles on each instruction, a loop of
# micro-batches without a known trip count, and a conditional (a skipped update's cause).
TPU_HLO = (
    """HloModule jit_train_step, is_scheduled=true

"""
    + LOOP.replace(
        "BODY_ATTRS",
        ', metadata={op_name="jit(train_step)/jvp(BertForPreTraining)'
        '/bert/encoder/layer_3/mul"}, backend_config={"window_config":'
        '{"estimated_cycles":"300"}}',
    )
    + """
%cause (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %x = f32[1024]{0} fusion(%p), kind=kLoop, calls=%fused_add, backend_config={"window_config":{"estimated_cycles":"5000"}}
}

ENTRY %main (w: f32[1024], flag: pred[]) -> f32[1024] {
  %w = f32[1024]{0} parameter(0)
  %flag = pred[] parameter(1)
  %init = (s32[], f32[1024]{0}) tuple(%flag, %w)
  %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
  %g = f32[1024]{0} get-tuple-element(%loop), index=1
  %update = f32[1024]{0} fusion(%g), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/jit(_where)/select_n"}, backend_config={"window_config":{"estimated_cycles":"100"}}
  %why = f32[1024]{0} conditional(%flag, %w, %w), true_computation=%cause, false_computation=%cause
  ROOT %copy.1 = f32[1024]{0} copy(%update), backend_config={"window_config":{"estimated_cycles":"100"}}
}
"""
)


def test_tpu_estimate_counts_the_micro_batch_loop_as_often_as_it_runs():
    """libtpu's cost analysis counts a while body once; the estimate scales each
    instruction's cycles and bytes by how often it runs (here: a body of 300 cycles beside
    200 outside, 4 micro-batches: 1,400 cycles of the 500 counted)."""
    cost = {"optimal_seconds": 5e-6, "flops": 1e6, "bytes accessed": 24576.0}
    once = tpu_estimate.estimate(cost, TPU_HLO, 1, model_flops=1e6, peak_tflops=1e-6)
    assert once["optimal_seconds"] == 5e-6 and once["compiler_flops"] == 1e6
    assert once["estimated_mfu"] == pytest.approx(1e6 / 5e-6 / 1e6)
    four = tpu_estimate.estimate(cost, TPU_HLO, 4, model_flops=4e6, peak_tflops=1e-6, top=3)
    assert four["optimal_seconds"] == pytest.approx(5e-6 * 1400 / 500)
    assert four["compiler_flops"] == 4e6
    # Bytes: each of the 3 instructions reads and writes 8 KiB; the loop's 3 more times.
    assert four["bytes_accessed"] == pytest.approx(24576.0 * 6 / 3)
    # The census: per source op, layers folded, by estimated time (seconds per cycle from
    # the scaled total); the conditional's branch is not counted.
    assert [(g["op"], g["count"]) for g in four["census"]] == [
        ("fusion: jvp(BertForPreTraining)/bert/encoder/layer_N/mul", 4),
        ("fusion: jit(_where)/select_n", 1),
        ("copy: (compiler) copy", 1),
    ]
    assert four["census"][0]["seconds"] == pytest.approx(four["optimal_seconds"] * 1200 / 1400)
    assert four["census"][0]["bytes"] == 4 * 8192


def test_tpu_estimate_without_libtpus_step_time():
    """libtpu 0.0.42 gives a negative optimal_seconds for v4 and v5e steps: no time and no
    MFU then, rather than a negative one; bytes, FLOPs and the census's cycles remain."""
    cost = {"optimal_seconds": -4.9997, "flops": 1e6, "bytes accessed": 24576.0}
    result = tpu_estimate.estimate(cost, TPU_HLO, 1, model_flops=1e6, peak_tflops=1.0, top=1)
    assert result["optimal_seconds"] is None and result["estimated_mfu"] is None
    assert result["compiler_flops"] == 1e6 and result["census"][0]["cycles"] == 300
    line = phase_compile.summary_lines(
        "short",
        {
            "max_seq_length": 128,
            "global_batch_size": 8,
            "per_device_batch": 8,
            "grad_accum_steps": 1,
            "compile_seconds": 1,
            "verdict": {"text": "fits"},
            "tpu": result,
        },
    )[1]
    assert "no step time (libtpu's optimal_seconds: -5)" in line and "0.0 GB accessed" in line


@pytest.mark.aot
def test_the_python_api_is_as_quiet_as_the_command_line(hf_dir, tmp_path):
    """docs/modernbert.md's "In Python" on a host without accelerators, with libtpu and the
    CUDA plugin installed (the `aot` extra): nothing but what it prints itself (the plugins'
    start-up tracebacks came first; issue 42)."""
    pytest.importorskip("libtpu")
    if backend_env.present(backend_env.ACCELERATOR_FILES):
        pytest.skip("this host has an accelerator: its plugins start")
    script = (
        "import numpy as np\n"
        "from bertjax.models.modernbert import model as modernbert\n"
        "from bertjax.families import modernbert_hf\n"
        f"config, params = modernbert_hf.load_hf({hf_dir!r})\n"
        "input_ids = np.full((1, 8), 5, np.int32)\n"
        "logits = modernbert.ModernBertForMaskedLM(config).apply(\n"
        "    {'params': params}, input_ids, np.ones_like(input_ids))\n"
        "print(logits.shape)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": REPO_ROOT},
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stderr[-3000:]
    assert result.stdout.startswith("(1, 8, ")
