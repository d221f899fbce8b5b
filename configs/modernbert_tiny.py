"""The CPU demo of the ModernBERT family: a 4-layer ModernBERT pretrained with the masked LM
alone (30% masking, no next-sentence prediction) on the embedded default corpus.

    python -m bertjax.train --config=configs/modernbert_tiny.py --workdir=/tmp/modernbert_tiny

Everything but the model and the objective is configs/tiny.py's (data, phases, batch,
schedule, checkpoints): the same machinery trains both families. The architecture is
transformers' `ModernBertForMaskedLM` (bertjax.models.modernbert.model; field names and meanings as
transformers' `ModernBertConfig`), at tiny widths; docs/modernbert.md.
"""

import pathlib
import runpy

import ml_collections

# Loaded by path so the config works from any working directory.
tiny_config = runpy.run_path(str(pathlib.Path(__file__).with_name("tiny.py")))["get_config"]


def get_config() -> ml_collections.ConfigDict:
    c = tiny_config()
    m = c.model = ml_collections.ConfigDict()
    m.family = "modernbert"  # "bert" (configs/base.py's fields) | "modernbert" (these)
    m.vocab_size = 8000  # tokens; at least data.sentencepiece_vocab_size
    m.hidden_size = 128  # units per token
    m.intermediate_size = 192  # GeGLU units per half (Wi projects to 2 x this); base: 1.5 x H
    m.num_hidden_layers = 4  # pre-norm layers
    m.num_attention_heads = 2  # heads per layer (head size 64: even, for RoPE)
    m.hidden_activation = "gelu"  # the GeGLU's activation: "gelu" (erf) | "gelu_tanh" | "relu"
    m.max_position_embeddings = 512  # the longest row (RoPE has no table; a checked bound)
    m.initializer_range = 0.02  # stddev of the truncated normal init
    m.initializer_cutoff_factor = 2.0  # the init's truncation, in stddevs
    m.norm_eps = 1e-5  # LayerNorm epsilon
    m.norm_bias = False  # LayerNorms with a bias (ModernBERT: none)
    m.attention_bias = False  # Wqkv and the attention output with biases (ModernBERT: none)
    m.mlp_bias = False  # the GeGLU's Wi and Wo with biases (ModernBERT: none)
    m.decoder_bias = True  # the MLM decoder's output bias
    m.classifier_bias = False  # the MLM head's dense with a bias
    m.classifier_activation = "gelu"  # the MLM head's activation
    m.global_attn_every_n_layers = 3  # layers 0, 3, ... attend over the whole row
    m.local_attention = 64  # the others see the keys within +-32 tokens (sliding window)
    m.global_rope_theta = 160_000.0  # RoPE base of the global layers
    m.local_rope_theta = 10_000.0  # RoPE base of the sliding-window layers
    m.attention_dropout = 0.0  # on attention probabilities and output (ModernBERT: 0)
    m.embedding_dropout = 0.0  # probability
    m.mlp_dropout = 0.0  # probability
    m.classifier_dropout = 0.0  # fine-tuning: before the classifier (transformers' default 0)
    m.classifier_pooling = "cls"  # fine-tuning's sentence tasks: "cls" | "mean" (real tokens)
    m.pad_token_id = 0  # the tokenizer's padding id (the SentencePiece model's [PAD])
    m.dtype = "float32"  # compute dtype; "bfloat16" on TPU/GPU
    m.param_dtype = "float32"  # parameter and optimizer-state dtype
    m.remat_policy = "none"  # "none" | "full" | "dots" | "dots_no_batch"
    # The sliding-window layers run Pallas's splash kernel for "pallas", XLA's for "xla", else
    # the einsum reference (cuDNN's windows are causal only); docs/modernbert.md.
    m.attention_impl = "auto"  # GPU: cuDNN, TPU: Pallas | "einsum" | "xla" | "cudnn" | "pallas"

    # The modern recipe's objective (ModernBERT, section 2.2; Wettig et al. 2023): the
    # masked LM alone, 30% of the tokens masked.
    c.train.next_sentence_prediction = False
    c.data.masked_lm_prob = 0.3  # fraction of tokens masked
    c.data.max_predictions_per_seq = 40  # >= 0.3 x 128
    c.long_phase.max_predictions_per_seq = 80  # >= 0.3 x 256
    recipe(c)
    return c


def recipe(c: ml_collections.ConfigDict) -> None:
    """ModernBERT's packed rows, optimizer and schedule (Warner et al. 2024, section 2.2 and
    table 3): rows packed with whole instances (its unpadding); StableAdamW (AdamW whose per-tensor update is clipped, Wortsman et al. 2023) with betas
    (0.9, 0.98) and no global-norm clipping, and a warmup-stable-decay schedule whose last
    10% decays as 1 - sqrt (Hägele et al. 2024)."""
    c.data.packing = True
    c.optimizer.update(
        name="stable_adamw",
        b2=0.98,
        clip_global_norm=0.0,
        schedule="wsd",
        decay_fraction=0.1,
        decay_shape="1-sqrt",
    )
