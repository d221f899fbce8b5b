"""The modern recipe's optimizer and schedule (bertjax.training.optim): StableAdamW against a numpy
re-implementation of Wortsman et al. 2023's Algorithm 2, the warmup-stable-decay schedule's
values, their config checks, and (slow) a ModernBERT run on them killed with -9 that resumes
to the uninterrupted run's losses."""

import json
import os
import runpy
import signal
import sys

import jax
import ml_collections
import numpy as np
import pytest

import test_faults
from bertjax.checkpoints.run_record import RunRecord
from bertjax.errors import ConfigError
from bertjax.training import optim, run_schedule, schedules, validate
from test_modernbert_train import CONFIG_FILE, modernbert_tiny, small_config
from test_optim import _flat, _params, _run
from test_train import corpus_file, read_metrics  # noqa: F401 (fixture)

B1, B2, EPS, WD = 0.9, 0.98, 1e-6, 0.01
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**overrides) -> optim.OptimizerConfig:
    values = dict(
        name="stable_adamw",
        peak_learning_rate=1e-2,
        warmup_steps=2,
        total_steps=8,
        weight_decay_rate=WD,
        b1=B1,
        b2=B2,
        eps=EPS,
        clip_global_norm=0.0,
        schedule="wsd",
        decay_fraction=0.5,
        decay_shape="linear",
    )
    return optim.OptimizerConfig(**{**values, **overrides})


def _grads(spike_at: int | None) -> list[dict]:
    """Eight steps of gradients; at `spike_at`, one hundred times larger."""
    rng = np.random.default_rng(7)
    grads = []
    for step in range(8):
        scale = 100.0 if step == spike_at else 1.0
        grads.append(
            jax.tree.map(
                lambda p: (scale * 1e-2 * rng.normal(size=p.shape)).astype(np.float32),  # noqa: B023 (called within this iteration)
                _params(),
            )
        )
    return grads


def _decayed(name: str) -> bool:
    return not any(word in name for word in ("LayerNorm", "bias"))


def _reference_stable_adamw(params, grads_per_step, lrs):
    """Algorithm 2 of Wortsman et al. 2023 in float64: bias-corrected Adam moments, the
    per-tensor RMS of g^2 / max(v_hat, eps^2), the step (decay included) divided by
    max(1, RMS). Returns the flat params and the largest RMS seen."""
    params = _flat(params)
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    largest = 0.0
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        for name, g in _flat(grads).items():
            m[name] = B1 * m[name] + (1 - B1) * g
            v[name] = B2 * v[name] + (1 - B2) * g**2
            m_hat, v_hat = m[name] / (1 - B1**t), v[name] / (1 - B2**t)
            rms = np.sqrt(np.mean(g**2 / np.maximum(v_hat, EPS**2)))
            largest = max(largest, rms)
            update = m_hat / (np.sqrt(v_hat) + EPS) + (WD * params[name] if _decayed(name) else 0)
            params[name] = params[name] - lr / max(1.0, rms) * update
    return params, largest


def test_stable_adamw_is_wortsmans_algorithm_and_clips_a_spike():
    """Eight steps with a gradient spike at step 5: the jitted optimizer equals the float64
    reference within 1e-6; the spike made the reference clip (RMS > 1), and plain AdamW
    lands elsewhere."""
    config, grads = _config(), _grads(spike_at=5)
    lrs = [schedules.learning_rate_at(config, step) for step in range(8)]
    actual = _flat(_run(optim.make_optimizer(config), _params(), grads))
    expected, largest = _reference_stable_adamw(_params(), grads, lrs)
    assert largest > 2  # (clipped by more than half)
    for name, value in actual.items():
        np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-6, err_msg=name)
    adamw = _flat(_run(optim.make_optimizer(_config(name="adamw")), _params(), grads))
    assert not np.allclose(adamw["layer/dense/kernel"], actual["layer/dense/kernel"], atol=1e-4)


def test_stable_adamw_without_a_spike_is_adamw():
    """Gradients that repeat (g^2 equals its second moment: RMS = 1) are never clipped:
    StableAdamW then equals optax's AdamW with the same decay mask, within 1e-6."""
    same = _grads(spike_at=None)[:1] * 8
    config = _config()
    stable = _flat(_run(optim.make_optimizer(config), _params(), same))
    adamw = _flat(_run(optim.make_optimizer(_config(name="adamw")), _params(), same))
    for name, value in stable.items():
        np.testing.assert_allclose(value, adamw[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("shape, at_half_decay", [("linear", 0.5), ("1-sqrt", 1 - 0.5**0.5)])
def test_wsd_warms_up_holds_and_decays_to_zero(shape, at_half_decay):
    """100 steps, warmup 10, the last 20 decaying: linear to the peak, the peak from step 10
    to 80, then down to 0 at step 100 (half way: 0.5 or 1 - sqrt(0.5) of the peak)."""
    schedule = jax.jit(schedules.wsd_schedule(2e-3, 10, 100, decay_fraction=0.2, decay_shape=shape))
    values = np.asarray(schedule(np.arange(101)), np.float64) / 2e-3
    np.testing.assert_allclose(values[:11], np.arange(11) / 10, atol=1e-6)
    np.testing.assert_allclose(values[10:81], 1.0, atol=1e-6)
    np.testing.assert_allclose(values[90], at_half_decay, atol=1e-6)
    assert values[100] == 0 and np.all(np.diff(values[80:]) < 0)


def _pretraining_config() -> ml_collections.ConfigDict:
    return runpy.run_path(os.path.join(REPO_ROOT, "configs", "modernbert_tiny.py"))["get_config"]()


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("optimizer.schedule", "cosine", "optimizer.schedule='cosine' is not one of"),
        ("optimizer.decay_shape", "sqrt", "optimizer.decay_shape='sqrt' is not one of"),
        ("optimizer.decay_fraction", 1.5, "optimizer.decay_fraction=1.5 is out of range"),
    ],
)
def test_bad_schedule_settings_are_one_line(field, value, words):
    config = _pretraining_config()
    config.optimizer[field.split(".")[1]] = value
    with pytest.raises(ConfigError, match=words):
        validate.pretraining(config)


