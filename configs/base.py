"""BERT-base pretraining, the paper's recipe (Devlin et al., 2018, section A.2).

    python -m bertjax.train --config=configs/base.py --workdir=gs://BUCKET/bert_base \
        --config.data.source=tfds --config.data.tfds_name=wikipedia/20230601.en \
        --config.data.tokenizer=wordpiece --config.data.vocab_file=vocab.txt

12 layers, hidden 768, 12 heads; 1M steps of 256 sequences, peak lr 1e-4, 10k warmup steps,
linear decay to 0; 90% of the steps at length 128 (20 predictions), the last 10% at 512 (80).
"""

import ml_collections

from bertjax.data.settings import DataSettings
from bertjax.runtime import schema
from bertjax.training.settings import LongPhaseSettings, OptimizerSettings, TrainSettings
from bertjax.training.sharding import MeshSettings


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 30522  # tokens; must be at least the tokenizer's vocabulary size
    c.model.hidden_size = 768  # units per token
    c.model.num_hidden_layers = 12  # transformer layers
    c.model.num_attention_heads = 12  # heads per layer
    c.model.intermediate_size = 3072  # FFN units (4 x hidden)
    # "gelu": exact erf (released checkpoints); "gelu_tanh" (modeling.py since Feb 2019); "relu"
    c.model.hidden_act = "gelu"
    c.model.hidden_dropout_prob = 0.1  # probability
    c.model.attention_probs_dropout_prob = 0.1  # probability
    c.model.max_position_embeddings = 512  # positions
    c.model.type_vocab_size = 2  # segment ids
    c.model.initializer_range = 0.02  # stddev of the truncated normal init
    c.model.layer_norm_eps = 1e-12  # LayerNorm epsilon (the original's, not flax's 1e-6)
    c.model.dtype = "bfloat16"  # compute dtype; use "float32" on CPU
    c.model.param_dtype = "float32"  # parameter and optimizer-state dtype
    c.model.scan_layers = False  # nn.scan over layers (faster compile; stacked params)
    c.model.remat_policy = "none"  # "none" | "full" | "dots" | "dots_no_batch"
    # "einsum": the reference, attention dropout from the JAX RNG (bit-exact on resume);
    # "cudnn": cuDNN flash attention, attention dropout from cuDNN's own generator;
    # "xla": jax.nn.dot_product_attention, needs attention_probs_dropout_prob=0 to train;
    # "pallas": the Pallas kernels (TPU: Mosaic, GPU: Triton), attention dropout from a hash
    # of the JAX RNG (bit-exact on resume; docs/deviations.md section 7).
    c.model.attention_impl = "auto"  # "auto": the fused kernel that fits the platform and dropout
    # "auto": on a GPU in 16-bit compute, Triton kernels for the FFN's GEMMs with bias + GELU in
    # their epilogues and for bias + dropout + residual + LayerNorm in one pass
    # (bertjax.models.feed_forward_gpu, add_norm_gpu); "xla": XLA's ops; "triton": always.
    c.model.dense_impl = "auto"
    c.model.vocab_pad_multiple = 1  # MLM projection on the vocab padded to this multiple; 1 = off

    # The data, long phase, train, optimizer and mesh sections: the paper's recipe, each field's
    # default in its schema with its unit, range and doc (docs/configuration.md lists them all).
    c.data = schema.section_config(DataSettings)
    c.long_phase = schema.section_config(LongPhaseSettings)
    c.train = schema.section_config(TrainSettings)

    c.optimizer = schema.section_config(OptimizerSettings)

    c.mesh = schema.section_config(MeshSettings)
    return c
