"""`python -m bertjax.extract_features --input_file=IN --output_file=OUT.jsonl
--init_checkpoint=PRETRAIN_WORKDIR`: per-token vectors of chosen layers, as JSON lines in the
format of the original extract_features.py:

    {"linex_index": 0, "features": [{"token": "[CLS]",
        "layers": [{"index": -1, "values": [0.1, ...]}, ...]}, ...]}

Input: one text per line; `text_a ||| text_b` for a pair. Layer -1 is the last encoder layer
(of a ModernBERT model: after its final norm, the output its heads read).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from bertjax import cli
from bertjax.data import tokenization
from bertjax.errors import ConfigError, UserError
from bertjax.interop import pretrained, pretrained_weights
from bertjax.models import families
from bertjax.runtime import files
from bertjax.tasks import features


def _read_lines(path: str) -> list[tuple[str, str | None]]:
    pairs = []
    with files.open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if line:
                a, _, b = line.partition(" ||| ")
                pairs.append((a, b or None))
    return pairs


def extract(
    model: nn.Module,
    params: dict,
    tokenizer: tokenization.Tokenizer,
    texts: Sequence[tuple[str, str | None]],
    layers: Sequence[int],
    max_seq_length: int,
    batch_size: int,
) -> Iterator[dict]:
    """One original-format record per text: every real token's vectors at `layers`."""
    specials = features.special_ids(tokenizer)
    encoded = [
        features.encode_pair(
            tokenizer.encode(a),
            None if b is None else tokenizer.encode(b),
            max_seq_length,
            specials,
        )
        for a, b in texts
    ]

    @jax.jit
    def all_layers(
        input_ids: jax.Array, input_mask: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        stacked = families.of(model).all_layers(model, params, input_ids, segment_ids, input_mask)
        return stacked[jnp.array(layers)]

    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        padded = chunk + [chunk[0]] * (batch_size - len(chunk))  # fixed shapes: one compile
        input_ids, input_mask, segment_ids = (np.stack(c) for c in zip(*padded))
        vectors = np.asarray(jax.device_get(all_layers(input_ids, input_mask, segment_ids)))
        for row in range(len(chunk)):
            length = int(input_mask[row].sum())
            tokens = tokenizer.convert_ids_to_tokens(input_ids[row, :length].tolist())
            yield {
                "linex_index": start + row,
                "features": [
                    {
                        "token": token,
                        "layers": [
                            {
                                "index": layer,
                                "values": [round(float(v), 6) for v in vectors[j, row, i]],
                            }
                            for j, layer in enumerate(layers)
                        ],
                    }
                    for i, token in enumerate(tokens)
                ],
            }


def default_layers(num_layers: int) -> list[int]:
    """The original's -1,-2,-3,-4, or every layer of a model with fewer than 4."""
    return [-i for i in range(1, min(4, num_layers) + 1)]


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("input_file", None, "one text per line; 'a ||| b' for pairs")
    flags.DEFINE_string("output_file", None, "JSON lines output")
    flags.DEFINE_string("init_checkpoint", None, "bertjax pretraining workdir or checkpoints dir")
    flags.DEFINE_string("vocab_file", "", "overrides the pretraining run's tokenizer")
    flags.DEFINE_bool("do_lower_case", True, "for vocab_file (WordPiece)")
    flags.DEFINE_string(
        "layers",
        "",
        "encoder layers to output, e.g. -1,-2 (-1 is the last); "
        "default: the last 4, or all of a model with fewer",
    )
    flags.DEFINE_integer("max_seq_length", 128, "tokens per sequence (longer texts are truncated)")
    flags.DEFINE_integer("batch_size", 8, "texts per forward pass")
    flags.mark_flags_as_required(["input_file", "output_file", "init_checkpoint"])


def main(argv: list[str]) -> None:
    del argv
    source = pretrained.Source.frozen(FLAGS.init_checkpoint, FLAGS.vocab_file, FLAGS.do_lower_case)
    try:
        chosen = cli.integers("layers", FLAGS.layers)  # (before the model loads)
        if FLAGS.batch_size < 1:
            raise ConfigError(
                f"--batch_size={FLAGS.batch_size} is out of range: it must be "
                ">= 1; set --batch_size"
            )
        model, params, tokenizer = pretrained_weights.load_encoder(source)
        cli.check_max_seq_length(FLAGS.max_seq_length, model.config.max_position_embeddings)
        num_layers = model.config.num_hidden_layers
        layers = chosen or default_layers(num_layers)
        if any(not -num_layers <= layer < num_layers for layer in layers):
            raise ConfigError(
                f"--layers={FLAGS.layers}: the model has {num_layers} layers "
                f"(-{num_layers} to {num_layers - 1}); set --layers"
            )
        texts = _read_lines(FLAGS.input_file)
        with files.open(FLAGS.output_file, "w", encoding="utf-8") as out:
            for record in extract(
                model, params, tokenizer, texts, layers, FLAGS.max_seq_length, FLAGS.batch_size
            ):
                out.write(json.dumps(record) + "\n")
        print(
            f"Wrote {len(texts)} records (layers {','.join(map(str, layers))}) to "
            f"{FLAGS.output_file}",
            flush=True,
        )
    except (UserError, OSError) as e:
        cli.leave_on(e)


if __name__ == "__main__":
    define_flags()
    cli.run(main, config_flag=None)
