"""Every out-of-range config value is refused before any work, in one line naming the field,
its value, the allowed range and the flag to set (pretraining and fine-tuning)."""
import os
import runpy

import pytest

from bertjax import finetune, train, validate
from bertjax.run import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
config_of = lambda path: runpy.run_path(os.path.join(REPO_ROOT, "configs", path))["get_config"]()


@pytest.mark.parametrize("field, value, allowed", [
    ("optimizer.peak_learning_rate", -1e-4, ">= 0"),
    ("train.total_steps", 0, ">= 1"),
    ("train.global_batch_size", 0, ">= 1"),
    ("data.max_predictions_per_seq", 0, ">= 1"),
    ("data.max_seq_length", 4, ">= 5"),
    ("long_phase.max_seq_length", 3, ">= 5"),
    ("train.log_every", 0, ">= 1"),
    ("train.checkpoint_every", 0, ">= 1"),
    ("train.keep_checkpoints", 0, ">= 1"),
    ("long_phase.fraction", 1.5, "between 0 and 1"),
    ("optimizer.peak_learning_rate", float("nan"), ">= 0"),
])
def test_pretraining_values_out_of_range_are_refused_before_any_work(field, value, allowed,
                                                                     tmp_path):
    config = config_of("tiny.py")
    section, name = field.split(".")
    config[section][name] = value
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        train.train_and_evaluate(config, str(workdir))
    assert str(refused.value) == (f"{field}={value!r} is out of range: it must be {allowed}; "
                                  f"set --config.{field}")
    assert not workdir.exists()  # nothing written


def test_warmup_longer_than_the_run_is_refused():
    config = config_of("tiny.py")
    config.train.total_steps = 20
    with pytest.raises(ConfigError, match=r"optimizer.warmup_steps=30 is longer than the run "
                       r"\(train.total_steps=20\).*set --config.optimizer.warmup_steps <= 20"):
        validate.pretraining(config)
    config.optimizer.warmup_steps = 20
    validate.pretraining(config)
    validate.pretraining(config_of("base.py"))  # the paper's recipes pass
    validate.pretraining(config_of("large.py"))


@pytest.mark.parametrize("field, value, allowed", [
    ("learning_rate", -5e-5, ">= 0"), ("train_batch_size", 0, ">= 1"),
    ("num_train_epochs", 0.0, "> 0"), ("log_every", 0, ">= 1"), ("max_seq_length", 2, ">= 5"),
    ("warmup_proportion", 1.5, "between 0 and 1"),
])
def test_fine_tuning_values_out_of_range_are_refused_before_any_work(field, value, allowed,
                                                                     tmp_path):
    config = config_of("finetune/glue.py")
    config[field] = value
    with pytest.raises(ConfigError, match=rf"^{field}=.* is out of range: it must be {allowed}; "
                       rf"set --config.{field}$"):
        finetune.run(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    validate.finetuning(config_of("finetune/glue.py"))
