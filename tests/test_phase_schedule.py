"""The phase schedule (90% of the steps at length 128, 10% at 512) and the data position."""

import json

import pytest

from bertjax.checkpoints.run_record import RunRecord
from bertjax.errors import ConfigError
from bertjax.training import phase_schedule, run_schedule, validate
from bertjax.training.phase_schedule import DataPosition, Phase
from bertjax.training.settings import LongPhaseSettings, PretrainingSettings, TrainSettings
from test_pipeline import BATCH, LONG_PREDS, LONG_SEQ, PREDS, SEQ, make_config, phases_of


def test_phases_split_total_steps_90_10():
    config = make_config("unused", **{"train.total_steps": 1000})
    short, long = phases_of(config)
    assert short == Phase("short", SEQ, PREDS, BATCH, 0, 900)
    assert long == Phase("long", LONG_SEQ, LONG_PREDS, BATCH, 900, 1000)


def test_long_phase_batch_size_and_rounding():
    config = make_config("unused", **{"train.total_steps": 7, "long_phase.global_batch_size": 8})
    short, long = phases_of(config)
    assert (short.start_step, short.end_step, short.global_batch_size) == (0, 6, BATCH)
    assert (long.start_step, long.end_step, long.global_batch_size) == (6, 7, 8)


def test_single_phase_when_long_fraction_is_zero_or_one():
    (only,) = phases_of(make_config("unused", **{"long_phase.fraction": 0.0}))
    assert only == Phase("short", SEQ, PREDS, BATCH, 0, 100)
    (only,) = phases_of(make_config("unused", **{"long_phase.fraction": 1.0}))
    assert only == Phase("long", LONG_SEQ, LONG_PREDS, BATCH, 0, 100)


def test_phase_at_boundaries():
    phases = phases_of(make_config("unused"))
    assert [
        phase_schedule.phase_at(phases, s).name for s in (0, 1, 89, 90, 91, 99, 100, 10**6)
    ] == ["short", "short", "short", "long", "long", "long", "long", "long"]
    (only,) = phases_of(make_config("unused", **{"long_phase.fraction": 0.0}))
    assert (
        phase_schedule.phase_at([only], 0) is only and phase_schedule.phase_at([only], 500) is only
    )


def test_data_position_round_trips_and_follows_a_changed_schedule():
    position = DataPosition("short", 7)
    assert DataPosition.from_dict(position.as_dict()) == position
    assert position.as_dict() == {"phase": "short", "batch_index": 7}  # the checkpoint's JSON
    phases = phases_of(make_config("unused"))  # short: steps 0-89, long: 90-99
    assert phase_schedule.consistent_position(position, 7, phases) is position
    assert phase_schedule.consistent_position(position, 95, phases) == DataPosition("long", 5)


# Fields older runs' configs lack (added since), by section.
ADDED_SINCE = {
    "train": [
        "objective",
        "next_sentence_prediction",
        "extend",
        "allow_changed_data",
        "max_nonfinite_steps",
    ],
    "long_phase": [
        "global_batch_size",
        "restart_optimizer",
        "restart_warmup_steps",
        "restart_peak_learning_rate",
    ],
    "data": [
        "masking",
        "packing",
        "mask_token_prob",
        "random_token_prob",
        "prepared_dir",
        "strip_accents",
    ],
}


def test_a_checkpoint_recorded_by_an_older_run_plans_its_schedule_as_then():
    """A checkpoint without `meta["schedule"]`, whose config lacks the fields added since:
    its schedule is planned from the config it recorded, the missing fields at the defaults
    their runs had (typed settings, built with `recorded=True`)."""
    config = make_config("unused", **{"train.total_steps": 1000})
    old = json.loads(config.to_json())
    for section, names in ADDED_SINCE.items():
        for name in names:
            del old[section][name]
    plan = run_schedule.recorded(RunRecord.of({"config": json.dumps(old)}))
    settings = validate.settings(config)
    assert plan == run_schedule.planned(settings, config.optimizer)
    assert plan.phases == phases_of(config)
    recorded = PretrainingSettings.of(old, recorded=True)
    assert (
        recorded.train.objective,
        recorded.train.next_sentence_prediction,
        recorded.train.max_nonfinite_steps,
    ) == ("mlm", True, 10)
    assert recorded.long_phase == LongPhaseSettings(0.1, LONG_SEQ, LONG_PREDS)
    with pytest.raises(KeyError):  # (a user's config has every field)
        TrainSettings.of(old["train"])


def test_train_settings_are_typed_once_with_their_choices_checked():
    config = make_config(
        "unused", **{"train.objective": "ltr", "train.next_sentence_prediction": False}
    )
    settings = validate.settings(config)
    assert isinstance(settings.train, TrainSettings) and settings.train.total_steps == 100
    assert settings.train.pretraining_objective.causal
    assert not settings.train.pretraining_objective.uses_nsp
    config.train.objective = "LTR"  # choices are exact
    with pytest.raises(
        ConfigError,
        match=r"^train\.objective='LTR' is not one of 'mlm', 'ltr'; set --config\.train\.objective$",
    ):
        validate.settings(config)
