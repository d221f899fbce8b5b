"""Before compiling: where every parameter lives on the mesh and what a step costs per device.

`check_shardable` refuses a mesh that cannot split the model (an axis size that does not divide
the heads, the FFN, the vocabulary, ...) with a message naming the field to change.
`report` is the start-up table: each parameter's logical axes -> mesh axes and bytes per
device, then bytes per device of parameters, gradients, optimizer state and the activations
saved for the backward pass (an estimate from the layer's shapes, aware of the remat policy).
The estimate counts what autodiff keeps per layer; XLA's own figure (`python -m bertjax.aot`)
also holds temporaries, and fusion may drop some of what is counted here.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh

from bertjax import sharding
from bertjax.data.pipeline import Phase
from bertjax.model import BertConfig
from bertjax.state import TrainState


class MeshMismatch(ValueError):
    """The mesh cannot split the model as the logical-axis rules ask."""


def _path_name(path: tuple) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "name", key))) for key in path)


def _mesh_axes_of(spec_entry: Any) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return tuple(spec_entry) if isinstance(spec_entry, (tuple, list)) else (spec_entry,)


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded abstract (or real) arrays."""
    return sum(int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(tree))


def check_shardable(config: BertConfig, abstract_params: Any, mesh: Mesh) -> None:
    """Raises `MeshMismatch` when a mesh axis does not divide a dimension it shards, or when
    the tensor axis does not divide the attention heads (each device needs whole heads)."""
    tensor = mesh.shape[sharding.TENSOR]
    if config.num_attention_heads % tensor:
        raise MeshMismatch(
            f"mesh.tensor={tensor} does not divide model.num_attention_heads="
            f"{config.num_attention_heads}: each device must hold whole heads; choose a tensor "
            "size that divides the heads (and put the other devices on data or fsdp)")
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
        for dim, entry in zip(leaf.shape, leaf.sharding.spec):
            axes = _mesh_axes_of(entry)
            ways = int(np.prod([mesh.shape[a] for a in axes]))
            if dim % ways:
                raise MeshMismatch(
                    f"parameter {_path_name(path)} {tuple(leaf.shape)}: dimension {dim} is split "
                    f"over mesh axes {'x'.join(axes)} ({ways} ways) and is not divisible; change "
                    f"the mesh, or pad the model (e.g. --config.model.vocab_size="
                    f"{-(-dim // ways) * ways} for the vocabulary)")


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    """Bytes per device of activations live at the start of the backward pass."""

    per_layer: int  # saved by one encoder layer
    layers: int  # all layers, plus one layer's recomputation under remat
    outside_layers: int  # embeddings and the MLM/NSP heads
    total: int


def layer_activation_bytes(config: BertConfig, batch: int, length: int,
                           tensor: int) -> dict[str, int]:
    """What one encoder layer's backward needs, tensor by tensor, for `batch` sequences on one
    device (heads and FFN split `tensor` ways; hidden-size tensors replicated over it)."""
    c = np.dtype(config.dtype).itemsize
    tokens, hidden = batch * length, config.hidden_size
    heads, ffn = config.num_attention_heads // tensor, config.intermediate_size // tensor
    attn_dropout = 1 if config.attention_probs_dropout_prob > 0 else 0
    dropout = 1 if config.hidden_dropout_prob > 0 else 0
    return {
        "input": tokens * hidden * c,  # residual stream; input to query/key/value
        "qkv": 3 * tokens * hidden // tensor * c,
        "scores": batch * heads * length * length * 4,  # float32 scores / softmax output
        "probs": batch * heads * length * length * (attn_dropout + c),  # dropout mask, cast copy
        "context": tokens * hidden // tensor * c,
        "attention_out": tokens * hidden * c,  # output projection (a dot)
        "attention_norm": tokens * hidden * (dropout + 4 + c),  # mask, f32 LayerNorm input, output
        "ffn_in": tokens * ffn * c,  # intermediate projection (a dot), pre-activation
        "ffn_act": tokens * ffn * c,  # activation output
        "ffn_out": tokens * hidden * c,  # output projection (a dot)
        "output_norm": tokens * hidden * (dropout + 4),  # mask, f32 LayerNorm input
    }


# What each remat policy keeps of a layer (besides its input); `None` keeps everything.
REMAT_KEEPS: dict[str, tuple[str, ...] | None] = {
    "none": None,
    "full": (),
    "dots": ("qkv", "scores", "context", "attention_out", "ffn_in", "ffn_out"),
    "dots_no_batch": ("qkv", "attention_out", "ffn_in", "ffn_out"),
}


