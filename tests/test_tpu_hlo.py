"""What libtpu's cost analysis counts once (`tools.tpu_hlo`): the trip counts of the loops a
sharded step's windowed einsums become, and the FLOPs of TPU convolutions; and the compiler's
FLOPs of `tools.tpu_estimate` scaled by them (the 85% of the 8-chip slices)."""

import pytest

from bertjax.tools import hlo_census, tpu_estimate, tpu_hlo

# A windowed einsum in miniature, as libtpu writes it for a weight gradient sharded over 8
# devices: a counter from 0 (through a copy) below 4 in steps of 2, so 2 trips, each a
# matmul chunk of 2 * 8 * 128 * 128 FLOPs (a convolution); beside it the same matmul
# unsplit. libtpu counts the body once.
WINDOWED = """HloModule jit_train_step, is_scheduled=true

%fused_chunk (a: bf16[8,128], b: bf16[128,128]) -> bf16[8,128] {
  %a = bf16[8,128]{1,0} parameter(0)
  %b = bf16[128,128]{1,0} parameter(1)
  ROOT %c = bf16[8,128]{1,0} convolution(%a, %b), window={size=1}, dim_labels=bf_io->bf, metadata={op_name="jit(train_step)/transpose(jvp(BertForPreTraining))/bert/encoder/layer_0/output/dense/dot_general"}
}

%wide.windowed_dot_general_body_rs (p: (u32[], bf16[8,128], bf16[128,128])) -> (u32[], bf16[8,128], bf16[128,128]) {
  %p = (u32[], bf16[8,128]{1,0}, bf16[128,128]{1,0}) parameter(0)
  %two = u32[] constant(2)
  %i = u32[] get-tuple-element(%p), index=0
  %x = bf16[8,128]{1,0} get-tuple-element(%p), index=1
  %w = bf16[128,128]{1,0} get-tuple-element(%p), index=2
  %y = bf16[8,128]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_chunk, backend_config={"window_config":{"estimated_cycles":"100"}}
  %next = u32[] add(%i, %two)
  ROOT %t = (u32[], bf16[8,128]{1,0}, bf16[128,128]{1,0}) tuple(%next, %y, %w)
}

%wide.windowed_dot_general_cond_rs (q: (u32[], bf16[8,128], bf16[128,128])) -> pred[] {
  %q = (u32[], bf16[8,128]{1,0}, bf16[128,128]{1,0}) parameter(0)
  %four = u32[] constant(4)
  %j = u32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%j, %four), direction=LT
}

ENTRY %main (x0: bf16[8,128], w0: bf16[128,128]) -> bf16[8,128] {
  %x0 = bf16[8,128]{1,0} parameter(0)
  %w0 = bf16[128,128]{1,0} parameter(1)
  %zero = u32[] constant(0)
  %start = u32[] copy(%zero)
  %init = (u32[], bf16[8,128]{1,0}, bf16[128,128]{1,0}) tuple(%start, %x0, %w0)
  %loop = (u32[], bf16[8,128]{1,0}, bf16[128,128]{1,0}) while(%init), condition=%wide.windowed_dot_general_cond_rs, body=%wide.windowed_dot_general_body_rs
  %out = bf16[8,128]{1,0} get-tuple-element(%loop), index=1
  ROOT %whole = bf16[8,128]{1,0} fusion(%out, %w0), kind=kOutput, calls=%fused_chunk, backend_config={"window_config":{"estimated_cycles":"100"}}
}
"""
CHUNK = 2.0 * 8 * 128 * 128


def _loop():
    computations, entry = hlo_census.parse_module(WINDOWED)
    instructions = {i.name: i for i in computations[entry]}
    return instructions["loop"], computations, instructions


