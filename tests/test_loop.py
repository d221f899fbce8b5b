"""The loop skeleton both loops run on (bertjax.training.loop) and the one NaN policy
(nonfinite.NonFiniteSteps) with its setting: pretraining's stops, fine-tuning's names."""

import logging
import signal

import pytest

from bertjax import train
from bertjax.runtime import failures
from bertjax.training import loop, nonfinite
from test_train import cache_dir, corpus_file, tiny_config  # noqa: F401 (fixtures)


def test_actions_run_when_due_in_order_until_one_stops_the_loop():
    done = []
    actions = [
        loop.Periodic(lambda step: done.append(("log", step)), 2, at={5}),
        loop.Periodic(lambda step: done.append(("save", step)), 0, at={3}),
        loop.Periodic(lambda step: signal.SIGTERM if step == 4 else None),
    ]
    trained = []
    assert loop.run(0, 6, trained.append, actions) == (4, signal.SIGTERM)
    assert trained == [0, 1, 2, 3] and done == [("log", 2), ("save", 3), ("log", 4)]
    assert loop.run(3, 3, trained.append, actions) == (3, 0)  # nothing left: no step


def test_a_stop_request_is_ctrl_c_here_or_a_notice_every_process_reached():
    ctrl_c = failures.CtrlC(forward_as_sigterm=False)
    assert loop.stop_request(ctrl_c, 7) == 0
    ctrl_c.requested = True
    assert loop.stop_request(ctrl_c, 7) == signal.SIGINT
    forwarded = failures.CtrlC(forward_as_sigterm=True)
    forwarded.requested = True  # (a multi-process job: stopped once the notice is reached)
    assert loop.stop_request(forwarded, 7) == 0


def test_the_nan_policy_stops_pretraining_and_names_fine_tunings_skipped_steps(caplog):
    """One policy, one setting: max_in_a_row=2 stops at the second skipped step in a row
    (and at once for a non-finite state); 0 never stops, and names the skipped steps of a
    window counted on the device."""
    stops = nonfinite.NonFiniteSteps(2)
    assert stops.add(1, nonfinite.NonFinite.LOSS_OR_GRADIENTS) and not stops.add(2, 0)
    stops.add(3, nonfinite.NonFinite.LOSS_OR_GRADIENTS)
    with pytest.raises(nonfinite.TrainingError, match="2 consecutive non-finite steps"):
        stops.add(4, nonfinite.NonFinite.LOSS_OR_GRADIENTS)
    with pytest.raises(nonfinite.TrainingError):
        nonfinite.NonFiniteSteps(2).add(1, nonfinite.NonFinite.STATE)
    warns = nonfinite.NonFiniteSteps(0)
    caplog.clear()
    for step in range(1, 5):
        assert warns.add(step, nonfinite.NonFinite.STATE)
    with caplog.at_level(logging.WARNING):
        warns.add_counted(8, 3, 4, "seed 1: ")
        warns.add_counted(12, 0, 4, "seed 1: ")
    assert caplog.text.count("skipped") == 4 + 1  # (the per-step lines, then one window's)
    assert "seed 1: 3 of the 4 steps up to step 8 skipped" in caplog.text
    assert (warns.total, warns.finite_steps) == (7, 5)


def test_the_profiler_traces_the_steps_after_the_first_into_the_workdir(
    corpus_file, cache_dir, tmp_path, capsys
):
    """train.profile_steps=1 in a 3-step run: process 0 writes a jax.profiler trace of step 2
    (after the first, compiled, step) where TensorBoard's profile plugin reads it under
    WORKDIR/profile, and says where in one line; the default (0) writes none (test_train)."""
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{
            "train.total_steps": 3,
            "train.profile_steps": 1,
            "long_phase.fraction": 0.0,
            "optimizer.warmup_steps": 1,
        },
    )
    train.train_and_evaluate(config, str(tmp_path))
    profile = tmp_path / "profile"
    traces = list(profile.glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0, list(profile.rglob("*"))
    lines = [line for line in capsys.readouterr().out.splitlines() if "Profile" in line]
    assert lines == [
        f"Profile of steps 2-2: {profile} (view it with tensorboard --logdir {profile} and "
        "tensorboard-plugin-profile installed, or open its .trace.json.gz in "
        "https://ui.perfetto.dev)"
    ]
