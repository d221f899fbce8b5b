"""The GPU census (`tools.gpu_census`): kernels grouped by pass, module and what they fuse;
Pallas kernels costed by their declared `pl.CostEstimate`. The real cross-compile of a
Pallas Triton kernel for an H100 is marked `aot` (it needs the CUDA plugin)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from bertjax.tools import gpu_census, hlo_census

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FWD = "jit(train_step)/jvp(BertForPreTraining)/bert/encoder/layer_{}"
BWD = "jit(train_step)/transpose(jvp(BertForPreTraining))/bert/encoder/layer_{}"

# The dropout mask's hash in a loop of 2 trips (one per layer), a LayerNorm fusion of each
# pass, the update's Adam fusion, and a Pallas Triton kernel.
HLO = """HloModule jit_train_step, is_scheduled=true

%fused_hash (p0: u32[4096]) -> u32[4096] {
  %p0 = u32[4096]{0} parameter(0)
  %x = u32[4096]{0} xor(%p0, %p0)
  %l = u32[4096]{0} shift-left(%x, %p0)
  ROOT %r = u32[4096]{0} shift-right-logical(%l, %p0)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_norm (p0: f32[64,1024]) -> f32[64,1024] {
  %p0 = f32[64,1024]{1,0} parameter(0)
  %z = f32[] constant(0)
  %sum = f32[64]{0} reduce(%p0, %z), dimensions={1}, to_apply=%add
  %inv = f32[64]{0} rsqrt(%sum)
  %b = f32[64,1024]{1,0} broadcast(%inv), dimensions={0}
  ROOT %m = f32[64,1024]{1,0} multiply(%p0, %b)
}

%fused_adam (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %s = f32[1024]{0} sqrt(%p0)
}

%body (arg: (s32[], u32[4096])) -> (s32[], u32[4096]) {
  %arg = (s32[], u32[4096]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %v = u32[4096]{0} get-tuple-element(%arg), index=1
  %h = u32[4096]{0} fusion(%v), kind=kLoop, calls=%fused_hash, metadata={op_name="FWD_N/output/Dropout_0/threefry2x32"}
  ROOT %t = (s32[], u32[4096]{0}) tuple(%i, %h)
}

%cond (arg: (s32[], u32[4096])) -> pred[] {
  %arg = (s32[], u32[4096]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[64,1024], w: f32[1024], k: u32[4096], i: s32[]) -> f32[1024] {
  %x = f32[64,1024]{1,0} parameter(0)
  %w = f32[1024]{0} parameter(1)
  %k = u32[4096]{0} parameter(2)
  %i = s32[] parameter(3)
  %init = (s32[], u32[4096]{0}) tuple(%i, %k)
  %loop = (s32[], u32[4096]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"2"}}
  %fwd = f32[64,1024]{1,0} fusion(%x), kind=kInput, calls=%fused_norm, metadata={op_name="FWD_0/output/LayerNorm/mul"}
  %bwd = f32[64,1024]{1,0} fusion(%fwd), kind=kInput, calls=%fused_norm, metadata={op_name="BWD_0/output/LayerNorm/mul"}
  %flash = f32[64,1024]{1,0} custom-call(%bwd), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI, metadata={op_name="FWD_0/attention/self/flash_probe/pallas_call"}, backend_config={grid_x = 1 : i32}
  ROOT %adam = f32[1024]{0} fusion(%w), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(train_step)/select_n"}
}
""".replace("FWD_", FWD.format("")).replace("BWD_", BWD.format(""))


def _census(**kwargs) -> hlo_census.Census:
    return hlo_census.census(HLO, 1.0, 1e9, describe=gpu_census.describe, **kwargs)


def test_kernels_grouped_by_pass_module_and_what_they_fuse():
    census = _census()
    groups = {label: figures[0] for label, figures in census.groups.items()}
    assert groups == {
        "dropout | fwd layer_N/output/Dropout_N [dropout mask hash] u32[4096]": 2,  # 2 trips
        "layernorm (+ bias, dropout, residual) | fwd layer_N/output/LayerNorm "
        "[layernorm+reduce] f32[64x1024]": 1,
        "layernorm (+ bias, dropout, residual) | bwd layer_N/output/LayerNorm "
        "[layernorm+reduce] f32[64x1024]": 1,
        "pallas | fwd layer_N/attention/self [flash_probe] f32[64x1024]": 1,
        "optimizer | update select_n [optimizer] f32[1024]": 1,
    }
    # the groups partition the census: every launch, second and byte in exactly one
    assert sum(f[0] for f in census.groups.values()) == census.kernel_count
    assert sum(f[1] for f in census.groups.values()) == pytest.approx(census.seconds)
    assert sum(f[2] for f in census.groups.values()) == pytest.approx(census.bytes)
    summary = gpu_census.summarize(census, top=2)
    assert [row["group"] for row in summary["families"]][:1] == [
        "layernorm (+ bias, dropout, residual)"
    ]
    assert summary["families"][0]["count"] == 2 and len(summary["groups"]) == 2
    assert summary["groups"][0]["seconds"] >= summary["groups"][1]["seconds"]


def _kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])


def _flash_probe(x):
    """A Pallas kernel named as the HLO's custom call, with a declared cost."""
    return pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        cost_estimate=pl.CostEstimate(
            flops=5_000_000_000, transcendentals=0, bytes_accessed=3_000_000
        ),
        name="flash_probe",
        interpret=True,
    )(x)


def test_pallas_kernel_costs_what_its_cost_estimate_declares():
    step = jax.jit(lambda x: jax.checkpoint(_flash_probe)(x) * 2)  # nested jaxprs
    jaxpr = step.trace(jax.ShapeDtypeStruct((64, 1024), jnp.float32)).jaxpr.jaxpr
    costs = gpu_census.pallas_costs(jaxpr)
    assert costs == {("flash_probe", ((64, 1024),)): (5e9, 3e6)}
    declared, undeclared = _census(pallas_costs=costs), _census()
    label = "pallas | fwd layer_N/attention/self [flash_probe] f32[64x1024]"
    assert declared.groups[label][2:] == [3e6, 5e9]  # bytes, FLOPs as declared
    assert declared.groups[label][1] == pytest.approx(5e9 / 1e12)  # FLOP-bound at 1 TFLOP/s
    operands_and_result = 2 * 64 * 1024 * 4
    assert undeclared.groups[label][2:] == [operands_and_result, 0.0]
    assert declared.flops == undeclared.flops + 5e9
    assert declared.non_matmul_bytes == undeclared.non_matmul_bytes - operands_and_result


def test_census_table_prints_families_and_groups(tmp_path):
    census = _census()
    record = {
        "phases": {"short": {"gpu": {**census.as_dict(), **gpu_census.summarize(census, top=10)}}}
    }
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    script = os.path.join(REPO_ROOT, "benchmarks", "aot", "gpu_census.py")
    out = subprocess.run(
        [sys.executable, script, str(path), "short"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith(f"roofline {census.seconds * 1e3:.1f} ms, 6 kernels")
    assert "| optimizer | " in out and "`fwd layer_N/output/Dropout_N [dropout mask hash]" in out


@pytest.mark.aot
def test_a_pallas_triton_kernel_compiled_for_an_h100_counts_its_declared_cost():
    """The real CUDA compiler's custom call is found by name and shape."""
    from jax.experimental.pallas import triton as plgpu
    from jax.sharding import SingleDeviceSharding

    from bertjax.runtime import targets

    target = targets.parse("h100")
    device = targets.devices(target)[0]
    sharding = SingleDeviceSharding(device)

    def step(x):
        y = pl.pallas_call(
            _kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            cost_estimate=pl.CostEstimate(
                flops=5_000_000_000, transcendentals=0, bytes_accessed=3_000_000
            ),
            name="flash_probe",
            compiler_params=plgpu.CompilerParams(num_warps=4),
        )(x)
        return y + 1

    with targets.cudnn_for(target, device):
        traced = jax.jit(step, in_shardings=sharding, out_shardings=sharding).trace(
            jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=sharding)
        )
        text = traced.lower().compile().as_text()
    census = hlo_census.census(
        text,
        target.peak_tflops,
        target.hbm_bytes_per_second,
        gpu_census.pallas_costs(traced.jaxpr.jaxpr),
        gpu_census.describe,
    )
    assert census.kernels["pallas"] == 1 and census.flops == 5e9


# A finite step's update, and the cause a skipped step computes in the other branch.
SKIPPED_HLO = """HloModule jit_train_step

%fused_check (p0: f32[1024]) -> pred[] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %c = pred[] constant(true)
}

%finite (arg: (f32[1024])) -> f32[] {
  %arg = (f32[1024]{0}) parameter(0)
  ROOT %zero = f32[] constant(0)
}

%skipped (arg: (f32[1024])) -> f32[] {
  %arg = (f32[1024]{0}) parameter(0)
  %w = f32[1024]{0} get-tuple-element(%arg), index=0
  %check = pred[] fusion(%w), kind=kLoop, calls=%fused_check, metadata={op_name="jit(train_step)/cond/branch_1_fun/skipped_step/reduce_sum"}
  ROOT %cause = f32[] convert(%check), metadata={op_name="jit(train_step)/cond/branch_1_fun/skipped_step/select_n"}
}

ENTRY %main (w: f32[1024], p: pred[]) -> f32[] {
  %w = f32[1024]{0} parameter(0)
  %p = pred[] parameter(1)
  %adam = f32[1024]{0} sqrt(%w), metadata={op_name="jit(train_step)/sqrt"}
  %i = s32[] convert(%p)
  %t = (f32[1024]{0}) tuple(%adam)
  ROOT %r = f32[] conditional(%i, %t, %t), branch_computations={%finite, %skipped}
}
"""


def test_a_skipped_steps_kernels_stay_out_of_the_roofline():
    """Bytes at 1 GB/s: the update reads and writes 4 KiB, the branch index's convert 1 + 4
    bytes; the skipped branch's two kernels 4 KiB + 1 and 1 + 4 bytes."""
    counted = hlo_census.census(SKIPPED_HLO, 1.0, 1e9)
    apart = hlo_census.census(SKIPPED_HLO, 1.0, 1e9, skipped_step_scope="skipped_step")
    update, cause = (8192 + 5) / 1e9, (4096 + 1 + 1 + 4) / 1e9
    assert counted.seconds == pytest.approx(update + cause) and counted.kernel_count == 4
    assert apart.seconds == pytest.approx(update) and apart.kernel_count == 2
    assert apart.skipped_step_seconds == pytest.approx(cause)
    assert apart.as_dict()["skipped_step_seconds"] == pytest.approx(cause)


def test_the_train_steps_non_finite_cause_is_named_as_a_skipped_steps():
    """The real step, compiled: what only a skipped step computes (the finiteness of the
    batch and the whole state) carries `steps.SKIPPED_STEP_SCOPE`, so the census can leave
    it out; removing the scope from `steps._apply_update` fails this."""
    import optax

    from bertjax.training import steps
    from bertjax.training.state import TrainState

    def loss_fn(params, batch, rng):
        loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
        return loss, {"loss": loss}

    tx = optax.adam(1e-3)
    params = {"w": jnp.ones((256, 256))}
    state = TrainState(
        step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(0)
    )
    step = jax.jit(steps.make_loss_train_step(loss_fn, tx))
    text = step.lower(state, {"x": jnp.ones((8, 256))}).compile().as_text()
    apart = hlo_census.census(text, 1.0, 1e9, skipped_step_scope=steps.SKIPPED_STEP_SCOPE)
    counted = hlo_census.census(text, 1.0, 1e9)
    # the state's finiteness check reads every parameter and both Adam moments
    assert apart.skipped_step_seconds >= 3 * 256 * 256 * 4 / 1e9
    assert apart.seconds < counted.seconds
