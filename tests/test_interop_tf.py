"""TF tensor bundles without TensorFlow: round trips, a committed checkpoint that TensorFlow
wrote, the real BERT-Tiny index (opt-in), damaged files, and (opt-in, when TensorFlow is
installed) TensorFlow's own reader/writer."""

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from bertjax.families import bert_tf as tf_checkpoint
from bertjax.interop import tf_bundle, tree

BERT_TINY_INDEX = os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "data", "bert-tiny", "bert_model.ckpt.index"
)


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "bert/embeddings/word_embeddings": rng.normal(size=(50, 8)).astype(np.float32),
        "bert/encoder/layer_0/attention/self/query/bias": rng.normal(size=(8,)).astype(np.float32),
        "bert/encoder/layer_0/attention/self/query/bias/adam_m": np.zeros(8, np.float32),
        "global_step": np.array(1234567890123, np.int64),
        "half": rng.normal(size=(3, 2)).astype(np.float16),
        "bf16": rng.normal(size=(4,)).astype(ml_dtypes.bfloat16),
        "ints": np.arange(-5, 5, dtype=np.int32),
        "empty": np.zeros((0, 3), np.float32),
    }


def test_write_then_read_is_exact(tmp_path):
    tensors = _tensors()
    prefix = str(tmp_path / "model.ckpt-7")
    tf_bundle.write_bundle(prefix, tensors)
    reader = tf_bundle.BundleReader(prefix)
    assert sorted(reader.entries) == sorted(tensors)
    for name, value in tensors.items():
        got = reader.read(name)
        assert got.dtype == value.dtype and got.shape == value.shape, name
        np.testing.assert_array_equal(got, value)
    # Directories resolve through TF's `checkpoint` state file or their only index.
    assert tf_bundle.resolve_prefix(str(tmp_path)) == prefix
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-7"\n')
    assert tf_bundle.resolve_prefix(str(tmp_path)) == prefix


def test_entry_encoding_matches_tensorflow_bytes():
    """Re-encoding TF's own entries (from the real BERT-Tiny index) gives TF's exact bytes."""
    if not os.path.exists(BERT_TINY_INDEX):
        pytest.skip("shared/data/bert-tiny not present")
    entries = tf_bundle._read_table(BERT_TINY_INDEX)
    assert entries[0] == (b"", tf_bundle.ONE_SHARD_HEADER)
    for key, value in entries[1:]:
        assert tf_bundle._encode_entry(tf_bundle._parse_entry(key.decode(), value)) == value


def test_damaged_files_are_named(tmp_path):
    prefix = str(tmp_path / "bert_model.ckpt")
    tf_bundle.write_bundle(prefix, _tensors())
    data = prefix + ".data-00000-of-00001"
    reader = tf_bundle.BundleReader(prefix)
    raw = Path(data).read_bytes()
    with open(data, "r+b") as f:  # flip one byte of the word embeddings
        f.seek(reader.entries["bert/embeddings/word_embeddings"].offset + 5)
        f.write(bytes([raw[reader.entries["bert/embeddings/word_embeddings"].offset + 5] ^ 1]))
    with pytest.raises(
        tf_bundle.CheckpointFormatError, match="corrupt: checksum mismatch for tensor"
    ):
        reader.read("bert/embeddings/word_embeddings")
    with open(data, "wb") as f:
        f.write(raw[:100])
    with pytest.raises(tf_bundle.CheckpointFormatError, match="data-00000-of-00001 is truncated"):
        reader.read("bert/embeddings/word_embeddings")
    os.remove(data)
    with pytest.raises(tf_bundle.CheckpointFormatError, match="cannot read TF checkpoint data"):
        reader.read("global_step")
    index = Path(prefix + ".index").read_bytes()
    for damaged in (index[:-10], index[:20] + bytes([index[20] ^ 1]) + index[21:], b""):
        with open(prefix + ".index", "wb") as f:
            f.write(damaged)
        with pytest.raises(tf_bundle.CheckpointFormatError, match=r"\.index"):
            tf_bundle.BundleReader(prefix)


def test_real_bert_tiny_index():
    if not os.path.exists(BERT_TINY_INDEX):
        pytest.skip("shared/data/bert-tiny not present")
    reader = tf_bundle.BundleReader(BERT_TINY_INDEX[: -len(".index")])
    assert len(reader.entries) == 46 and reader.num_shards == 1
    assert reader.entries["bert/embeddings/word_embeddings"].shape == (30522, 128)
    assert sum(int(np.prod(e.shape)) for e in reader.entries.values()) == 4_433_468
    assert all(
        e.dtype == np.float32 and e.size == 4 * np.prod(e.shape) for e in reader.entries.values()
    )
    last = max(reader.entries.values(), key=lambda e: e.offset)
    assert last.offset + last.size == 17_733_872  # the size of the real .data file


TF_WRITTEN = os.path.join(os.path.dirname(__file__), "data", "tf_tiny_bert")


def test_reads_a_checkpoint_tensorflow_wrote():
    """tests/data/tf_tiny_bert: written by TensorFlow's own tf.compat.v1 Saver
    (tests/data/make_tf_fixture.py), with the values it wrote in values.json. bertjax's reader
    gets every variable bit for bit, and load_tf maps Google's names to bertjax's parameters,
    skipping the optimizer slots and the step counter."""
    with open(os.path.join(TF_WRITTEN, "values.json")) as f:
        written = json.load(f)
    reader = tf_bundle.BundleReader(tf_bundle.resolve_prefix(TF_WRITTEN))
    assert sorted(reader.entries) == sorted([*written["variables"], "global_step"])
    for name, values in written["variables"].items():
        got = reader.read(name)
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got, np.array(values, np.float32), err_msg=name)
    assert reader.read("global_step") == written["global_step"]
    assert reader.read("global_step").dtype == np.int64
    report = tree.LoadReport()
    config, params = tf_checkpoint.load_tf(TF_WRITTEN, report)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (12, 4, 1)
    assert report.skipped == {
        "bert/pooler/dense/bias/adam_m": "optimizer slot",
        "bert/pooler/dense/bias/adam_v": "optimizer slot",
        "global_step": "training step counter",
    }
    flat = tree.flatten(params)
    assert len(flat) == len(written["variables"]) - 2
    for name, values in written["variables"].items():
        if tf_checkpoint.skip_reason(name) is None:
            np.testing.assert_array_equal(
                flat[tf_checkpoint.tf_to_path(name)], np.array(values, np.float32), err_msg=name
            )


def test_tensorflow_reads_ours_and_we_read_tensorflows(tmp_path):
    tf = pytest.importorskip("tensorflow")
    tensors = {k: v for k, v in _tensors().items() if k != "bf16"}
    ours = str(tmp_path / "ours" / "model.ckpt")
    tf_bundle.write_bundle(ours, tensors)
    tf_reader = tf.train.load_checkpoint(ours)
    for name, value in tensors.items():
        np.testing.assert_array_equal(tf_reader.get_tensor(name), value)
    theirs = str(tmp_path / "theirs" / "model.ckpt")
    tf.raw_ops.SaveV2(
        prefix=theirs,
        tensor_names=list(tensors),
        shape_and_slices=[""] * len(tensors),
        tensors=[tf.constant(v) for v in tensors.values()],
    )
    reader = tf_bundle.BundleReader(theirs)
    for name, value in tensors.items():
        np.testing.assert_array_equal(reader.read(name), value)