def activation_estimate(config: BertConfig, batch: int, length: int, predictions: int,
                        tensor: int) -> ActivationEstimate:
    """Activations per device for a step over `batch` sequences of `length` tokens with
    `predictions` masked positions each, under the config's remat policy."""
    parts = layer_activation_bytes(config, batch, length, tensor)
    full = sum(parts.values())
    keeps = REMAT_KEEPS[config.remat_policy]
    if keeps is None:
        per_layer, recompute = full, 0
    else:
        per_layer = parts["input"] + sum(parts[name] for name in keeps)
        recompute = full - per_layer  # one layer is rematerialised at a time
    c, tokens = np.dtype(config.dtype).itemsize, batch * length
    embeddings = tokens * config.hidden_size * (c + 4 + 1)
    # Gathered hidden states, transform + LayerNorm, and float32 logits + softmax over the
    # vocabulary (split over tensor).
    heads = batch * predictions * (3 * config.hidden_size * c
                                   + 2 * config.vocab_size // tensor * 4)
    layers = config.num_hidden_layers * per_layer + recompute
    return ActivationEstimate(per_layer, layers, embeddings + heads, layers + embeddings + heads)


def _logical_specs(model: nn.Module, example_inputs: Sequence[jax.Array]) -> Any:
    boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *example_inputs))["params"]
    return nn.get_partition_spec(boxed)


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _spec_text(spec: Any) -> str:
    return "(" + ", ".join("-" if e is None else "x".join(_mesh_axes_of(e)) for e in spec) + ")"


def parameter_rows(model: nn.Module, example_inputs: Sequence[jax.Array],
                   abstract_params: Any) -> list[tuple[str, str, str, str, int]]:
    """`(name, shape, logical axes, mesh axes, bytes per device)` per parameter; the layers of
    the unrolled encoder are folded into one `layer_*` row (with the count in the shape)."""
    logical = _logical_specs(model, example_inputs)
    rows: dict[str, list] = {}
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(abstract_params),
                                  jax.tree.leaves(logical, is_leaf=lambda x: isinstance(
                                      x, jax.sharding.PartitionSpec))):
        name = re.sub(r"layer_\d+", "layer_*", _path_name(path))
        if name in rows:
            rows[name][-1] += 1
            continue
        rows[name] = [name, "x".join(map(str, leaf.shape)), _spec_text(spec),
                      _spec_text(leaf.sharding.spec), per_device_bytes(leaf), 1]
    return [(name, shape + (f" (x{count})" if count > 1 else ""), axes, mesh_axes, size * count)
            for name, shape, axes, mesh_axes, size, count in rows.values()]


def report(model: nn.Module, example_inputs: Sequence[jax.Array], abstract_state: TrainState,
           mesh: Mesh, phases: Sequence[Phase]) -> str:
    """The start-up report; each phase's global batch is split over data x fsdp."""
    config: BertConfig = model.config
    rows = parameter_rows(model, example_inputs, abstract_state.params)
    width = max(len(r[0]) for r in rows)
    lines = [f"Mesh {dict(mesh.shape)} ({mesh.size} devices); parameters "
             "(logical axes -> mesh axes, bytes per device):"]
    lines += [f"  {name:<{width}}  {shape:<16} {axes:<22} -> {mesh_axes:<16} "
              f"{format_bytes(size):>11}" for name, shape, axes, mesh_axes, size in rows]
    params = per_device_bytes(abstract_state.params)
    opt = per_device_bytes(abstract_state.opt_state)
    count = sum(leaf.size for leaf in jax.tree.leaves(abstract_state.params))
    lines += ["Bytes per device:",
              f"  parameters       {format_bytes(params):>11}  ({count:,} x {config.param_dtype})",
              f"  gradients        {format_bytes(params):>11}",
              f"  optimizer state  {format_bytes(opt):>11}"]
    data_parallel, tensor = sharding.data_parallel_size(mesh), mesh.shape[sharding.TENSOR]
    for phase in phases:
        batch = phase.global_batch_size // data_parallel
        est = activation_estimate(config, batch, phase.max_seq_length,
                                  phase.max_predictions_per_seq, tensor)
        lines.append(
            f"  activations      {format_bytes(est.total):>11}  (estimate; phase {phase.name}: "
            f"{batch} of {phase.global_batch_size} sequences x {phase.max_seq_length} tokens per "
            f"device, {config.dtype}, remat {config.remat_policy}: "
            f"{format_bytes(est.per_layer)} per layer)")
        lines.append(f"  total            {format_bytes(2 * params + opt + est.total):>11}  "
                     f"(phase {phase.name}, before XLA temporaries)")
    return "\n".join(lines)
