"""Model FLOPs (the issue's formula, checked against hand computations) and the peak table."""

import os
import runpy

import pytest

from bertjax.models import flops
from bertjax.models.bert.model import BertConfig
from bertjax.training import nonfinite, optim, reporting
from bertjax.training.settings import plan_phases

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
base_config = runpy.run_path(os.path.join(REPO_ROOT, "configs", "base.py"))["get_config"]


def test_train_flops_tiny_by_hand():
    # BERT-tiny: S=128, L=2, H=128, I=512, P=20, V=8000.
    #   6*128*2*(4*128^2 + 2*128*512) = 1536 * 196608        = 301,989,888
    #   12*2*128*128^2                = 24 * 128 * 16384      =  50,331,648
    #   6*20*(128^2 + 128*8000)       = 120 * 1,040,384       = 124,846,080
    #   6*(128^2 + 2*128)             = 6 * 16640             =      99,840
    config = BertConfig(
        vocab_size=8000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
    )
    assert flops.train_flops_per_sequence(config, 128, 20) == 477_267_456


def test_train_flops_base_by_hand():
    # BERT-base at 512 with 80 predictions: S=512, L=12, H=768, I=3072, V=30522.
    #   6*512*12*(4*768^2 + 2*768*3072) = 36864 * 7,077,888   = 260,919,263,232
    #   12*12*768*512^2                 = 110592 * 262144     =  28,991,029,248
    #   6*80*(768^2 + 768*30522)        = 480 * 24,030,720    =  11,534,745,600
    #   6*(768^2 + 2*768)               = 6 * 591,360         =       3,548,160
    assert flops.train_flops_per_sequence(BertConfig(), 512, 80) == 301_448_586_240


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("TPU v4", 275.0),
        ("TPU v5 lite", 197.0),
        ("TPU v5", 459.0),
        ("TPU v5p", 459.0),
        ("TPU v6 lite", 918.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H200", 989.0),
        ("cpu", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_table(kind, peak):
    assert flops.peak_tflops(kind) == peak


def test_mfu():
    assert flops.mfu(0.5 * 4 * 989e12, 4, 989.0) == pytest.approx(0.5)
    assert flops.mfu(1e12, 1, None) is None


def test_training_progress_logs_model_flops(capsys):
    config = base_config()
    config.train.log_every, config.train.total_steps = 1, 10
    phases = plan_phases(config.train, config.data, config.long_phase)
    progress = reporting.Progress(
        phases,
        nonfinite.NonFiniteSteps(config.train.max_nonfinite_steps, 0),
        optim.optimizer_config(config.optimizer, config.train.total_steps),
        BertConfig.from_dict(config.model.to_dict()),
        None,
        0,
        None,
    )
    phase = phases[0]
    metrics = {
        "nonfinite": 0.0,
        "grad_norm": 1.0,
        "mlm_loss_sum": 1.0,
        "mlm_correct_sum": 0.0,
        "mlm_weight_sum": 1.0,
        "nsp_loss_sum": 1.0,
        "nsp_correct_sum": 0.0,
        "nsp_count": 1.0,
    }
    progress.add(1, metrics, tokens=256 * 128)
    means = progress.report(1, phase)
    per_token = flops.train_flops_per_sequence(BertConfig(), 128, 20) / 128
    assert means["model_tflops_per_second"] == pytest.approx(
        means["tokens_per_second"] * per_token / 1e12
    )
    assert "mfu" not in means  # CPU: no peak in the table
    assert "TFLOP/s" in capsys.readouterr().out