def test_wsd_refuses_the_optimizer_restart():
    config = runpy.run_path(os.path.join(REPO_ROOT, "configs", "tiny.py"))["get_config"]()
    config.optimizer.schedule = "wsd"
    config.long_phase.restart_optimizer = True
    with pytest.raises(ConfigError, match="restart_optimizer=True restarts BERT's linear"):
        validate.pretraining(config)


def test_a_checkpoint_from_before_the_schedule_fields_resumes_on_its_schedule():
    """A checkpoint whose recorded config has no optimizer.schedule (written before it
    existed) resumes under a config at the defaults; one that asks for "wsd" is refused."""
    config = runpy.run_path(os.path.join(REPO_ROOT, "configs", "tiny.py"))["get_config"]()
    plan = run_schedule.planned(validate.settings(config), config.optimizer)
    old = json.loads(config.to_json())
    for field in ("schedule", "decay_fraction", "decay_shape"):
        del old["optimizer"][field]
    meta = RunRecord.of({"config": json.dumps(old), "schedule": plan.record()})
    resumed = run_schedule.resumed(meta, "ckpt/8", validate.settings(config), config.optimizer)
    assert resumed == plan
    config.optimizer.schedule = "wsd"
    with pytest.raises(
        run_schedule.ScheduleChanged, match=r"optimizer\.schedule: 'linear' -> 'wsd'"
    ):
        run_schedule.resumed(meta, "ckpt/8", validate.settings(config), config.optimizer)


def test_another_optimizer_is_refused_on_resume_also_when_extending():
    """Issue 43: `optimizer.name=adamw` on resuming a StableAdamW run was accepted silently."""
    config = _pretraining_config()
    plan = run_schedule.planned(validate.settings(config), config.optimizer)
    meta = RunRecord.of({"config": config.to_json(), "schedule": plan.record()})
    config.optimizer.name = "adamw"
    for extend in (False, True):
        config.train.extend = extend
        config.train.total_steps += extend
        with pytest.raises(
            run_schedule.ScheduleChanged,
            match=(
                r"^checkpoint ckpt/8 was trained with optimizer.name='stable_adamw', and this "
                r"run asks for 'adamw': .* Rerun with --config.optimizer.name=stable_adamw"
            ),
        ):
            run_schedule.resumed(meta, "ckpt/8", validate.settings(config), config.optimizer)


@pytest.mark.slow  # three tiny runs in subprocesses: about 1.5 minutes of CPU
def test_a_modernbert_run_on_the_recipe_killed_with_9_resumes_exactly(corpus_file, tmp_path):
    """configs/modernbert_tiny.py (StableAdamW, warmup-stable-decay) at test size, killed with
    -9 once its step-8 checkpoint was announced and a later step logged: the rerun of the same
    command resumes from step 8 and logs every loss of the uninterrupted run, bit for bit."""
    config = small_config(corpus_file, str(tmp_path / "cache"))
    defaults = modernbert_tiny()
    flags = [
        f"--config.{section}.{field}={value}"
        for section in config
        for field, value in config[section].items()
        if value != defaults[section][field]
    ]

    def command(workdir: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "bertjax.train",
            f"--config={CONFIG_FILE}",
            f"--workdir={workdir}",
            *flags,
        ]

    test_faults.run_to_end(command(str(tmp_path / "straight")))
    straight = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "straight")}
    killed = str(tmp_path / "killed")
    trainer = test_faults.Trainer(command(killed))
    trainer.wait_for("checkpoint step 8 -> ")
    trainer.wait_for(r"step (9|1[0-2])/12 ")
    trainer.proc.send_signal(signal.SIGKILL)
    assert trainer.finish() == -signal.SIGKILL
    output = test_faults.run_to_end(command(killed))
    assert test_faults.resumed_step(output) == 8, output
    records = read_metrics(killed)
    assert records[-1]["step"] == 12
    for m in records:
        assert m["loss"] == straight[m["step"]], (m["step"], m["loss"], straight[m["step"]])
