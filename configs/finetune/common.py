"""Fields shared by every fine-tuning config (glue.py, ner.py, squad.py load this by path).

Defaults are the original run_classifier / run_squad ones: batch 32, lr 5e-5, 3 epochs, 10%
linear warmup then linear decay, BERT's AdamWeightDecay, dropout 0.1.
"""

import pathlib
import runpy

import ml_collections

from bertjax.runtime import schema
from bertjax.training.finetune_schema import FinetuneFields

# Loaded by path so the config works from any working directory.
base_config = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "base.py"))["get_config"]


def get_config() -> ml_collections.ConfigDict:
    # Every field's default, unit, range and doc: its schema (docs/configuration.md).
    c = schema.section_config(FinetuneFields)

    pretraining = base_config()  # the same optimizer and mesh fields as pretraining
    c.optimizer = pretraining.optimizer
    for field in ("peak_learning_rate", "warmup_steps"):  # from learning_rate/warmup_proportion
        del c.optimizer[field]
    c.mesh = pretraining.mesh
    return c
