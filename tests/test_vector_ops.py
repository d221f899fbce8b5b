"""The vector unit's work that libtpu's estimate does not charge (`tools.vector_ops`): the
elementwise operations of Pallas kernels' jaxprs and of XLA's fusions, and the vector-aware
bound in `tools.tpu_estimate`'s record."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl

from bertjax.models import flash_dropout
from bertjax.tools import phase_compile, tpu_estimate, vector_ops

ROWS, LANES, GRID = 8, 128, 4


def _hash_kernel(rounds: int):
    """A kernel of `rounds` integer multiply / xor-shift rounds (3 ops each) per element."""

    def kernel(x_ref, o_ref):
        x = x_ref[...]
        for _ in range(rounds):
            x = x * jnp.int32(0x2C1B3C6D)
            x = x ^ lax.shift_right_logical(x, jnp.full(x.shape, 12, jnp.int32))
        o_ref[...] = x

    return kernel


def _hash_call(rounds: int):
    return pl.pallas_call(
        _hash_kernel(rounds),
        grid=(GRID,),
        in_specs=[pl.BlockSpec((ROWS, LANES), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((ROWS, LANES), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((GRID * ROWS, LANES), jnp.int32),
    )


def _jaxpr(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr


@pytest.mark.parametrize("rounds", [1, 5, 50])
def test_a_kernel_of_integer_ops_counts_each_per_element_and_grid_step(rounds):
    """A chain of 3 * rounds integer multiply, shift and xor ops over a block of 8 x 128,
    run on 4 grid steps: 3 * rounds * 4,096 (libtpu charges none of them)."""
    x = jnp.zeros((GRID * ROWS, LANES), jnp.int32)
    kernels = vector_ops.pallas_kernels(vector_ops.pallas_equations(_jaxpr(_hash_call(rounds), x)))
    key = vector_ops.kernel_key((GRID * ROWS, LANES), None, None, None)
    assert kernels == {key: 3.0 * rounds * GRID * ROWS * LANES}


def test_each_kind_of_elementwise_op_counts_and_data_movement_does_not():
    """Float arithmetic, a transcendental, a compare and a select count once per element, a
    reduction once per input element, a scan's body per trip; matmuls, transposes,
    broadcasts, reshapes and scalar ops do not count."""

    def step(x, s):
        y = jnp.exp(x * 2.0 - 1.0)  # 3
        y = jnp.where(y > 0.5, y, 0.0)  # 2
        total = jnp.sum(y.T @ y)  # a matmul (MXU) and its 8 x 8 sum: 64
        z = jnp.broadcast_to(s * 3, (4, 8, 8)).reshape(32, 8)  # a scalar op and moves: 0
        w, _ = lax.scan(lambda c, _: (c + 1.0, None), x, length=10)  # 10 adds of 64
        return total, z, w

    ops = vector_ops.jaxpr_vector_ops(_jaxpr(step, jnp.ones((8, 8), jnp.float32), jnp.int32(1)))
    assert ops == 5 * 64 + 64 + 10 * 64


def test_flash_dropouts_kernels_are_found_forward_and_backward_with_their_hash():
    """The step's two kernels, by their shapes and declared costs as the compiled custom
    calls have them; each does more vector work per score than its hash's integer ops alone
    (at least 8 per score)."""
    batch, heads, length, width = 2, 2, 128, 128
    qkv = jnp.zeros((3, batch, length, width), jnp.bfloat16)
    ids = jnp.ones((batch, length), jnp.int32)
    seeds = jnp.zeros((batch, heads), jnp.int32)

    def loss(qkv):
        out = flash_dropout.flash_dropout(qkv, ids, seeds, 0.1, True)
        return out.astype(jnp.float32).sum()

    kernels = vector_ops.pallas_kernels(vector_ops.pallas_equations(_jaxpr(jax.grad(loss), qkv)))
    scores = batch * heads * length * length
    costs = {
        backward: flash_dropout.cost(batch, heads, length, width // heads, 2, backward)
        for backward in (False, True)
    }
    assert set(kernels) == {
        vector_ops.kernel_key(
            shape,
            costs[backward].flops,
            costs[backward].transcendentals,
            costs[backward].bytes_accessed,
        )
        for shape, backward in (((batch, length, width), False), ((3, batch, length, width), True))
    }
    assert all(ops > 8 * scores for ops in kernels.values())


# A TPU step in miniature: a loop of 3 micro-batches with a fusion of 4 elementwise ops (two
# of them integer) on s32[8,128] and a reduction; outside it a Pallas kernel's custom call
# and a copy (no vector work). libtpu writes no cycles into a Pallas kernel's custom call.
HLO = """HloModule jit_train_step, is_scheduled=true

