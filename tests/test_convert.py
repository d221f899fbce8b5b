"""Checkpoint conversion without torch or TensorFlow: Google TF, Hugging Face (safetensors)
and bertjax round trips, the CLI, the real BERT-Tiny index mapping (opt-in), scan layout,
`train.init_checkpoint` from a TF checkpoint, and the errors for bad inputs."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from bertjax import convert
from bertjax.families import bert_hf, bert_tf as tf_checkpoint
from bertjax.interop import native, pretrained, pretrained_weights, tf_bundle, tokenizer_fit, tree
from bertjax.models.bert.model import BertConfig, BertForPreTraining
from test_interop_tf import BERT_TINY_INDEX

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = BertConfig(
    vocab_size=40,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=24,
    max_position_embeddings=32,
)


def random_params(config: BertConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return tree.unflatten(
        {p: rng.normal(size=s).astype(np.float32) for p, s in tree.param_shapes(config).items()}
    )


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def write_google_checkpoint(
    directory, config: BertConfig, params: dict, vocab_lines: int | None = None
):
    """What Google's pretraining leaves: weights, Adam slots, global_step, config, vocab."""
    tf_checkpoint.save_tf(config, params, str(directory))
    prefix = str(directory / "bert_model.ckpt")
    reader = tf_bundle.BundleReader(prefix)
    tensors = {name: reader.read(name) for name in reader.entries}
    for name in list(tensors):
        tensors[name + "/adam_m"] = tensors[name + "/adam_v"] = np.zeros_like(tensors[name])
    tensors["global_step"] = np.array(1000, np.int64)
    tf_bundle.write_bundle(prefix, tensors)
    lines = config.vocab_size if vocab_lines is None else vocab_lines
    (directory / "vocab.txt").write_text("".join(f"tok{i}\n" for i in range(lines)))


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "bertjax.convert", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        timeout=300,
        check=False,
    )


def test_tf_to_bertjax_to_hf_command_line(tmp_path):
    """TF -> bertjax -> Hugging Face on the command line: weights exact, the vocabulary
    carried along, a tokenizer config and model card in the export, ordinary file modes."""
    params = random_params(CONFIG)
    src = tmp_path / "uncased_L-2_H-16_A-2"
    write_google_checkpoint(src, CONFIG, params)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"tok{i}" for i in range(35)]
    (src / "vocab.txt").write_text("".join(f"{token}\n" for token in vocab))
    result = run_cli(str(src), str(tmp_path / "bertjax"))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and not result.stderr.strip(), result.stderr
    assert "tokenizer (WordPiece, lower-cased): vocab.txt" in result.stdout
    assert (
        "Google TF checkpoint, 139 tensors; 46 mapped to bertjax parameters, 93 skipped"
        in result.stdout
    )
    assert "skipped (optimizer slot): bert/embeddings/LayerNorm/beta/adam_m" in result.stdout
    assert "skipped (training step counter): global_step" in result.stdout
    config, loaded = pretrained.read(str(tmp_path / "bertjax"))
    assert config == CONFIG
    assert_trees_equal(loaded, params)
    assert main_ok(str(tmp_path / "bertjax"), str(tmp_path / "hf"))  # default: bertjax -> hf
    assert pretrained.detect_format(str(tmp_path / "hf")) == "hf"
    assert_trees_equal(bert_hf.load_hf(str(tmp_path / "hf"))[1], params)
    exported = tmp_path / "hf"
    assert (exported / "vocab.txt").read_text().split() == vocab
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (exported / "tokenizer.json").exists()
    assert config["do_lower_case"] is True
    assert config["model_max_length"] == CONFIG.max_position_embeddings
    card = (exported / "README.md").read_text()
    assert "| architecture | BERT, 2 layers, hidden 16, 2 heads" in card
    assert f"| parameters | {sum(np.size(v) for v in tree.flatten(params).values()):,} |" in card
    assert "| tokenizer | WordPiece, lower-cased, 40 tokens (`vocab.txt`) |" in card
    umask = os.umask(0)
    os.umask(umask)
    assert {
        name: os.stat(exported / name).st_mode & 0o777 for name in os.listdir(exported)
    } == dict.fromkeys(os.listdir(exported), 0o666 & ~umask)