def test_a_windowed_einsums_trip_count_is_read_from_its_counter():
    loop, computations, instructions = _loop()
    constants = tpu_hlo.integer_constants(WINDOWED)
    assert constants == {"two": 2, "four": 4, "zero": 0}
    assert tpu_hlo.trip_count(loop, computations, instructions, constants) == 2
    # A loop of another form (here: no constant start) has no trip count read from it.
    assert tpu_hlo.trip_count(loop, computations, instructions, {"two": 2, "four": 4}) is None
    loop.attrs += ', backend_config={"known_trip_count":{"n":"7"}}'
    assert tpu_hlo.trip_count(loop, computations, instructions, {}) == 7


def test_the_compilers_flops_count_a_windowed_einsums_body_as_often_as_it_runs():
    """libtpu's cost analysis counts the body once: 2 chunks' FLOPs where 3 run. The
    estimate scales its FLOPs and time by the instructions as often as they run (without
    this, a sharded BERT-large step on tpu-v5e-8 counted 85% of the model's FLOPs)."""
    cost = {"optimal_seconds": 2e-7, "flops": 2 * CHUNK, "bytes accessed": 1.0}
    record = tpu_estimate.estimate(cost, WINDOWED, 1, model_flops=3 * CHUNK, peak_tflops=1.0)
    assert record["compiler_flops"] == pytest.approx(3 * CHUNK)
    assert record["optimal_seconds"] == pytest.approx(3e-7) and record["cycles"] == 300


@pytest.mark.parametrize(
    "lhs, rhs, out, attrs, flops",
    [
        # A plain matmul [8, 128] x [128, 256]: 2 FLOPs per output and contracted feature.
        (
            "bf16[8,128]",
            "bf16[128,256]",
            "bf16[8,256]",
            "window={size=1}, dim_labels=bf_io->bf",
            2 * 8 * 256 * 128,
        ),
        # A batch of 32 written as a window of 32 over padding (libtpu's batched matmul):
        # each of the 32 outputs meets one input position, the rest is padding.
        (
            "bf16[1024,1,128]",
            "bf16[32,128,64]",
            "bf16[1024,32,64]",
            "window={size=32 pad=31_31 rhs_reversal=1}, dim_labels=b0f_0io->b0f",
            2 * 1024 * 64 * 128 * 32,
        ),
    ],
)
def test_convolution_flops_count_only_window_positions_on_the_input(lhs, rhs, out, attrs, flops):
    ins = hlo_census.Instruction("c", out, "convolution", ["l", "r"], attrs)
    assert tpu_hlo.convolution_flops(ins, {"l": lhs, "r": rhs}) == flops


def test_the_census_gives_each_groups_matmul_flops_and_their_share_of_the_peak():
    """The census's matmul share: a group's matmul FLOPs (as often as they run) over its
    estimated time at the chip's peak, so that a matmul libtpu runs poorly shows as such
    (BERT-large on tpu-v5p-8: the dense layers whose outputs meet LayerNorm at 51-74%)."""
    cost = {"optimal_seconds": 2e-7, "flops": 2 * CHUNK, "bytes accessed": 1.0}
    peak_tflops = 3 * CHUNK / 3e-7 / 1e12 / 0.5  # the three chunks in 0.3 us: half the peak
    record = tpu_estimate.estimate(
        cost, WINDOWED, 1, model_flops=3 * CHUNK, peak_tflops=peak_tflops, top=5
    )
    body, whole, *others = record["census"]  # the loop's chunks, twice; the unsplit one
    assert (body["count"], body["matmul_flops"]) == (2, pytest.approx(2 * CHUNK))
    assert whole["matmul_flops"] == pytest.approx(CHUNK)
    assert body["matmul_share_of_peak"] == whole["matmul_share_of_peak"] == pytest.approx(0.5)
    assert all(not g["matmul_flops"] and "matmul_share_of_peak" not in g for g in others)
    without_peak = tpu_estimate.census(tpu_estimate.operations(WINDOWED), 1e-9, 5)
    assert "matmul_share_of_peak" not in without_peak[0]
