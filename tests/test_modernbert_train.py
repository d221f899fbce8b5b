"""ModernBERT on the pretraining machinery (`config.model.family="modernbert"`,
configs/modernbert_tiny.py): its config's checks, its model FLOPs, its weight decay, and
(slow) a real run of `train.train_and_evaluate` that learns, stops and resumes exactly."""

import dataclasses
import json
import os
import runpy
import shutil
import subprocess
import sys

import flax.linen as nn
import numpy as np
import pytest

from bertjax import cli, convert, train
from bertjax.checkpoints import checkpoint, checkpoint_checks
from bertjax.errors import ConfigError
from bertjax.families import modernbert_hf
from bertjax.interop import pretrained, pretrained_weights, tree
from bertjax.models import attention, families, flops
from bertjax.models.bert.model import BertConfig
from bertjax.models.modernbert.config import ModernBertConfig
from bertjax.training import init_architecture, param_masks, validate
from test_modernbert import TINY, abstract, init
from test_train import cache_dir, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixtures)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILE = os.path.join(REPO_ROOT, "configs", "modernbert_tiny.py")
TINY_CONFIG_FILE = os.path.join(REPO_ROOT, "configs", "tiny.py")
modernbert_tiny = runpy.run_path(CONFIG_FILE)["get_config"]


def small_config(corpus_file: str, cache_dir: str):
    """configs/modernbert_tiny.py at test size, on the test corpus."""
    c = modernbert_tiny()
    c.model.update(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=2,
        max_position_embeddings=128,
        local_attention=16,
    )
    c.data.update(
        source="text",
        input_files=corpus_file,
        sentencepiece_vocab_size=512,
        max_seq_length=64,
        max_predictions_per_seq=20,
        dupe_factor=2,
        eval_fraction=0.1,
        cache_dir=cache_dir,
        num_workers=1,
    )
    c.long_phase.update(fraction=0.25, max_seq_length=128, max_predictions_per_seq=40)
    c.train.update(
        global_batch_size=16,
        total_steps=12,
        log_every=1,
        eval_every=0,
        eval_batches=2,
        checkpoint_every=4,
        keep_checkpoints=2,
        keep_every=0,
    )
    c.optimizer.update(peak_learning_rate=3e-3, warmup_steps=3)
    return c


def test_the_tiny_config_validates_and_documents_every_field():
    config = modernbert_tiny()
    validate.pretraining(config)
    assert isinstance(families.model_config(config.model.to_dict()), ModernBertConfig)
    names = set(ModernBertConfig.__dataclass_fields__)
    assert set(config.model) == names | {"family"}
    with open(CONFIG_FILE, encoding="utf-8") as f:
        settings = [line for line in f if line.strip().startswith("m.")]
    assert len(settings) == len(names) + 1 and all("  # " in line for line in settings)
    assert (config.data.masked_lm_prob, config.train.next_sentence_prediction) == (0.3, False)


def test_the_tiny_configs_attention_comment_names_the_window_kernels():
    """Every attention_impl whose sliding windows run its own kernel is named in the config's
    comment (it said windows run the einsum reference only; issue 42)."""
    with open(CONFIG_FILE, encoding="utf-8") as f:
        text = f.read()
    comment = text[text.index("# The sliding-window layers") : text.index("m.attention_impl")]
    for impl in attention.ATTENTION_IMPLS:
        if impl != "auto" and attention.window_impl(impl, half_window=8) == impl:
            assert impl in comment, impl


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("train.next_sentence_prediction", True, "next_sentence_prediction=False"),
        ("train.objective", "ltr", "objective=mlm"),
        ("model.family", "gpt", "model.family='gpt' is not one of 'bert', 'modernbert'"),
        ("model.local_attention", 0, "model.local_attention=0 is out of range"),
    ],
)
def test_what_a_modernbert_run_refuses(field, value, words):
    config = modernbert_tiny()
    section, name = field.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError, match=words) as error:
        validate.pretraining(config)
    assert "\n" not in str(error.value)


def test_a_family_whose_config_section_is_the_other_familys_names_its_configs():
    """model.family=bert on configs/modernbert_tiny.py was a KeyError traceback; a BERT
    config given model.family=modernbert named only its fields: both are one line naming the
    family's config files (issue 42)."""
    config = modernbert_tiny()
    config.model.family = "bert"
    with pytest.raises(
        ConfigError,
        match=r"model.family='bert' but the model section holds "
        r"ModernBERT's fields .*configs/tiny.py, configs/base.py",
    ) as error:
        validate.pretraining(config)
    assert "\n" not in str(error.value)
    problem = cli.config_argument_error(
        ["train", f"--config={TINY_CONFIG_FILE}", "--config.model.family=modernbert"]
    )
    assert "is a BERT config" in problem and "configs/modernbert_tiny.py" in problem


