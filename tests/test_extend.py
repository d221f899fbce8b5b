"""A workdir rerun with another schedule (issue 33: a finished 60-step run rerun with
total_steps=80 went back from the long phase to the short one, with a new learning rate, and
changed the step-60 model unasked): refused in one line, nothing written; with
`train.extend=True` it trains on at the learning rate docs/pretraining.md states, and the
steps the run had been planned for are an uninterrupted run's, bit for bit."""
import os

import pytest

from bertjax import run_schedule, train
from test_train import cache_dir, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixtures)

PEAK, WARMUP = 2e-3, 4  # tiny_config's


def files_under(directory) -> dict[str, tuple[int, int]]:
    """Every file under `directory`: (size, modification time in ns) by relative path."""
    return {os.path.relpath(os.path.join(root, name), directory):
            (os.stat(os.path.join(root, name)).st_size,
             os.stat(os.path.join(root, name)).st_mtime_ns)
            for root, _, names in os.walk(directory) for name in names
            if name != "run.lock"}  # (rewritten by every run that takes it)


@pytest.fixture(scope="module")
def finished(corpus_file, cache_dir, tmp_path_factory):  # noqa: F811
    """A finished 8-step run (long phase: steps 7-8) and its config."""
    config = tiny_config(corpus_file, cache_dir, **{"train.total_steps": 8})
    workdir = tmp_path_factory.mktemp("finished")
    train.train_and_evaluate(config, str(workdir))
    return workdir, config


def test_another_schedule_is_refused_and_extend_trains_on_as_documented(finished, capsys):
    workdir, config = finished
    before = files_under(workdir)
    config.train.total_steps = 12
    with pytest.raises(run_schedule.ScheduleChanged) as refused:
        train.train_and_evaluate(config, str(workdir))
    assert str(refused.value) == (
        f"checkpoint {workdir}/checkpoints/8 was trained on a schedule this run changes "
        "(train.total_steps: 8 -> 12): resuming would move the phases and the learning rate "
        "under the steps it trained. Use another --workdir for a new run; or extend this one "
        "past step 8 with --config.train.extend=True (steps 1-8 keep their schedule, the added "
        "ones train in phase long at the learning rate this config gives them: "
        "docs/pretraining.md); or rerun with the settings it recorded.")
    assert files_under(workdir) == before  # nothing written, config.json included

    config.train.extend = True
    capsys.readouterr()
    train.train_and_evaluate(config, str(workdir))
    assert "Extending the run past step 8 (train.extend): steps 9-12 train in phase long, the " \
        "learning rate from 6.667e-04" in capsys.readouterr().out  # 2e-3 * (1 - 8 / 12)
    rows = read_metrics(workdir)
    assert [m["step"] for m in rows] == list(range(1, 13))
    # Step s applies the rate at s - 1: steps 1-8 the 8-step schedule's (warmup 4, linear
    # decay to 0 at 8), steps 9-12 the 12-step schedule's at the same step.
    expected = [PEAK * k / WARMUP if k < WARMUP else PEAK * (1 - k / 8) for k in range(8)] + \
        [PEAK * (1 - k / 12) for k in range(8, 12)]
    assert [m["learning_rate"] for m in rows] == pytest.approx(expected, rel=1e-6)
    assert [m["phase"] for m in rows] == ["short"] * 6 + ["long"] * 6  # no way back


@pytest.mark.slow  # (two more runs)
def test_a_partly_run_workdir_extended_trains_the_planned_steps_bit_for_bit(finished, tmp_path):
    """Stopped at step 5 of 8, then extended to 12: every step's loss and learning rate are
    those of the finished run extended to 12."""
    workdir, config = finished
    if len(read_metrics(workdir)) < 12:  # (run without the test before)
        config.train.update(total_steps=12, extend=True)
        train.train_and_evaluate(config, str(workdir))
    partly = tmp_path / "partly"
    config.train.update(total_steps=8, extend=False, stop_after_steps=5)
    train.train_and_evaluate(config, str(partly))
    config.train.update(total_steps=12, extend=True, stop_after_steps=0)
    train.train_and_evaluate(config, str(partly))
    straight = {m["step"]: (m["loss"], m["learning_rate"]) for m in read_metrics(workdir)}
    resumed = read_metrics(partly)
    assert [m["step"] for m in resumed] == list(range(1, 13))  # (a checkpoint at the stop)
    for m in resumed:
        assert (m["loss"], m["learning_rate"]) == straight[m["step"]], m
