"""ModernBERT-base (Warner et al. 2024; 22 layers, hidden 768, GeGLU 2 x 1152, 12 heads,
149M parameters with its 50,368-token vocabulary) on bertjax's pretraining machinery, with
the family's recipe: the masked LM alone at 30%, StableAdamW, warmup-stable-decay, rows of
1,024 tokens, then the last 15% of the steps at 8,192 (its context extension).

    python -m bertjax.train --config=configs/modernbert_base.py --workdir=gs://BUCKET/mb_base \
        --config.data.source=tfds --config.data.tfds_name=wikipedia/20230601.en
    python -m bertjax.tools.aot --config=configs/modernbert_base.py --target=tpu-v5e-8

What stays configs/base.py's: the data pipeline, packing, checkpoints, the mesh. The
tokenizer is bertjax's (WordPiece or SentencePiece at model.vocab_size), not ModernBERT's
BPE: a run from scratch trains its own. docs/modernbert.md.
"""

import pathlib
import runpy

import ml_collections

HERE = pathlib.Path(__file__).parent
base_config = runpy.run_path(str(HERE / "base.py"))["get_config"]
tiny = runpy.run_path(str(HERE / "modernbert_tiny.py"))


def get_config() -> ml_collections.ConfigDict:
    c = base_config()
    m = c.model = tiny["get_config"]().model  # (every field, documented there)
    m.update(
        vocab_size=50_368,
        hidden_size=768,
        intermediate_size=1_152,
        num_hidden_layers=22,
        num_attention_heads=12,
        max_position_embeddings=8_192,
        local_attention=128,
        pad_token_id=0,
        dtype="bfloat16",
    )
    c.train.next_sentence_prediction = False
    c.data.masked_lm_prob = 0.3  # fraction of tokens masked
    c.data.max_seq_length = 1_024  # tokens per row, most of the run
    c.data.max_predictions_per_seq = 308  # >= 0.3 x 1,024
    c.train.global_batch_size = 4_608  # rows per step (the paper's, after its batch warmup)
    c.train.total_steps = 424_000  # 2T tokens at 4.7M per step
    c.long_phase.fraction = 0.15  # the context extension: the last 15% of the steps
    c.long_phase.max_seq_length = 8_192
    c.long_phase.max_predictions_per_seq = 2_458  # >= 0.3 x 8,192
    c.long_phase.global_batch_size = 576  # the same 4.7M tokens per step
    c.optimizer.update(peak_learning_rate=8e-4, warmup_steps=650)  # 3B tokens at 4.7M / step
    tiny["recipe"](c)
    return c