def test_round_trips_are_exact(tmp_path):
    params = random_params(CONFIG, seed=1)
    bert_hf.save_hf(CONFIG, params, str(tmp_path / "hf"))
    config, from_hf = bert_hf.load_hf(str(tmp_path / "hf"))
    assert config == CONFIG
    assert_trees_equal(from_hf, params)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    np.testing.assert_array_equal(  # PyTorch Linear weights are [out, in]
        weights["bert.encoder.layer.1.intermediate.dense.weight"],
        params["bert"]["encoder"]["layer_1"]["intermediate"]["dense"]["kernel"].T,
    )
    assert main_ok(str(tmp_path / "hf"), str(tmp_path / "tf"), "--to=tf")
    assert_trees_equal(tf_checkpoint.load_tf(str(tmp_path / "tf"))[1], params)
    assert main_ok(str(tmp_path / "tf"), str(tmp_path / "scanned"), "--scan_layers")
    config, from_scanned = native.load_bertjax(str(tmp_path / "scanned"))
    assert config == CONFIG
    assert_trees_equal(from_scanned, params)


def main_ok(*argv) -> bool:
    return convert.main(list(argv)) == 0


def test_scan_layout_and_init_params(tmp_path):
    params = random_params(CONFIG, seed=2)
    stacked = tree.stack_layers(params)
    assert stacked["bert"]["encoder"]["layers"]["output"]["dense"]["kernel"].shape == (2, 24, 16)
    assert_trees_equal(tree.unstack_layers(stacked), params)
    write_google_checkpoint(tmp_path / "tf", CONFIG, params)
    native.save_bertjax(CONFIG, params, str(tmp_path / "bertjax"))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for run_config in (CONFIG, dataclasses.replace(CONFIG, scan_layers=True)):
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
            tree.abstract_params(run_config),
        )
        expected = stacked if run_config.scan_layers else params
        for source in ("tf", "bertjax"):
            assert_trees_equal(
                pretrained_weights.load_pretrained(str(tmp_path / source), abstract, run_config),
                expected,
            )
    wrong = dataclasses.replace(CONFIG, num_attention_heads=4)
    with pytest.raises(
        tree.ConversionError, match=r"num_attention_heads: checkpoint 2, config\.model 4"
    ):
        pretrained_weights.load_pretrained(str(tmp_path / "tf"), abstract, wrong)


def test_real_bert_tiny_index_maps_completely():
    """Every variable of Google's BERT-Tiny checkpoint maps to a bertjax parameter of the
    shape its bert_config.json implies, and nothing is left over."""
    if not os.path.exists(BERT_TINY_INDEX):
        pytest.skip("shared/data/bert-tiny not present")
    reader = tf_bundle.BundleReader(BERT_TINY_INDEX[: -len(".index")])
    config = BertConfig.from_json_file(
        os.path.join(os.path.dirname(BERT_TINY_INDEX), "bert_config.json")
    )
    expected = tree.param_shapes(config)
    mapped = {
        tf_checkpoint.tf_to_path(name): entry.shape
        for name, entry in reader.entries.items()
        if tf_checkpoint.skip_reason(name) is None
    }
    assert len(reader.entries) == len(mapped) == len(expected) == 46
    assert mapped == expected
    assert {tf_checkpoint.path_to_tf(p) for p in expected} == set(reader.entries)
    tree.check_vocab_file(os.path.dirname(BERT_TINY_INDEX), config)  # 30522 lines


