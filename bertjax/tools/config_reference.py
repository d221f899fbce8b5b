"""`python -m bertjax.tools.config_reference > docs/configuration.md`: the pretraining config's
schema'd sections (train, long_phase, data, optimizer, mesh) and a fine-tuning config's fields
as Markdown tables, each field with its default, unit, range or choices, and doc
(bertjax.runtime.schema.reference)."""

from __future__ import annotations

from bertjax.runtime import console, schema
from bertjax.training import validate

HEADER = """# Configuration reference

The pretraining config's `train`, `long_phase`, `data`, `optimizer` and `mesh` sections, as
their schema holds them (`bertjax/training/settings.py`, `bertjax/data/settings.py`,
`bertjax/training/sharding.py`): each field's default (the paper's recipe, BERT-base:
`configs/base.py` starts from these), its unit, the values it allows, and what it is. Set any
of them on the command line, e.g. `--config.train.total_steps=100`; a value outside its range
is refused in one line before any work. The `model` section is its family's
(`configs/base.py` documents BERT's fields). Fine-tuning's fields follow the pretraining
sections.

Written by `python -m bertjax.tools.config_reference > docs/configuration.md`
(tests/test_configs.py checks that it is current).
"""


FINETUNING_HEADER = """# Fine-tuning

A fine-tuning config's own fields stand at its top (`--config.learning_rate=3e-5`), as their
schema holds them (`bertjax/training/finetune_schema.py`; `configs/finetune/common.py` starts
from these); its `optimizer` section is the one above without `peak_learning_rate` and
`warmup_steps`, and its `mesh` section the one above.
"""


def text() -> str:
    """The whole reference page (without its last line's end)."""
    titles = ("Every fine-tuning config", "SQuAD's (squad.py)", "NER's (ner.py)")
    finetuning = dict(zip(titles, validate.FINETUNING, strict=True))
    return (
        f"{HEADER}\n{schema.reference(validate.SECTIONS)}\n{FINETUNING_HEADER}\n"
        f"{schema.reference(finetuning, top=True)}"
    ).rstrip("\n")


if __name__ == "__main__":
    console.say(text())
