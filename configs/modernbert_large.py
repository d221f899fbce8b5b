"""ModernBERT-large (Warner et al. 2024; 28 layers, hidden 1024, GeGLU 2 x 2624, 16 heads,
395M parameters) with the family's recipe; everything else as configs/modernbert_base.py.

    python -m bertjax.tools.aot --config=configs/modernbert_large.py --target=tpu-v5p-8
"""

import pathlib
import runpy

import ml_collections

base_config = runpy.run_path(str(pathlib.Path(__file__).with_name("modernbert_base.py")))[
    "get_config"
]


def get_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.model.update(
        hidden_size=1_024, intermediate_size=2_624, num_hidden_layers=28, num_attention_heads=16
    )
    c.train.global_batch_size = 4_928  # rows per step (the paper's, after its batch warmup)
    c.long_phase.global_batch_size = 616  # the same 5.0M tokens per step
    c.optimizer.update(peak_learning_rate=5e-4, warmup_steps=400)  # 2B tokens at 5.0M / step
    return c