def test_bad_checkpoints_get_clear_errors(tmp_path, capsys):
    params = random_params(CONFIG)
    write_google_checkpoint(tmp_path / "ok", CONFIG, params)
    # bert_config.json that does not describe the weights.
    write_google_checkpoint(tmp_path / "wide", CONFIG, params)
    (tmp_path / "wide" / "bert_config.json").write_text(
        json.dumps(
            {
                **json.loads((tmp_path / "ok" / "bert_config.json").read_text()),
                "intermediate_size": 32,
            }
        )
    )
    with pytest.raises(
        tree.ConversionError,
        match=r"weight bert/encoder/layer_0/intermediate/dense/bias has shape \(24,\), "
        r"but the config .* implies \(32,\)",
    ):
        tf_checkpoint.load_tf(str(tmp_path / "wide"))
    write_google_checkpoint(
        tmp_path / "deep",
        dataclasses.replace(CONFIG, num_hidden_layers=3),
        random_params(dataclasses.replace(CONFIG, num_hidden_layers=3)),
    )
    (tmp_path / "deep" / "bert_config.json").write_text(
        (tmp_path / "ok" / "bert_config.json").read_text()
    )
    with pytest.raises(
        tree.ConversionError, match="not in a model of that config: bert/encoder/layer_2/"
    ):
        tf_checkpoint.load_tf(str(tmp_path / "deep"))
    write_google_checkpoint(tmp_path / "vocab", CONFIG, params, vocab_lines=CONFIG.vocab_size + 1)
    with pytest.raises(
        tree.ConversionError,
        match=r"vocab\.txt has 41 tokens but the checkpoint's vocab_size is 40",
    ):
        tf_checkpoint.load_tf(str(tmp_path / "vocab"))
    os.remove(tmp_path / "vocab" / "bert_model.ckpt.data-00000-of-00001")
    with pytest.raises(tree.ConversionError, match=r"bert_model\.ckpt\.data-00000-of-00001"):
        tf_checkpoint.load_tf(str(tmp_path / "vocab"))
    os.remove(tmp_path / "ok" / "bert_config.json")
    with pytest.raises(tree.ConversionError, match=r"bert_config\.json not found"):
        tf_checkpoint.load_tf(str(tmp_path / "ok"))

    bert_hf.save_hf(CONFIG, params, str(tmp_path / "hf"))
    weights_file = tmp_path / "hf" / "model.safetensors"
    weights = load_file(str(weights_file))
    untied = weights["bert.embeddings.word_embeddings.weight"] + 1
    save_file(
        {**weights, "cls.predictions.decoder.weight": untied},
        str(weights_file),
        metadata={"format": "pt"},
    )
    with pytest.raises(tree.ConversionError, match=r"cls\.predictions\.decoder\.weight differs"):
        bert_hf.load_hf(str(tmp_path / "hf"))
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    with pytest.raises(tree.ConversionError, match=r"model\.safetensors .*truncated"):
        bert_hf.load_hf(str(tmp_path / "hf"))

    (tmp_path / "junk").mkdir()
    with pytest.raises(tree.ConversionError, match="cannot tell the checkpoint format"):
        pretrained.detect_format(str(tmp_path / "junk"))
    assert convert.main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing' does not exist" in err


def test_case_and_vocab_checks(tmp_path):
    tokenizer_fit.validate_case(str(tmp_path / "uncased_L-12_H-768_A-12"), do_lower_case=True)
    with pytest.raises(
        tree.ConversionError, match=r"is a cased model but data\.do_lower_case=True"
    ):
        tokenizer_fit.validate_case(
            str(tmp_path / "multi_cased_L-12_H-768_A-12"), do_lower_case=True
        )
    with pytest.raises(
        tree.ConversionError, match=r"is an uncased model but data\.do_lower_case=False"
    ):
        tokenizer_fit.validate_case(str(tmp_path / "bert-base-uncased"), do_lower_case=False)
    # fine-tuning's flag is --config.do_lower_case (no data section): the message names it
    with pytest.raises(
        tree.ConversionError,
        match=r"is an uncased model but do_lower_case=False; "
        r"set --config.do_lower_case=True$",
    ):
        tokenizer_fit.validate_case(
            str(tmp_path / "bert-base-uncased"),
            do_lower_case=False,
            case_flag="--config.do_lower_case",
        )
    cased_vocab = tmp_path / "vocab.txt"
    cased_vocab.write_text("[PAD]\n[UNK]\n" + "".join(f"Word{i}\nword{i}\n" for i in range(200)))
    tokenizer_fit.validate_case(
        str(tmp_path / "model"), do_lower_case=False, vocab_file=str(cased_vocab)
    )
    with pytest.raises(
        tree.ConversionError, match=r"is a cased vocab \(200 tokens with upper-case"
    ):
        tokenizer_fit.validate_case(
            str(tmp_path / "model"), do_lower_case=True, vocab_file=str(cased_vocab)
        )


