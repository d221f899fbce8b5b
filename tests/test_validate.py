"""Every out-of-range config value is refused before any work, in one line naming the field,
its value, the allowed range and the flag to set (pretraining and fine-tuning)."""

import os
import re
import runpy

import pytest

from bertjax import finetune, train
from bertjax.errors import ConfigError
from bertjax.training import validate

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_of(path):
    return runpy.run_path(os.path.join(REPO_ROOT, "configs", path))["get_config"]()


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("optimizer.peak_learning_rate", -1e-4, ">= 0"),
        ("train.total_steps", 0, ">= 1"),
        ("train.global_batch_size", 0, ">= 1"),
        ("data.max_predictions_per_seq", 0, ">= 1"),
        ("data.max_seq_length", 4, ">= 5"),
        ("long_phase.max_seq_length", 3, ">= 5"),
        ("train.log_every", 0, ">= 1"),
        ("train.checkpoint_every", 0, ">= 1"),
        ("train.keep_checkpoints", 0, ">= 1"),
        ("train.profile_steps", -1, ">= 0"),
        ("long_phase.fraction", 1.5, "between 0 and 1"),
        ("optimizer.peak_learning_rate", float("nan"), ">= 0"),
        ("optimizer.b1", 1.5, ">= 0 and < 1"),
        ("optimizer.b2", -0.9, ">= 0 and < 1"),
        ("optimizer.eps", 0.0, "> 0"),
        ("optimizer.weight_decay_rate", -0.01, ">= 0"),
        ("optimizer.clip_global_norm", -1.0, r">= 0 (0 disables clipping)"),
        ("model.hidden_dropout_prob", 1.0, ">= 0 and < 1"),
        ("model.attention_probs_dropout_prob", -0.1, ">= 0 and < 1"),
    ],
)
def test_pretraining_values_out_of_range_are_refused_before_any_work(
    field, value, allowed, tmp_path
):
    config = config_of("tiny.py")
    section, name = field.split(".")
    config[section][name] = value
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        train.train_and_evaluate(config, str(workdir))
    assert str(refused.value) == (
        f"{field}={value!r} is out of range: it must be {allowed}; set --config.{field}"
    )
    assert not workdir.exists()  # nothing written


