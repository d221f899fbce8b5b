"""The shipped configs: the paper's recipe, loadable from any directory, every field documented."""
import pathlib
import re
import runpy

import pytest

from bertjax import schedule
from bertjax.model import BertConfig

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def load(name: str):
    return runpy.run_path(str(CONFIGS / f"{name}.py"))["get_config"]()


def test_base_and_large_follow_the_paper():
    for name, (layers, hidden, heads) in {"base": (12, 768, 12), "large": (24, 1024, 16)}.items():
        c = load(name)
        model = BertConfig.from_dict(c.model.to_dict())
        assert (model.num_hidden_layers, model.hidden_size, model.num_attention_heads) == \
            (layers, hidden, heads)
        assert model.intermediate_size == 4 * hidden and model.vocab_size == 30522
        assert (c.train.global_batch_size, c.train.total_steps) == (256, 1_000_000)
        assert (c.optimizer.name, c.optimizer.peak_learning_rate, c.optimizer.warmup_steps) == \
            ("bert_adam", 1e-4, 10_000)
        short, long = schedule.phases(c.train, c.data, c.long_phase)
        assert (short.max_seq_length, short.max_predictions_per_seq, short.end_step) == \
            (128, 20, 900_000)
        assert (long.max_seq_length, long.max_predictions_per_seq, long.start_step) == \
            (512, 80, 900_000)


@pytest.mark.parametrize("name", ["tiny", "base", "large"])
def test_configs_load_from_any_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load(name).model.hidden_size > 0


def test_every_base_field_has_a_comment():
    """Each `c.section.field = value` line says what the field is (and its unit): on the line,
    or in the comment block right above it."""
    lines = (CONFIGS / "base.py").read_text().splitlines()
    fields = [i for i, line in enumerate(lines) if re.match(r"\s+c\.\w+\.\w+ = ", line)]
    assert len(fields) > 50
    undocumented = [lines[i].strip() for i in fields
                    if "  # " not in lines[i] and not lines[i - 1].strip().startswith("#")]
    assert not undocumented, undocumented