def test_checkpoint_written_by_tensorflow_saver(tmp_path):
    """Opt-in (needs TensorFlow): a checkpoint written by TF1's Saver with Google's variable
    names, Adam slots and global_step, as run_pretraining.py leaves it, loads exactly; and
    TensorFlow reads what save_tf writes."""
    tf = pytest.importorskip("tensorflow")
    params = random_params(CONFIG, seed=3)
    tensors = {tf_checkpoint.path_to_tf(p): v for p, v in tree.flatten(params).items()}
    with tf.Graph().as_default():
        variables = [tf.Variable(v, name=n) for n, v in tensors.items()]
        variables += [tf.Variable(np.ones_like(v), name=n + "/adam_m") for n, v in tensors.items()]
        variables.append(tf.Variable(np.int64(7), name="global_step"))
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            tf.compat.v1.train.Saver(variables).save(
                session, str(tmp_path / "google" / "bert_model.ckpt")
            )
    tf_checkpoint.save_tf(CONFIG, params, str(tmp_path / "ours"))
    shutil.copy(tmp_path / "ours" / "bert_config.json", tmp_path / "google" / "bert_config.json")
    report = tree.LoadReport()
    config, loaded = tf_checkpoint.load_tf(str(tmp_path / "google"), report)
    assert config == CONFIG and report.mapped == 46 and len(report.skipped) == 47
    assert_trees_equal(loaded, params)
    reader = tf.train.load_checkpoint(str(tmp_path / "ours" / "bert_model.ckpt"))
    assert reader.get_variable_to_shape_map() == {n: list(v.shape) for n, v in tensors.items()}
    for name, value in tensors.items():
        np.testing.assert_array_equal(reader.get_tensor(name), value)


def test_stacked_params_compute_the_same_in_a_scanned_model():
    """stack_layers gives a scanned model the unrolled model's function; both return every
    layer's hidden states when `intermediates` is mutable."""
    params = random_params(CONFIG, seed=4)
    ids = np.array([[2, 5, 7, 3, 9, 11, 3, 0]])
    token_types, mask = (ids > 8).astype(np.int32), (ids > 0).astype(np.int32)
    positions = np.array([[1, 4, 6]])
    outputs = {}
    for scan in (False, True):
        config = dataclasses.replace(CONFIG, scan_layers=scan)
        layered = tree.stack_layers(params) if scan else params
        outputs[scan] = jax.jit(
            lambda p, c=config: BertForPreTraining(c).apply(
                {"params": p}, ids, token_types, mask, positions, mutable=["intermediates"]
            )
        )(layered)
    (mlm, nsp), unrolled = outputs[False]
    (scan_mlm, scan_nsp), scanned = outputs[True]
    np.testing.assert_allclose(scan_mlm, mlm, atol=1e-5)
    np.testing.assert_allclose(scan_nsp, nsp, atol=1e-5)
    encoder = unrolled["intermediates"]["bert"]["encoder"]
    scan_encoder = scanned["intermediates"]["bert"]["encoder"]
    for i in range(CONFIG.num_hidden_layers):
        np.testing.assert_allclose(
            scan_encoder["layers"]["hidden_states"][0][i],
            encoder[f"layer_{i}"]["hidden_states"][0],
            atol=1e-5,
        )
    assert not np.allclose(
        encoder["layer_0"]["hidden_states"][0], encoder["layer_1"]["hidden_states"][0]
    )


def test_exports_never_overwrite_unless_asked(tmp_path, capsys):
    """A non-empty DST (a Hugging Face export with stale files; a bertjax checkpoint) is
    refused in one line and left as it was; --overwrite replaces it whole (no stale file)."""
    params = random_params(CONFIG, seed=3)
    src, hf_dir, native_dir = tmp_path / "src", tmp_path / "hf", tmp_path / "native"
    write_google_checkpoint(src, CONFIG, params)
    assert main_ok(str(src), str(native_dir))
    hf_dir.mkdir()
    for stale in (
        "vocab.txt",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "config.json",
    ):
        (hf_dir / stale).write_text("stale")
    capsys.readouterr()
    for dst, target in ((hf_dir, "hf"), (native_dir, "bertjax")):
        before = sorted(p.name for p in dst.iterdir())
        assert convert.main([str(src), str(dst), "--to", target]) == 1
        assert capsys.readouterr().err == (
            f"error: DST {dst} is not empty: choose another "
            "directory, or pass --overwrite to replace it whole\n"
        )
        assert sorted(p.name for p in dst.iterdir()) == before
    assert main_ok(str(native_dir), str(hf_dir), "--overwrite")
    assert not {"vocab.txt", "tokenizer_config.json", "model.safetensors.index.json"} & set(
        os.listdir(hf_dir)
    )
    assert_trees_equal(bert_hf.load_hf(str(hf_dir))[1], params)
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]