def test_warmup_longer_than_the_run_is_refused():
    config = config_of("tiny.py")
    config.train.total_steps = 20
    with pytest.raises(
        ConfigError,
        match=r"optimizer.warmup_steps=30 is longer than the run "
        r"\(train.total_steps=20\).*set --config.optimizer.warmup_steps <= 20",
    ):
        validate.pretraining(config)
    config.optimizer.warmup_steps = 20
    validate.pretraining(config)
    validate.pretraining(config_of("base.py"))  # the paper's recipes pass
    validate.pretraining(config_of("large.py"))


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "model.hidden_act",
            "swish",
            "model.hidden_act='swish' is not one of 'gelu', 'gelu_tanh', "
            "'relu'; set --config.model.hidden_act",
        ),
        (
            "model.dtype",
            "float33",
            "model.dtype='float33' is not one of 'float32', 'bfloat16', "
            "'float16'; set --config.model.dtype",
        ),
        (
            "model.num_hidden_layers",
            0,
            "model.num_hidden_layers=0 is out of range: it must be an "
            "integer >= 1; set --config.model.num_hidden_layers",
        ),
        (
            "model.layer_norm_eps",
            0.0,
            "model.layer_norm_eps=0.0 is out of range: it must be a "
            "number > 0; set --config.model.layer_norm_eps",
        ),
        (
            "model.type_vocab_size",
            1,
            "model.type_vocab_size=1 is out of range: pretraining needs 2 "
            "segment types (sentences A and B); set "
            "--config.model.type_vocab_size=2",
        ),
        (
            "model.max_position_embeddings",
            200,
            "long_phase.max_seq_length=256 (phase long) is longer than "
            "model.max_position_embeddings=200; set --config.model.max_position_embeddings >= 256, "
            "or --config.long_phase.max_seq_length <= 200",
        ),
        (
            "data.masking",
            "foo",
            "data.masking='foo' is not one of 'static', 'dynamic'; set --config.data.masking",
        ),
        (
            "data.text_format",
            "line",
            "data.text_format='line' is not one of 'auto', 'lines', "
            "'paragraphs'; set --config.data.text_format",
        ),
        (
            "data.strip_accents",
            "maybe",
            "data.strip_accents='maybe' is not one of 'auto', 'true', "
            "'false'; set --config.data.strip_accents",
        ),
    ],
)
def test_a_config_that_builds_no_model_or_names_no_choice_is_refused_before_any_work(
    field, value, message, tmp_path
):
    """Before, these were found after the tokenizer and the data were prepared (a traceback
    from BertConfig, optax or numpy), or never (text_format, strip_accents were ignored)."""
    config = config_of("tiny.py")
    section, name = field.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError) as refused:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert str(refused.value) == message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "file, field, value, allowed",
    [
        ("glue", "learning_rate", -5e-5, ">= 0"),
        ("glue", "train_batch_size", 0, ">= 1"),
        ("glue", "eval_batch_size", 0, ">= 1"),
        ("glue", "num_train_epochs", 0.0, "> 0"),
        ("glue", "num_train_epochs", -1.0, "> 0"),
        ("glue", "log_every", 0, ">= 1"),
        ("glue", "max_seq_length", 2, ">= 5"),
        ("glue", "warmup_proportion", 1.5, "between 0 and 1"),
        # SQuAD's doc_stride 0 (or below) looped for ever; the others silently predicted nothing.
        ("squad", "doc_stride", 0, ">= 1"),
        ("squad", "doc_stride", -8, ">= 1"),
        ("squad", "max_query_length", 0, ">= 1"),
        ("squad", "n_best_size", 0, ">= 1"),
        ("squad", "max_answer_length", 0, ">= 1"),
        ("ner", "lstm_size", 0, ">= 1"),
        ("glue", "hidden_dropout_prob", 1.0, ">= 0 and < 1"),
        ("glue", "attention_probs_dropout_prob", 1.5, ">= 0 and < 1"),
        ("glue", "optimizer.b2", 1.0, ">= 0 and < 1"),
        ("glue", "optimizer.eps", -1e-6, "> 0"),
    ],
)
def test_fine_tuning_values_out_of_range_are_refused_before_any_work(
    file, field, value, allowed, tmp_path
):
    config = config_of(f"finetune/{file}.py")
    *section, name = field.split(".")
    (config[section[0]] if section else config)[name] = value
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(field)}=.* is out of range: it must be "
        rf"{re.escape(allowed)}; set --config.{re.escape(field)}$",
    ):
        finetune.run(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    validate.finetuning(config_of(f"finetune/{file}.py"))


@pytest.mark.parametrize("seeds", ["", "1,x", " , "])
def test_fine_tuning_seeds_that_are_not_integers_are_refused_before_any_work(seeds, tmp_path):
    config = config_of("finetune/glue.py")
    config.seeds = seeds
    with pytest.raises(
        ConfigError,
        match=r"is not a comma-separated list of integers .*; set "
        r"--config.seeds$",
    ):
        finetune.run(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert validate.seeds(" 1, 2,3") == [1, 2, 3]


def test_a_warmup_over_the_whole_fine_tuning_is_a_warning(caplog):
    config = config_of("finetune/glue.py")
    config.warmup_proportion = 1.0
    validate.finetuning(config)  # (legal: a warning)
    assert "warmup_proportion=1.0: the learning rate climbs for the whole run" in caplog.text


def test_data_preparation_refuses_a_data_choice_it_does_not_know():
    """`python -m bertjax.prepare` read `text_format='line'` as paragraphs, without a word."""
    config = config_of("base.py")
    validate.data_preparation(config)
    config.data.text_format = "line"
    with pytest.raises(
        ConfigError,
        match=r"^data.text_format='line' is not one of 'auto', "
        r"'lines', 'paragraphs'; set --config.data.text_format$",
    ):
        validate.data_preparation(config)


def test_a_mesh_axis_the_mesh_lacks_is_named():
    from bertjax.training.sharding import MeshSettings

    assert MeshSettings.of({"data": -1, "tensor": 2}) == MeshSettings(-1, 1, 2)
    with pytest.raises(
        ConfigError,
        match=r"^mesh.pipeline is not an axis of the mesh \(its "
        r"axes: data, fsdp, tensor\)",
    ):
        MeshSettings.of({"data": 1, "pipeline": 2})
