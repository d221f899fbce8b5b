"""long_phase.restart_optimizer: the long phase starts as the original code's second
run_pretraining did (fresh Adam moments, a new warmup and linear decay over the phase), in
one run that stops and resumes bit for bit, and equal to the two-run original: a run of the
short phase, then a long-phase-only run with train.init_checkpoint from it."""

import os
import shutil

import jax
import numpy as np
import pytest

from bertjax import errors, train
from bertjax.training import schedules, sharded_run
from bertjax.training.settings import plan_phases
from test_guards import compilation_cache, saved_state  # noqa: F401 (autouse fixture)
from test_train import corpus_file, read_metrics, tiny_config  # noqa: F401 (fixture)

NO_DROPOUT = {"model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0}
RESTART = {
    "long_phase.restart_optimizer": True,
    "long_phase.restart_warmup_steps": 2,
    "long_phase.restart_peak_learning_rate": 1e-3,
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("restart_cache"))


def fit(config, workdir) -> None:
    train.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1])


@pytest.mark.slow  # (about 40 s of CPU: the `slow` stage of .ci/run)
def test_restart_resumes_exactly_and_equals_the_two_run_original(corpus_file, cache_dir, tmp_path):
    """16 steps, the long phase from step 13: the learning rate restarts there (warmup 2 to
    1e-3, decay to 0 at step 16). Resumed from the checkpoint at the switch (which holds
    phase 1's moments: the restart comes after it), the run logs the uninterrupted losses bit
    for bit. The last 4 steps equal a 4-step long-only run from the step-12 checkpoint."""
    config = tiny_config(corpus_file, cache_dir, **NO_DROPOUT, **RESTART)
    fit(config, tmp_path / "straight")
    straight = {m["step"]: m for m in read_metrics(tmp_path / "straight")}
    short_phase = schedules.bert_schedule(2e-3, 4, 12)  # decays to 0 at the switch
    assert straight[12]["learning_rate"] == pytest.approx(float(short_phase(11)))
    assert [straight[s]["learning_rate"] for s in (13, 14, 15, 16)] == pytest.approx(
        [0.0, 5e-4, 5e-4, 2.5e-4]
    )

    resumed = tmp_path / "resumed"  # as if stopped at the switch
    shutil.copytree(tmp_path / "straight", resumed)
    shutil.rmtree(resumed / "checkpoints" / "16")
    os.remove(resumed / "final_metrics.json")
    shutil.copytree(resumed, tmp_path / "first_run")
    fit(config, resumed)
    records = read_metrics(resumed)[16:]
    assert [m["step"] for m in records] == [13, 14, 15, 16]
    for m in records:
        assert (m["loss"], m["learning_rate"]) == (
            straight[m["step"]]["loss"],
            straight[m["step"]]["learning_rate"],
        ), m["step"]

    second = tiny_config(
        corpus_file,
        cache_dir,
        **NO_DROPOUT,
        **{
            "train.total_steps": 4,
            "long_phase.fraction": 1.0,
            "optimizer.warmup_steps": 2,
            "optimizer.peak_learning_rate": 1e-3,
            "train.init_checkpoint": str(tmp_path / "first_run"),
        },
    )
    fit(second, tmp_path / "second_run")
    two_runs = read_metrics(tmp_path / "second_run")
    assert [(m["loss"], m["learning_rate"]) for m in two_runs] == [
        (straight[s]["loss"], straight[s]["learning_rate"]) for s in (13, 14, 15, 16)
    ]
    ours, original = (
        jax.tree.leaves(saved_state(workdir, step)["params"])
        for workdir, step in ((resumed, 16), (tmp_path / "second_run", 4))
    )
    for a, b in zip(ours, original, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_restart_needs_two_phases_and_bert_adam(corpus_file):
    config = tiny_config(corpus_file, "", **RESTART)
    phases = plan_phases(config.train, config.data, config.long_phase)
    optimizer = sharded_run.pretraining_optimizer(
        config.optimizer, config.train.total_steps, config.long_phase, phases
    )
    assert (optimizer.restart_step, optimizer.restart_warmup_steps) == (12, 2)
    config.optimizer.name = "adamw"
    with pytest.raises(errors.ConfigError, match=r"needs optimizer\.name='bert_adam'"):
        sharded_run.pretraining_optimizer(
            config.optimizer, config.train.total_steps, config.long_phase, phases
        )
    config.optimizer.name = "bert_adam"
    config.long_phase.fraction = 0.0
    with pytest.raises(errors.ConfigError, match=r"set long_phase\.fraction between 0 and 1"):
        sharded_run.pretraining_optimizer(
            config.optimizer,
            config.train.total_steps,
            config.long_phase,
            plan_phases(config.train, config.data, config.long_phase),
        )