def test_bert_configs_are_checked_as_before():
    config = tiny_config("corpus.txt", "")
    config.model.attention_probs_dropout_prob = 1.0
    with pytest.raises(ConfigError, match=r"model\.attention_probs_dropout_prob=1\.0"):
        validate.pretraining(config)
    assert "family" not in families.recorded_fields(families.model_config(config.model))


def test_model_flops_count_the_geglu_and_the_windows():
    # 4 layers (global: 0, 3), S=10, window 2 * (4 // 2) + 1 = 5 keys, H=16, I=24, V=40, P=3.
    s, h, i, v, p = 10, 16, 24, 40, 3
    expected = (
        6 * s * 4 * (4 * h * h + 3 * h * i)
        + 12 * h * s * (10 + 5 + 5 + 10)
        + 6 * p * (h * h + h * v)
    )
    assert flops.train_flops_per_sequence(TINY, s, p) == expected


def test_weight_decay_spares_norms_and_biases():
    config = ModernBertConfig(**{**TINY.__dict__, "norm_bias": True, "mlp_bias": True})
    mask = tree.flatten(param_masks.decay_mask(nn.meta.unbox(abstract(config))))
    spared = sorted(path for path, decayed in mask.items() if not decayed)
    assert all(path.endswith(("/bias", "/scale")) for path in spared)
    assert "model/layer_1/attn_norm/scale" in spared and "model/final_norm/bias" in spared
    assert "decoder/bias" in spared and mask["model/embeddings/tok_embeddings"]
    assert all(mask[path] for path in mask if path.endswith("/kernel"))


def modernbert_checkpoint(path, config: ModernBertConfig = TINY) -> dict:
    """A params-only bertjax checkpoint of a random ModernBERT, recorded as a run records it;
    returns the params."""
    params = init(config)
    checkpoint.save_params(
        str(path),
        params,
        {"model": families.recorded_fields(config)},
    )
    return params


