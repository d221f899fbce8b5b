"""The CPU demo: a 2-layer BERT pretrained on the embedded default corpus in a few minutes.

    python -m bertjax.train --config=configs/tiny.py --workdir=/tmp/bertjax_tiny

The corpus is English text from the installed Python standard library's documentation
(`bertjax.data.default_corpus`), tokenized with a SentencePiece model trained on it at
the first run. Both phases of the recipe run: 90% of steps at 128 tokens, 10% at 256.
"""

import pathlib
import runpy

import ml_collections

# Loaded by path so the config works from any working directory.
base_config = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))["get_config"]


def get_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.model.hidden_size = 128
    c.model.num_hidden_layers = 2
    c.model.num_attention_heads = 2
    c.model.intermediate_size = 512
    c.model.vocab_size = 8000
    c.model.max_position_embeddings = 512
    c.model.dtype = "float32"

    c.data.source = "default"
    c.data.tokenizer = "sentencepiece"
    c.data.sentencepiece_vocab_size = 8000
    c.data.dupe_factor = 2  # 13k short-phase sequences; the run reads 4.3k
    c.data.eval_fraction = 0.02
    c.data.num_workers = 1  # SentencePiece tokenizes this 1 MB corpus faster than workers start

    c.long_phase.max_seq_length = 256
    c.long_phase.max_predictions_per_seq = 40

    c.train.global_batch_size = 16
    c.train.total_steps = 300
    c.train.log_every = 25
    c.train.eval_every = 150
    c.train.eval_batches = 10
    c.train.checkpoint_every = 100
    c.train.keep_every = 0

    c.optimizer.peak_learning_rate = 4e-4  # 1e-3 and above stall at unigram-level MLM here
    c.optimizer.warmup_steps = 30
    return c