%fused_hash (p0: s32[8,128]) -> s32[8,128] {
  %p0 = s32[8,128]{1,0} parameter(0)
  %c = s32[8,128]{1,0} constant({...})
  %m = s32[8,128]{1,0} multiply(%p0, %c)
  %s = s32[8,128]{1,0} shift-right-logical(%m, %c)
  %x = s32[8,128]{1,0} xor(%m, %s)
  ROOT %a = s32[8,128]{1,0} add(%x, %c)
}

%add_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_sum (q0: f32[8,128]) -> f32[8] {
  %q0 = f32[8,128]{1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(%q0, %zero), dimensions={1}, to_apply=%add_f32
}

%body (t: (s32[], s32[8,128])) -> (s32[], s32[8,128]) {
  %t = (s32[], s32[8,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = s32[8,128]{1,0} get-tuple-element(%t), index=1
  %h = s32[8,128]{1,0} fusion(%v), kind=kLoop, calls=%fused_hash, backend_config={"window_config":{"estimated_cycles":"100"}}
  %f = f32[8,128]{1,0} bitcast(%h)
  %r = f32[8]{0} fusion(%f), kind=kInput, calls=%fused_sum, backend_config={"window_config":{"estimated_cycles":"100"}}
  ROOT %out = (s32[], s32[8,128]{1,0}) tuple(%i, %h)
}

%cond (c: (s32[], s32[8,128])) -> pred[] {
  %c = (s32[], s32[8,128]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (w: s32[8,128], q: bf16[3,2,128,128]) -> bf16[2,128,128] {
  %w = s32[8,128]{1,0} parameter(0)
  %q = bf16[3,2,128,128]{3,2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], s32[8,128]{1,0}) tuple(%zero, %w)
  %loop = (s32[], s32[8,128]{1,0}) while(%init), condition=%cond, body=%body
  %k = bf16[2,128,128]{2,1,0} custom-call(%q), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"TUzvUgFN","cost_estimate":{"flops":"8388608","transcendentals":"65536","bytes_accessed":"262144"}}}
  ROOT %copy = bf16[2,128,128]{2,1,0} copy(%k), backend_config={"window_config":{"estimated_cycles":"200"}}
}
"""
KERNEL_OPS = 2e6  # the kernel's elementwise operations per call, as its jaxpr would give
KERNEL = vector_ops.kernel_key((2, 128, 128), 8388608, 65536, 262144)


def test_hlo_fusions_count_integer_ops_reductions_and_the_kernel_per_run():
    """Per micro-batch 4 ops x 1,024 in the integer fusion and 1,024 in the reduction, 3
    times; the Pallas kernel's count from its jaxpr, matched by shape and declared cost,
    once."""
    kernels = {KERNEL: KERNEL_OPS}
    ops = tpu_estimate.operations(HLO, loop_trips=3, kernels=kernels)
    by_name = {op.name: op.vector_ops for op in ops}
    assert by_name == {"h": 3 * 4 * 1024, "r": 3 * 1024, "k": KERNEL_OPS, "copy": 0}


def test_an_unmatched_kernel_is_named_not_silently_counted_as_free():
    unmatched: set[str] = set()
    other = vector_ops.kernel_key((2, 128, 128), 8388608, 65536, 1)
    ops = tpu_estimate.operations(HLO, 3, {other: 1.0}, unmatched)
    assert unmatched == {KERNEL}
    assert sum(op.vector_ops for op in ops if op.opcode == "custom-call") == 0


def test_the_record_has_the_vector_unit_beside_libtpus_estimate():
    """libtpu's 1.4 us for the step with the loop's body once: the kernel's 1 us (compiled
    alone) and 0.4 us for the 400 cycles of the rest (the loop's 200, the copy's 200), so
    1 ns a cycle; with the loop's 3 runs 0.8 + 1 = 1.8 us. Each instruction takes
    max(libtpu's time, its vector time): here the vector unit bounds the kernel (2e6 ops at
    1e12/s: 2 us against libtpu's 1 us), not the rest."""
    unit = vector_ops.VectorUnit(alus=1, cores=1, clock_hz=1e12 / 1024)
    assert unit.ops_per_second == pytest.approx(1e12)
    cost = {"optimal_seconds": 1.4e-6, "flops": 1e6, "bytes accessed": 1e4}
    kernels = {KERNEL: KERNEL_OPS}
    record = tpu_estimate.estimate(
        cost, HLO, 3, 2e6, 1.0, top=4, kernels=kernels, unit=unit, kernel_seconds={KERNEL: 1e-6}
    )
    assert record["optimal_seconds"] == pytest.approx(1.8e-6)
    assert record["kernel_seconds"] == pytest.approx(1e-6)
    vector = 3 * 5 * 1024 + KERNEL_OPS
    assert record["vector_ops"] == vector and record["vector_kernel_ops"] == KERNEL_OPS
    assert record["vector_seconds"] == pytest.approx(vector / 1e12)
    # 600 cycles in the loop (vector time 15 ns of 300 ns) and the copy (200 ns) as libtpu
    # has them; the kernel's 2 us instead of 1 us.
    assert record["vector_aware_seconds"] == pytest.approx(0.6e-6 + 0.2e-6 + 2e-6)
    assert record["vector_aware_mfu"] == pytest.approx(2e6 / 2.8e-6 / 1e12)
    assert record["vector_unmatched_kernels"] == []
    census = {g["op"].split(":")[0]: g for g in record["census"]}
    assert census["custom-call"]["vector_seconds"] == pytest.approx(2e-6)
    assert census["custom-call"]["seconds"] == pytest.approx(1e-6)
    assert census["copy"]["seconds"] == pytest.approx(0.2e-6)
    lines = phase_compile.summary_lines(
        "short",
        {
            "max_seq_length": 128,
            "global_batch_size": 8,
            "per_device_batch": 8,
            "grad_accum_steps": 3,
            "compile_seconds": 1,
            "verdict": {"text": "fits"},
            "tpu": record,
        },
    )
    assert "(Pallas kernels 0.0 ms, each compiled alone)" in lines[1]
    assert lines[2].startswith("  vector unit (not in libtpu's figure): 0 G elementwise ops")
    assert "vector-aware bound 0.0 ms per step, MFU at most 71.4%" in lines[2]


def test_without_libtpus_step_time_the_vector_time_remains_and_no_bound():
    cost = {"optimal_seconds": -5.0, "flops": 1e6, "bytes accessed": 1e4}
    unit = vector_ops.vector_unit("v5e:2x4")
    assert unit is not None
    record = tpu_estimate.estimate(cost, HLO, 3, 2e6, 197.0, unit=unit)
    assert record["vector_seconds"] > 0
    assert record["vector_aware_seconds"] is None and record["vector_aware_mfu"] is None


def test_the_vector_units_rates_per_generation():
    """8 x 128 lanes x ALUs x cores x clock: v5p 14.3 T/s (How to Scale Your Model's
    figure, 1.4e13), v4 4.3, v5e 6.1, v6e 7.2; GPUs and unknown names have none."""
    rates = {
        t: vector_ops.vector_unit(t).ops_per_second  # type: ignore[union-attr]
        for t in ("v4:2x2x1", "v5:2x2x1", "v5e:2x4", "v6e:2x4")
    }
    assert rates == pytest.approx(
        {"v4:2x2x1": 4.30e12, "v5:2x2x1": 1.434e13, "v5e:2x4": 6.14e12, "v6e:2x4": 7.17e12},
        rel=1e-3,
    )
    assert vector_ops.vector_unit("h100") is None