def test_convert_exports_a_modernbert_checkpoint_to_hugging_face(tmp_path, capsys):
    params = modernbert_checkpoint(tmp_path / "run")
    assert convert.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    config, exported = modernbert_hf.load_hf(str(tmp_path / "hf"))
    assert config == TINY
    for path, value in tree.flatten(params).items():
        np.testing.assert_array_equal(tree.flatten(exported)[path], value, err_msg=path)
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "ModernBertForMaskedLM.from_pretrained" in card and "ModernBERT, 4 layers" in card
    capsys.readouterr()
    assert convert.main([str(tmp_path / "run"), str(tmp_path / "tf"), "--to=tf"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "which has no TF form" in error
    assert "\n" not in error


def test_a_resumed_run_whose_init_checkpoint_has_gone_keeps_its_own_model(tmp_path):
    """The model of a run from init_checkpoint is the checkpoint's; resumed after the
    checkpoint has gone, the run's own checkpoints give it (else the config file's model
    would not match the one it recorded); a new run refuses the missing path."""
    modernbert_checkpoint(tmp_path / "run" / "checkpoints")
    config = modernbert_tiny()
    config.train.init_checkpoint = str(tmp_path / "gone")
    model = config.model.to_dict()
    model.update(
        init_architecture.model_of_init_checkpoint(
            model, config.train.init_checkpoint, str(tmp_path / "run"), ()
        )
    )
    assert families.model_config(model) == dataclasses.replace(TINY, dtype="float32")
    with pytest.raises(pretrained.PretrainedError, match=r"gone'? does not exist"):
        init_architecture.model_of_init_checkpoint(
            model, config.train.init_checkpoint, str(tmp_path / "new"), ()
        )


def test_bert_runs_refuse_a_modernbert_checkpoint(tmp_path):
    modernbert_checkpoint(tmp_path / "run")
    source = pretrained.Source(init_checkpoint=str(tmp_path / "run"))
    assert pretrained.model_config_of(
        source, pretrained.pretraining_run(source)
    ) == dataclasses.replace(TINY, remat_policy="none")  # (a fine-tuning run's model)
    abstract_bert = {"bert": {}}
    with pytest.raises(
        tree.ConversionError,
        match="holds a ModernBERT model but the run's "
        "model is BERT: start from a ModernBERT config, configs/modernbert_",
    ) as error:
        pretrained_weights.load_pretrained(str(tmp_path / "run"), abstract_bert, BertConfig())
    assert "\n" not in str(error.value)


@pytest.mark.slow  # three tiny runs: about a minute of CPU
def test_pretrains_and_resumes_exactly(corpus_file, cache_dir, tmp_path):
    """The MLM-only run learns and exports to Hugging Face with its tokenizer; one stopped at
    step 5, which lost its step-5 checkpoint, resumes from step 4 with every logged loss
    equal to the uninterrupted run's, bit for bit; its checkpoint records the family, and a
    BERT config is refused in its workdir."""
    config = small_config(corpus_file, cache_dir)
    final = train.train_and_evaluate(config, str(tmp_path / "straight"))
    straight = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "straight")}
    assert np.mean([straight[s] for s in (10, 11, 12)]) < np.mean([straight[s] for s in (1, 2, 3)])
    assert "nsp_loss" not in final and final["mlm_accuracy"] > 0
    assert convert.main([str(tmp_path / "straight"), str(tmp_path / "hf")]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(
        os.listdir(tmp_path / "hf")
    )
    assert modernbert_hf.load_hf(str(tmp_path / "hf"))[0] == families.model_config(
        config.model.to_dict()
    )
    resumed = tmp_path / "resumed"
    config.train.stop_after_steps = 5
    train.train_and_evaluate(config, str(resumed))
    shutil.rmtree(resumed / "checkpoints" / "5")
    config.train.stop_after_steps = 0
    train.train_and_evaluate(config, str(resumed))
    records = read_metrics(resumed)
    assert [m["step"] for m in records] == list(range(1, 6)) + list(range(5, 13))
    for m in records:
        assert m["loss"] == straight[m["step"]], (m["step"], m["loss"], straight[m["step"]])
    meta = checkpoint.read_meta(str(resumed / "checkpoints"))
    assert meta["model"]["family"] == "modernbert"
    bert = small_config(corpus_file, cache_dir)  # (the same schedule: only the model differs)
    bert.model = tiny_config(corpus_file, cache_dir).model
    with pytest.raises(checkpoint_checks.CheckpointMismatch, match="different model"):
        train.train_and_evaluate(bert, str(resumed))


@pytest.mark.slow  # a subprocess compiling the sharded step: about 30 s of CPU
def test_aot_compiles_the_modernbert_step_for_fake_devices(tmp_path):
    out = tmp_path / "aot.json"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("XLA_FLAGS", None)  # the tool sets its own device count
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.tools.aot",
            "--config=configs/modernbert_tiny.py",
            f"--out={out}",
            "--num_devices=8",
            "--config.mesh.data=2",
            "--config.mesh.fsdp=2",
            "--config.mesh.tensor=2",
            "--config.model.num_hidden_layers=2",
            "--config.model.hidden_size=32",
            "--config.model.intermediate_size=48",
            "--config.model.vocab_size=512",
            "--config.train.global_batch_size=16",
            "--config.long_phase.fraction=0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(
        "cpu x8 (cpu, 8 devices), mesh data=2 fsdp=2 tensor=2, attention einsum"
    )
    details = json.loads(out.read_text())
    assert "model/layer_*/attn/Wqkv/kernel" in details["startup_report"]
    config = ModernBertConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=512,
        local_attention=64,
        pad_token_id=0,
    )
    assert (
        details["phases"]["short"]["model_flops_per_device"]
        == flops.train_flops_per_sequence(config, 128, 40) * 16 / 8
    )


@pytest.mark.slow  # a one-step run: about 20 s of CPU
def test_a_run_starts_from_a_modernbert_checkpoint(corpus_file, cache_dir, tmp_path):
    """`train.init_checkpoint` of the same architecture: the run's first step starts from its
    weights (random normals of stddev 0.3, far from the run's own initialisation)."""
    config = small_config(corpus_file, cache_dir)
    config.long_phase.fraction = 0.0
    config.train.update(total_steps=1, checkpoint_every=1, eval_batches=1)
    config.optimizer.warmup_steps = 1
    start = modernbert_checkpoint(tmp_path / "start", families.model_config(config.model.to_dict()))
    config.train.init_checkpoint = str(tmp_path / "start")
    train.train_and_evaluate(config, str(tmp_path / "run"))
    after = tree.flatten(
        checkpoint.restore_params(
            str(tmp_path / "run" / "checkpoints"),
            checkpoint.stored_params(str(tmp_path / "run" / "checkpoints")),
        )
    )
    for path, value in tree.flatten(start).items():  # one step of at most the peak rate
        np.testing.assert_allclose(np.asarray(after[path]), value, atol=5e-3, err_msg=path)
