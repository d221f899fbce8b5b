"""The shipped configs: the paper's recipe, loadable from any directory, every field documented."""

import dataclasses
import pathlib
import re
import runpy

import pytest

from bertjax.errors import ConfigError
from bertjax.models.bert.model import BertConfig
from bertjax.runtime import schema
from bertjax.tools import config_reference
from bertjax.training import optim, validate
from bertjax.training.settings import plan_phases

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def load(name: str):
    return runpy.run_path(str(CONFIGS / f"{name}.py"))["get_config"]()


def test_base_and_large_follow_the_paper():
    for name, (layers, hidden, heads) in {"base": (12, 768, 12), "large": (24, 1024, 16)}.items():
        c = load(name)
        model = BertConfig.from_dict(c.model.to_dict())
        assert (model.num_hidden_layers, model.hidden_size, model.num_attention_heads) == (
            layers,
            hidden,
            heads,
        )
        assert model.intermediate_size == 4 * hidden and model.vocab_size == 30522
        assert (model.hidden_dropout_prob, model.attention_probs_dropout_prob) == (0.1, 0.1)
        assert (model.hidden_act, model.layer_norm_eps) == ("gelu", 1e-12)
        assert (c.train.global_batch_size, c.train.total_steps) == (256, 1_000_000)
        # Adam with decoupled weight decay, global-norm clipping, linear warmup then decay.
        assert optim.optimizer_config(c.optimizer, c.train.total_steps) == optim.OptimizerConfig(
            peak_learning_rate=1e-4,
            warmup_steps=10_000,
            total_steps=1_000_000,
            name="bert_adam",
            weight_decay_rate=0.01,
            b1=0.9,
            b2=0.999,
            eps=1e-6,
            clip_global_norm=1.0,
        )
        assert (c.data.masked_lm_prob, c.data.mask_token_prob, c.data.random_token_prob) == (
            0.15,
            0.8,
            0.1,
        )
        short, long = plan_phases(c.train, c.data, c.long_phase)
        assert (short.max_seq_length, short.max_predictions_per_seq, short.end_step) == (
            128,
            20,
            900_000,
        )
        assert (long.max_seq_length, long.max_predictions_per_seq, long.start_step) == (
            512,
            80,
            900_000,
        )
        assert (short.start_step, long.end_step) == (0, 1_000_000)
        assert short.global_batch_size == long.global_batch_size == 256


@pytest.mark.parametrize("name", ["tiny", "base", "large"])
def test_configs_load_from_any_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load(name).model.hidden_size > 0


def test_every_base_field_has_a_comment():
    """Each `c.model.field = value` line (the section configs/base.py sets itself) says what
    the field is (and its unit): on the line, or in the comment block right above it. (The
    schema'd sections: test_every_schema_field_is_documented_and_its_default_allowed.)"""
    lines = (CONFIGS / "base.py").read_text().splitlines()
    fields = [i for i, line in enumerate(lines) if re.match(r"\s+c\.\w+\.\w+ = ", line)]
    assert len(fields) > 15
    undocumented = [
        lines[i].strip()
        for i in fields
        if "  # " not in lines[i] and not lines[i - 1].strip().startswith("#")
    ]
    assert not undocumented, undocumented


def test_every_schema_field_is_documented_and_its_default_allowed():
    """Each field of the schema'd sections has a doc, and its default (base.py's value) is in
    its range and among its choices: the default the schema states is one it accepts."""
    base = load("base")
    for name, cls in validate.SECTIONS.items():
        kinds = schema.choices(cls)
        for field in dataclasses.fields(cls):
            assert field.metadata["doc"].strip(), f"{name}.{field.name} has no doc"
            assert base[name][field.name] == field.default
            allowed = field.metadata["allowed"]
            assert allowed is None or allowed.holds(field.default), f"{name}.{field.name}"
            assert field.name not in kinds or field.default in kinds[field.name]
        assert set(base[name]) == {f.name for f in dataclasses.fields(cls)}


def test_every_finetuning_field_is_in_a_schema_documented_and_its_default_allowed():
    """A fine-tuning config's fields (but its optimizer and mesh sections) are those of its
    schemas (every config's, and its task's), each with a doc and a default its range and
    choices accept; squad.py and ner.py keep their schemas' defaults."""
    schemas = dict(zip(("common", "squad", "ner"), validate.FINETUNING, strict=True))
    for cls in schemas.values():
        for field in dataclasses.fields(cls):
            assert field.metadata["doc"].strip(), f"{field.name} has no doc"
            allowed = field.metadata["allowed"]
            assert allowed is None or allowed.holds(field.default), field.name
    for name, extra in {"glue": (), "ner": ("ner",), "squad": ("squad",)}.items():
        config = load(f"finetune/{name}")
        fields = {f.name for key in ("common", *extra) for f in dataclasses.fields(schemas[key])}
        assert set(config) - {"optimizer", "mesh"} == fields, name
        for key in extra:
            assert all(config[k] == v for k, v in schema.defaults(schemas[key]).items())


def test_a_schema_range_is_what_the_config_check_enforces():
    """validate reads a field's range off its schema: a narrower range there refuses a value
    the shipped one accepts, naming the field."""
    config = load("tiny")
    validate.check_sections(config, {"train": ()})  # (the shipped ranges accept tiny's)
    narrow = dataclasses.field(
        default=16,
        metadata={"doc": "d", "unit": "", "allowed": schema.Range("> 16", lambda v: v > 16)},
    )
    narrowed = dataclasses.make_dataclass("Train", [("global_batch_size", int, narrow)])
    with pytest.raises(
        ConfigError, match=r"^train\.global_batch_size=16 is out of range: it must be > 16"
    ):
        validate.check_sections(config, {"train": ()}, {"train": narrowed})


def test_the_configuration_reference_is_current():
    """docs/configuration.md is what `python -m bertjax.tools.config_reference` writes now."""
    written = (CONFIGS.parent / "docs" / "configuration.md").read_text()
    assert written == config_reference.text() + "\n", (
        "docs/configuration.md is out of date: run "
        "python -m bertjax.tools.config_reference > docs/configuration.md"
    )
