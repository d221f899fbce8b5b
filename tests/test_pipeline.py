"""Tests for bertjax.data.pipeline: phases, prepared-data cache, batches, dynamic masking, errors.

Everything runs on real components: the first documents of the offline default corpus
written as a text file in the original format (one sentence per line, blank line between
documents), a small SentencePiece model trained on it, and a hand-written WordPiece vocab.
"""

import dataclasses
import itertools
import json
import pathlib
import random
import runpy

import numpy as np
import pytest

from bertjax.data import (
    batch as batch_spec,
    corpus,
    corpus_source,
    default_corpus,
    instances,
    loaders,
    masking,
    pipeline,
    shard_job,
    shard_sources,
    tokenization,
    tokenize_corpus,
)
from bertjax.data.settings import DataSettings
from bertjax.training import memory, phase_schedule
from bertjax.training.settings import plan_phases

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
base_config = runpy.run_path(str(REPO_ROOT / "configs" / "base.py"))["get_config"]

NUM_DOCS = 300
SP_VOCAB = 500
SEQ, PREDS, LONG_SEQ, LONG_PREDS = 64, 10, 128, 20
BATCH = 16


# ----------------------------------------------------------------------------- helpers


def write_documents(path: pathlib.Path, documents) -> str:
    """The original BERT format: one sentence per line, a blank line between documents."""
    path.write_text("\n\n".join("\n".join(doc) for doc in documents) + "\n", encoding="utf-8")
    return str(path)


def make_config(input_files: str, **overrides):
    """configs/base.py shrunk to the test corpus; overrides use dotted keys ("data.seed")."""
    c = base_config()
    c.data.source = "text"
    c.data.input_files = input_files
    c.data.text_format = "lines"
    c.data.tokenizer = "sentencepiece"
    c.data.sentencepiece_vocab_size = SP_VOCAB
    c.data.dupe_factor = 2
    c.data.max_seq_length = SEQ
    c.data.max_predictions_per_seq = PREDS
    c.data.eval_fraction = 0.1
    c.data.num_workers = 1
    c.long_phase.fraction = 0.1
    c.long_phase.max_seq_length = LONG_SEQ
    c.long_phase.max_predictions_per_seq = LONG_PREDS
    c.train.total_steps = 100
    c.train.global_batch_size = BATCH
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        c[section][name] = value
    return c


def phases_of(config) -> list[phase_schedule.Phase]:
    return plan_phases(config.train, config.data, config.long_phase)


def short_phase(config) -> phase_schedule.Phase:
    return phases_of(config)[0]


def entries(cache_dir: pathlib.Path) -> list[pathlib.Path]:
    """The prepared data a cache directory holds, without the hidden lock files (bertjax.runtime.locks)
    and the token ids kept for every phase (`tokens_*`, bertjax.data.token_cache)."""
    return sorted(p for p in cache_dir.iterdir() if not p.name.startswith((".", "tokens_")))


def only_dir(cache_dir: pathlib.Path, pattern: str = "short_*") -> pathlib.Path:
    (directory,) = sorted(cache_dir.glob(pattern))
    return directory


def unmasked_ids(features) -> np.ndarray:
    """input_ids with every masked position restored to its label (the original tokens)."""
    ids = np.array(features["input_ids"])
    rows, slots = np.nonzero(features["masked_lm_weights"])
    ids[rows, features["masked_lm_positions"][rows, slots]] = features["masked_lm_ids"][rows, slots]
    return ids


def expected_predictions(lengths: np.ndarray, prob: float, max_predictions: int) -> np.ndarray:
    """The original's count: round(length * prob), at least 1, at most max_predictions."""
    return np.array([min(max_predictions, max(1, round(int(n) * prob))) for n in lengths])


def vocabulary(tokenizer) -> list[str]:
    return tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))


def traced(split: pipeline.PreparedSplit) -> pipeline.PreparedSplit:
    """The same split with an extra "row" feature, so batches say which rows they hold."""
    return pipeline.PreparedSplit([{**split.stored, "row": np.arange(len(split))}], split.masked)


def check_layout(features, tokenizer, seq: int, preds: int) -> np.ndarray:
    """Shapes, dtypes and the [CLS] A [SEP] B [SEP] layout; returns the unmasked ids."""
    n = len(features["input_ids"])
    assert set(features) == set(pipeline.FEATURES)
    for name in ("input_ids", "input_mask", "segment_ids"):
        assert features[name].shape == (n, seq) and features[name].dtype == np.int32, name
    for name in ("masked_lm_positions", "masked_lm_ids"):
        assert features[name].shape == (n, preds) and features[name].dtype == np.int32, name
    assert features["masked_lm_weights"].shape == (n, preds)
    assert features["masked_lm_weights"].dtype == np.float32
    assert features["next_sentence_labels"].shape == (n,)
    assert features["next_sentence_labels"].dtype == np.int32

    original = unmasked_ids(features)
    lengths = np.asarray(features["input_mask"]).sum(1)
    columns = np.arange(seq)
    in_row = columns < lengths[:, None]
    assert lengths.min() >= 5 and lengths.max() <= seq
    np.testing.assert_array_equal(features["input_mask"], in_row.astype(np.int32))
    assert (original[:, 0] == tokenizer.cls_id).all()
    is_sep = original == tokenizer.sep_id
    assert (is_sep.sum(1) == 2).all()
    assert (original[np.arange(n), lengths - 1] == tokenizer.sep_id).all()
    assert (original[~in_row] == tokenizer.pad_id).all()
    assert (np.asarray(features["input_ids"])[~in_row] == tokenizer.pad_id).all()
    first_sep = is_sep.argmax(1)
    expected_segments = (columns > first_sep[:, None]) & in_row
    np.testing.assert_array_equal(features["segment_ids"], expected_segments.astype(np.int32))
    assert set(np.unique(features["next_sentence_labels"]).tolist()) <= {0, 1}
    assert int(np.asarray(features["input_ids"]).min()) >= 0
    assert int(np.asarray(features["input_ids"]).max()) < tokenizer.vocab_size
    return original


def check_masks(
    features, original: np.ndarray, tokenizer, prob: float, preds: int, exact_count: bool = True
) -> None:
    """Masked-LM features agree with the unmasked tokens and the original's rules."""
    ids = np.asarray(features["input_ids"])
    positions = np.asarray(features["masked_lm_positions"])
    labels = np.asarray(features["masked_lm_ids"])
    weights = np.asarray(features["masked_lm_weights"])
    lengths = np.asarray(features["input_mask"]).sum(1)
    counts = weights.sum(1).astype(int)
    expected = expected_predictions(lengths, prob, preds)
    if exact_count:
        np.testing.assert_array_equal(counts, expected)
    else:
        assert (counts <= expected).all()
    slots = np.arange(preds)
    used = slots < counts[:, None]
    np.testing.assert_array_equal(weights, used.astype(np.float32))
    assert (positions[~used] == 0).all() and (labels[~used] == 0).all()
    never = np.array(
        sorted({tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id, tokenizer.mask_id})
    )
    rows = np.arange(len(ids))[:, None]
    for i in range(len(ids)):
        p = positions[i, : counts[i]]
        assert (np.diff(p) > 0).all() and (p < lengths[i]).all()
    np.testing.assert_array_equal(
        labels[used], original[np.broadcast_to(rows, used.shape)[used], positions[used]]
    )
    assert not np.isin(labels[used], never).any(), "[CLS]/[SEP]/[PAD]/[MASK] were masked"
    # Outside the masked positions the tokens are the original ones.
    changed = ids != original
    masked_at = np.zeros_like(changed)
    masked_at[np.broadcast_to(rows, used.shape)[used], positions[used]] = True
    assert not (changed & ~masked_at).any()


def check_replacements(features, tokenizer) -> None:
    """80% [MASK], 10% unchanged, 10% random (loose bounds over thousands of positions)."""
    weights = np.asarray(features["masked_lm_weights"]) > 0
    rows = np.broadcast_to(np.arange(len(weights))[:, None], weights.shape)[weights]
    positions = np.asarray(features["masked_lm_positions"])[weights]
    shown = np.asarray(features["input_ids"])[rows, positions]
    labels = np.asarray(features["masked_lm_ids"])[weights]
    assert len(labels) > 2000
    as_mask = np.mean(shown == tokenizer.mask_id)
    kept = np.mean(shown == labels)
    assert 0.76 < as_mask < 0.84, as_mask
    assert 0.07 < kept < 0.13, kept
    assert 0.07 < 1 - as_mask - kept < 0.13


def passage_blob(documents) -> bytes:
    """Token ids of the documents as one byte string, documents separated by -1."""
    separator = np.array([-1], np.int32).tobytes()
    return separator.join(
        np.concatenate([np.asarray(s, np.int32) for s in doc]).tobytes() for doc in documents
    )


def segments(row: np.ndarray, sep_id: int) -> tuple[np.ndarray, np.ndarray]:
    first, second = np.flatnonzero(row == sep_id)[:2]
    return row[1:first], row[first + 1 : second]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def documents():
    return list(itertools.islice(default_corpus.default_corpus(), NUM_DOCS))


@pytest.fixture(scope="module")
def corpus_file(documents, tmp_path_factory) -> str:
    return write_documents(tmp_path_factory.mktemp("corpus") / "corpus.txt", documents)


@pytest.fixture(scope="module")
def sp_tokenizer(documents, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("sp") / "sp"
    model = tokenization.train_sentencepiece(
        (s for doc in documents for s in doc), str(prefix), SP_VOCAB, do_lower_case=True
    )
    return tokenization.SentencePieceTokenizer(model)


@pytest.fixture(scope="module")
def config(corpus_file):
    return make_config(corpus_file)


@pytest.fixture(scope="module")
def static_cache(config, sp_tokenizer, tmp_path_factory) -> pathlib.Path:
    cache = tmp_path_factory.mktemp("static_cache")
    pipeline.prepare(DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(cache))
    return cache


@pytest.fixture(scope="module")
def static(config, sp_tokenizer, static_cache):
    return pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(static_cache)
    )


@pytest.fixture(scope="module")
def dynamic_config(corpus_file):
    return make_config(corpus_file, **{"data.masking": "dynamic"})


@pytest.fixture(scope="module")
def dynamic(dynamic_config, sp_tokenizer, tmp_path_factory):
    cache = tmp_path_factory.mktemp("dynamic_cache")
    return pipeline.prepare(
        DataSettings.of(dynamic_config.data), short_phase(dynamic_config), sp_tokenizer, str(cache)
    )


def dynamic_loader(split, tokenizer, seed=12345, batch=32, shuffle=True, whole_word=False):
    masking = (corpus_source.specials_of(tokenizer, whole_word), 0.15, PREDS, whole_word)
    return loaders.BatchLoader(traced(split), batch, seed, shuffle=shuffle, masking=masking)


# ----------------------------------------------------------------------------- prepare


def test_batches_hold_what_bertjax_batch_defines(config, sp_tokenizer, static_cache):
    """The loaders' batches of a real prepared dataset, unpacked and packed (`data.packing`),
    hold exactly the features `bertjax.data.batch.specs` names, with its dtypes and shapes; the
    memory report's abstract batch is the same."""
    phase, data = short_phase(config), DataSettings.of(config.data)
    for packed in (False, True):
        (prepared,) = loaders.prepare_data(
            dataclasses.replace(data, packing=packed),
            [phase],
            SP_VOCAB,
            sp_tokenizer,
            str(static_cache),
            0,
            1,
        )
        for loader in (prepared.train, prepared.eval):
            batch = loader.batch(0)
            spec = (
                batch_spec.specs(BATCH, SEQ, loader.max_predictions, loader.max_instances)
                if packed
                else batch_spec.specs(BATCH, SEQ, PREDS)
            )
            assert {name: (array.shape, array.dtype) for name, array in batch.items()} == spec
            assert list(batch) == list(spec)
    abstract = memory.abstract_batch(phase, BATCH)
    assert {name: (a.shape, a.dtype) for name, a in abstract.items()} == batch_spec.specs(
        BATCH, SEQ, PREDS
    )


@pytest.mark.parametrize("split", ["train", "eval"])
def test_prepared_static_features(static, sp_tokenizer, split):
    features = static[split].features
    assert static[split].masked
    assert len(static[split]) > (1000 if split == "train" else 50)
    original = check_layout(features, sp_tokenizer, SEQ, PREDS)
    check_masks(features, original, sp_tokenizer, 0.15, PREDS)
    # The original labels a pair "random next" whenever its chunk is a single sentence, so
    # the mean is somewhat above one half on this corpus of long documentation sentences.
    # The eval split holds ~190 pairs (std of the mean ~0.035), so its bound is wider.
    assert (
        0.4 < float(np.mean(features["next_sentence_labels"])) < (0.7 if split == "train" else 0.8)
    )


def test_static_masks_replace_80_10_10(static, sp_tokenizer):
    check_replacements(static["train"].features, sp_tokenizer)


def test_token_ids_fit_the_tokenizer(static, sp_tokenizer):
    for split in static.values():
        pipeline.check_token_ids(split, sp_tokenizer.vocab_size, "data")


def test_prepare_writes_meta_and_holds_out_eval_documents(
    config, static, static_cache, sp_tokenizer
):
    meta = json.loads((only_dir(static_cache) / "meta.json").read_text())
    docs, counts = tokenize_corpus.tokenize_documents(
        corpus_source.read_documents(DataSettings.of(config.data), 0, 1, corpus.CorpusStats()),
        sp_tokenizer,
    )
    assert meta["documents"] == len(docs) == NUM_DOCS
    assert meta["eval_documents"] == round(0.1 * NUM_DOCS)
    assert meta["train_instances"] == len(static["train"])
    assert meta["eval_instances"] == len(static["eval"])
    assert meta["tokens"] == counts["tokens"] and meta["masking"] == "static"

    train_docs, eval_docs = pipeline.split_eval_documents(
        docs, config.data.eval_fraction, config.data.seed
    )
    assert len(eval_docs) == meta["eval_documents"]
    assert {id(d) for d in train_docs}.isdisjoint({id(d) for d in eval_docs})
    assert len(train_docs) + len(eval_docs) == len(docs)

    # Both segments of every pair (random B segments included) are passages of documents of
    # the pair's own split. The documentation repeats some text between documents, but most
    # long eval passages occur nowhere in the training documents, so a training pair built
    # from a held-out document would fail the last check.
    train_blob, eval_blob = passage_blob(train_docs), passage_blob(eval_docs)
    held_out = 0
    for row in unmasked_ids(static["eval"].features):
        for segment in segments(row, sp_tokenizer.sep_id):
            assert segment.tobytes() in eval_blob
            held_out += len(segment) >= 12 and segment.tobytes() not in train_blob
    assert held_out > 100
    for row in unmasked_ids(static["train"].features):
        for segment in segments(row, sp_tokenizer.sep_id):
            assert segment.tobytes() in train_blob


def test_prepare_reuses_cache_and_rebuilds_when_settings_change(
    corpus_file, sp_tokenizer, tmp_path
):
    config = make_config(corpus_file)
    cache = tmp_path / "cache"
    first = pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(cache)
    )
    directory = only_dir(cache)
    files = [
        directory / "meta.json",
        directory / "train" / "shard_00000" / "input_ids.npy",
        directory / "eval" / "shard_00000" / "masked_lm_ids.npy",
    ]
    stamps = [(f.stat().st_mtime_ns, f.read_bytes()) for f in files]

    again = pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(cache)
    )
    assert entries(cache) == [directory]
    assert [(f.stat().st_mtime_ns, f.read_bytes()) for f in files] == stamps
    for name in pipeline.FEATURES:
        np.testing.assert_array_equal(again["train"].features[name], first["train"].features[name])

    # Each setting that changes the data gets its own directory; none is a temporary leftover.
    more_masks = make_config(corpus_file, **{"data.masked_lm_prob": 0.3})
    prepared = pipeline.prepare(
        DataSettings.of(more_masks.data), short_phase(more_masks), sp_tokenizer, str(cache)
    )
    assert len(entries(cache)) == 2
    lengths = np.asarray(prepared["train"].features["input_mask"]).sum(1)
    counts = np.asarray(prepared["train"].features["masked_lm_weights"]).sum(1)
    np.testing.assert_array_equal(counts, expected_predictions(lengths, 0.3, PREDS))
    reseeded = make_config(corpus_file, **{"data.seed": 7})
    other = pipeline.prepare(
        DataSettings.of(reseeded.data), short_phase(reseeded), sp_tokenizer, str(cache)
    )
    assert len(entries(cache)) == 3
    assert not np.array_equal(
        other["train"].features["input_ids"][:50], first["train"].features["input_ids"][:50]
    )
    long_phase = phases_of(config)[1]
    long = pipeline.prepare(DataSettings.of(config.data), long_phase, sp_tokenizer, str(cache))
    assert long["train"].features["input_ids"].shape[1] == LONG_SEQ
    assert long["train"].features["masked_lm_ids"].shape[1] == LONG_PREDS
    only_dir(cache, "long_128_*")
    # A changed corpus file is a different source.
    extended = tmp_path / "extended.txt"
    text = pathlib.Path(corpus_file).read_text()
    extended.write_text(text + "\nOne more document.\nIt is new.\n")
    changed = make_config(str(extended))
    pipeline.prepare(DataSettings.of(changed.data), short_phase(changed), sp_tokenizer, str(cache))
    names = [p.name for p in entries(cache)]
    assert len(names) == 5 and not any(".tmp" in n for n in names), names
    # The corpus was tokenized once for the first four (other masks, seed, phase), once more
    # when it changed.
    assert len(list(cache.glob("tokens_*"))) == 2


def test_prepare_rebuilds_an_incomplete_cache_directory(config, sp_tokenizer, tmp_path):
    first = pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(tmp_path)
    )
    directory = only_dir(tmp_path)
    expected = np.array(first["train"].features["input_ids"])
    del first
    (directory / "meta.json").unlink()  # as if the build had been interrupted
    (directory / "train" / "shard_00000" / "input_ids.npy").write_bytes(b"garbage")
    again = pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(tmp_path)
    )
    assert (directory / "meta.json").exists()
    np.testing.assert_array_equal(again["train"].features["input_ids"], expected)


@pytest.mark.parametrize("packed", [False, True])
def test_global_batch_k_is_the_same_on_any_number_of_processes(
    config, sp_tokenizer, tmp_path, packed
):
    """Issue 53 (an elastic relaunch): every process prepares the same data (one cache entry)
    and process i of P reads rows [i*B/P, (i+1)*B/P) of global batch k, so the global batch,
    its dynamic masks and its packing are the same for P = 1, 2 and 4, in the second epoch
    too. (Before, each process prepared its own share of the documents: other instances.)"""
    data = dataclasses.replace(DataSettings.of(config.data), masking="dynamic", packing=packed)
    phase = short_phase(config)
    by_count = {}
    for count in (1, 2, 4):
        loaders_of = [
            loaders.prepare_data(data, [phase], SP_VOCAB, sp_tokenizer, str(tmp_path), i, count)[
                0
            ].train
            for i in range(count)
        ]
        assert {loader.batches_per_epoch for loader in loaders_of} == {
            loaders_of[0].batches_per_epoch
        }
        indices = (0, 3, loaders_of[0].batches_per_epoch + 1)
        by_count[count] = [
            {
                name: np.concatenate([loader.batch(k)[name] for loader in loaders_of])
                for name in loaders_of[0].batch(k)
            }
            for k in indices
        ]
        assert all(len(b["input_ids"]) == BATCH for b in by_count[count])
    assert len(entries(tmp_path)) == 1  # (prepared once, whatever the count)
    for count in (2, 4):
        for one, other in zip(by_count[1], by_count[count]):
            assert one.keys() == other.keys()
            for name in one:
                np.testing.assert_array_equal(one[name], other[name], err_msg=name)
    assert not np.array_equal(by_count[1][0]["input_ids"], by_count[1][1]["input_ids"])


def test_single_document_corpus_gives_empty_eval_split(sp_tokenizer, documents, tmp_path):
    path = write_documents(tmp_path / "one.txt", [max(documents, key=len)])
    config = make_config(path)
    splits = pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(tmp_path / "cache")
    )
    assert len(splits["train"]) > 0 and len(splits["eval"]) == 0
    assert splits["eval"].features["input_ids"].shape == (0, SEQ)
    assert splits["eval"].features["masked_lm_ids"].shape == (0, PREDS)


# ----------------------------------------------------------------------------- corpus sharding


def test_read_documents_partitions_documents_between_processes(config, documents):
    full = list(
        corpus_source.read_documents(DataSettings.of(config.data), 0, 1, corpus.CorpusStats())
    )
    assert full == documents
    shards = [
        list(corpus_source.read_documents(DataSettings.of(config.data), i, 3, corpus.CorpusStats()))
        for i in range(3)
    ]
    for i, shard in enumerate(shards):
        assert shard == full[i::3]
    assert sum(map(len, shards)) == len(full)


def test_read_documents_default_source_is_sharded_too(corpus_file):
    config = make_config(corpus_file, **{"data.source": "default"})
    first = list(
        itertools.islice(
            corpus_source.read_documents(DataSettings.of(config.data), 0, 1, corpus.CorpusStats()),
            8,
        )
    )
    second_shard = list(
        itertools.islice(
            corpus_source.read_documents(DataSettings.of(config.data), 1, 2, corpus.CorpusStats()),
            4,
        )
    )
    assert first == list(itertools.islice(default_corpus.default_corpus(), 8))
    assert second_shard == first[1::2]


# ----------------------------------------------------------------------------- BatchLoader


def test_batches_have_local_shapes_and_dtypes(static):
    loader = loaders.BatchLoader(static["train"], 8, seed=3)
    batch = loader.batch(0)
    assert set(batch) == set(pipeline.FEATURES)
    for name in ("input_ids", "input_mask", "segment_ids"):
        assert batch[name].shape == (8, SEQ) and batch[name].dtype == np.int32
    for name in ("masked_lm_positions", "masked_lm_ids"):
        assert batch[name].shape == (8, PREDS) and batch[name].dtype == np.int32
    assert batch["masked_lm_weights"].shape == (8, PREDS)
    assert batch["masked_lm_weights"].dtype == np.float32
    assert batch["next_sentence_labels"].shape == (8,)
    assert batch["next_sentence_labels"].dtype == np.int32
    assert all(type(a) is np.ndarray for a in batch.values())
    assert loader.batches_per_epoch == len(static["train"]) // 8


def test_batches_are_deterministic_in_any_access_order(static):
    split = traced(static["train"])
    reference = loaders.BatchLoader(split, 64, seed=5)
    indices = list(range(2 * reference.batches_per_epoch + 3))
    expected = {k: reference.batch(k) for k in indices}
    shuffled = indices[:]
    random.Random(0).shuffle(shuffled)
    fresh = loaders.BatchLoader(split, 64, seed=5)
    for k in shuffled:
        batch = fresh.batch(k)
        for name in expected[k]:
            np.testing.assert_array_equal(batch[name], expected[k][name], err_msg=f"{name} {k}")
    other_seed = loaders.BatchLoader(split, 64, seed=6)
    assert not np.array_equal(other_seed.batch(0)["row"], expected[0]["row"])


def test_each_epoch_is_a_new_permutation_without_repeats(static):
    split = traced(static["train"])
    loader = loaders.BatchLoader(split, 64, seed=1)
    per_epoch = loader.batches_per_epoch
    assert per_epoch == len(split) // 64
    epochs = [
        np.concatenate([loader.batch(e * per_epoch + k)["row"] for k in range(per_epoch)])
        for e in range(3)
    ]
    for rows in epochs:
        assert len(rows) == per_epoch * 64 == len(set(rows.tolist()))  # each row at most once
        assert len(split) - len(rows) < 64  # only the incomplete last batch is dropped
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])
    assert not np.array_equal(epochs[0], np.sort(epochs[0]))  # shuffled
    # Rows and their features stay together.
    batch = loader.batch(per_epoch + 2)
    np.testing.assert_array_equal(batch["input_ids"], split.features["input_ids"][batch["row"]])


def test_unshuffled_loader_walks_rows_in_order(static):
    split = traced(static["eval"])
    loader = loaders.BatchLoader(split, 16, seed=1, shuffle=False)
    per_epoch = loader.batches_per_epoch
    np.testing.assert_array_equal(loader.batch(0)["row"], np.arange(16))
    np.testing.assert_array_equal(
        loader.batch(per_epoch - 1)["row"], np.arange((per_epoch - 1) * 16, per_epoch * 16)
    )
    np.testing.assert_array_equal(loader.batch(per_epoch)["row"], np.arange(16))


def test_resumed_loader_continues_the_same_sequence(static):
    split = traced(static["train"])
    loader = loaders.BatchLoader(split, 64, seed=9)
    total = loader.batches_per_epoch + 5  # crosses an epoch boundary
    uninterrupted = list(itertools.islice(iter(loader), total))
    for start in (7, loader.batches_per_epoch - 1, loader.batches_per_epoch + 2):
        resumed = loaders.BatchLoader(split, 64, seed=9)
        for k in range(start, total):
            for name, array in resumed.batch(k).items():
                np.testing.assert_array_equal(array, uninterrupted[k][name])


def test_loader_does_not_modify_the_prepared_split(static):
    before = np.array(static["train"].features["input_ids"][:100])
    loader = loaders.BatchLoader(static["train"], 32, seed=0)
    batch = loader.batch(0)
    batch["input_ids"][:] = -1
    np.testing.assert_array_equal(static["train"].features["input_ids"][:100], before)
    assert (loader.batch(0)["input_ids"] >= 0).all()


# ----------------------------------------------------------------------------- dynamic masking


def test_sharded_preparation_and_loading_across_shards(config, sp_tokenizer, static, tmp_path):
    """Shards cut by bytes at document boundaries; batches gather the right rows across them."""
    size = pathlib.Path(config.data.input_files).stat().st_size
    sharded_config = make_config(config.data.input_files, **{"data.shard_bytes": size // 3})
    documents = list(
        corpus_source.read_documents(DataSettings.of(config.data), 0, 1, corpus.CorpusStats())
    )
    reader = corpus_source.corpus_reader(DataSettings.of(config.data), 0, 1)
    expected = [reader.read(s) for s in shard_sources.cut(reader, corpus.CorpusStats(), size // 3)]
    assert [d for shard in expected for d in shard] == documents and len(expected) >= 3
    sharded = pipeline.prepare(
        DataSettings.of(sharded_config.data),
        short_phase(sharded_config),
        sp_tokenizer,
        str(tmp_path),
    )
    train = sharded["train"]
    assert len(train.shards) == len(expected) == len(sharded["eval"].shards)
    assert abs(len(train) - len(static["train"])) < 0.2 * len(static["train"])
    all_rows = train.features
    shard_ends = np.cumsum([len(shard["input_ids"]) for shard in train.shards])
    loader = loaders.BatchLoader(train, BATCH, seed=3)
    for index in (0, 7, loader.batches_per_epoch + 1):
        _, rows = loader._rows(index)
        assert len(np.unique(np.searchsorted(shard_ends, rows, side="right"))) > 1
        batch = loader.batch(index)
        for name in pipeline.FEATURES:
            np.testing.assert_array_equal(batch[name], all_rows[name][rows])
    meta = json.loads(next(tmp_path.glob("short_*/meta.json")).read_text())
    assert meta["documents"] == NUM_DOCS and meta["shards"] == len(expected)
    assert meta["eval_documents"] == sum(round(0.1 * len(shard)) for shard in expected)


def test_two_workers_write_the_same_bytes_as_one(config, sp_tokenizer, tmp_path):
    """Every shard's whole preparation runs in a worker; the files are identical."""
    size = pathlib.Path(config.data.input_files).stat().st_size
    records = []
    for workers in (1, 2):
        cfg = make_config(
            config.data.input_files, **{"data.num_workers": workers, "data.shard_bytes": size // 3}
        )
        pipeline.prepare(
            DataSettings.of(cfg.data), short_phase(cfg), sp_tokenizer, str(tmp_path / str(workers))
        )
        meta = json.loads(next((tmp_path / str(workers)).glob("short_*/meta.json")).read_text())
        assert meta["shards"] >= 3
        records.append(meta["files"])
    assert records[0] == records[1]


def test_one_shard_holds_the_instances_of_the_original_semantics(config, sp_tokenizer, static):
    """The stored rows are exactly what the original's steps give for this seed: held-out
    documents, pairs from the seeded RNG, then masks by the rule from the shard's masking
    stream (row i of the split is row i of the stream)."""
    docs, _ = tokenize_corpus.tokenize_documents(
        corpus_source.read_documents(DataSettings.of(config.data), 0, 1, corpus.CorpusStats()),
        sp_tokenizer,
    )
    train_docs, _ = pipeline.split_eval_documents(docs, config.data.eval_fraction, config.data.seed)
    seed = shard_job.hash_seed(config.data.seed, 0, 0, SEQ)
    specials = corpus_source.specials_of(sp_tokenizer, False)
    pairs = instances.create_instances(
        train_docs,
        SEQ,
        config.data.short_seq_prob,
        config.data.dupe_factor,
        random.Random(seed),
        specials,
    )
    padded = np.full((len(pairs), SEQ), specials.pad_id, np.int32)
    for i, pair in enumerate(pairs):
        padded[i, : len(pair.tokens)] = pair.tokens
    lengths = np.array([len(pair.tokens) for pair in pairs])
    ids, positions, labels, counts = masking.MaskingRule(specials, 0.15, PREDS).apply(
        padded, lengths, shard_job.mask_key(seed), np.arange(len(pairs))
    )
    rows = [
        instances.to_features(
            ids[i, : lengths[i]],
            pair.segment_ids,
            pair.is_random_next,
            positions[i, : counts[i]],
            labels[i, : counts[i]],
            SEQ,
            PREDS,
            specials.pad_id,
        )
        for i, pair in enumerate(pairs)
    ]
    stored = static["train"].features
    for name in pipeline.FEATURES:
        np.testing.assert_array_equal(stored[name], np.stack([row[name] for row in rows]), name)


def test_dynamic_prepare_stores_unmasked_train_split(dynamic, sp_tokenizer):
    train = dynamic["train"]
    assert not train.masked and dynamic["eval"].masked
    features = train.features
    assert not np.asarray(features["masked_lm_weights"]).any()
    assert not np.asarray(features["masked_lm_positions"]).any()
    assert not np.asarray(features["masked_lm_ids"]).any()
    assert not (np.asarray(features["input_ids"]) == sp_tokenizer.mask_id).any()
    check_layout(features, sp_tokenizer, SEQ, PREDS)
    eval_original = check_layout(dynamic["eval"].features, sp_tokenizer, SEQ, PREDS)
    check_masks(dynamic["eval"].features, eval_original, sp_tokenizer, 0.15, PREDS)
    with pytest.raises(ValueError, match="unmasked split needs masking parameters"):
        loaders.BatchLoader(train, BATCH, seed=0)


def test_dynamic_masks_are_a_function_of_seed_epoch_and_row(dynamic, sp_tokenizer):
    shuffled = dynamic_loader(dynamic["train"], sp_tokenizer)
    ordered = dynamic_loader(dynamic["train"], sp_tokenizer, shuffle=False)
    per_epoch, size = shuffled.batches_per_epoch, 32
    cache = {}
    for index in (0, 3, per_epoch, per_epoch + 1):
        batch = shuffled.batch(index)
        again = shuffled.batch(index)
        fresh = dynamic_loader(dynamic["train"], sp_tokenizer).batch(index)
        for name in batch:
            np.testing.assert_array_equal(batch[name], again[name])
            np.testing.assert_array_equal(batch[name], fresh[name])
        epoch = index // per_epoch
        for i, row in enumerate(batch["row"].tolist()):
            if row >= per_epoch * size:
                continue  # in the unshuffled loader's dropped remainder
            k = epoch * per_epoch + row // size
            if k not in cache:
                cache[k] = ordered.batch(k)
            for name in batch:  # the same row in the same epoch gets the same mask
                np.testing.assert_array_equal(batch[name][i], cache[k][name][row % size])
    other_seed = dynamic_loader(dynamic["train"], sp_tokenizer, seed=1, shuffle=False).batch(0)
    assert not np.array_equal(
        other_seed["masked_lm_positions"], ordered.batch(0)["masked_lm_positions"]
    )


def test_dynamic_masks_change_between_epochs(dynamic, sp_tokenizer):
    ordered = dynamic_loader(dynamic["train"], sp_tokenizer, shuffle=False)
    per_epoch = ordered.batches_per_epoch
    same_positions = same_ids = rows = 0
    for k in range(5):
        first, second = ordered.batch(k), ordered.batch(k + per_epoch)
        np.testing.assert_array_equal(first["row"], second["row"])
        rows += len(first["row"])
        same_positions += sum(
            np.array_equal(a, b)
            for a, b in zip(first["masked_lm_positions"], second["masked_lm_positions"])
        )
        same_ids += sum(
            np.array_equal(a, b) for a, b in zip(first["input_ids"], second["input_ids"])
        )
    assert same_positions < 0.1 * rows and same_ids < 0.1 * rows, (same_positions, same_ids, rows)


def test_dynamic_masks_follow_the_masking_rules(dynamic, sp_tokenizer):
    loader = dynamic_loader(dynamic["train"], sp_tokenizer)
    before = np.array(dynamic["train"].features["input_ids"])
    batches = [loader.batch(k) for k in range(0, 3 * loader.batches_per_epoch, 10)]
    features = {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}
    original = before[features["row"]]
    np.testing.assert_array_equal(unmasked_ids(features), original)
    del features["row"]
    check_layout(features, sp_tokenizer, SEQ, PREDS)
    check_masks(features, original, sp_tokenizer, 0.15, PREDS)
    check_replacements(features, sp_tokenizer)
    # Masking happens on copies: the prepared split stays unmasked.
    np.testing.assert_array_equal(dynamic["train"].features["input_ids"], before)


# ----------------------------------------------------------------------------- tokenizer


def test_load_or_train_tokenizer_trains_once_and_caches(config, sp_tokenizer, tmp_path):
    tokenizer = corpus_source.load_or_train_tokenizer(DataSettings.of(config.data), str(tmp_path))
    (model,) = tmp_path.glob("sentencepiece_*.model")
    assert list(tmp_path.glob("*.tmp*")) == []
    stamp = model.stat().st_mtime_ns
    assert tokenizer.vocab_size == SP_VOCAB
    assert (
        tokenizer.pad_id,
        tokenizer.unk_id,
        tokenizer.cls_id,
        tokenizer.sep_id,
        tokenizer.mask_id,
    ) == (0, 1, 2, 3, 4)
    # Same corpus, size and casing as the fixture's model: the same deterministic training.
    assert vocabulary(tokenizer) == vocabulary(sp_tokenizer)
    again = corpus_source.load_or_train_tokenizer(DataSettings.of(config.data), str(tmp_path))
    assert again.fingerprint() == tokenizer.fingerprint() and model.stat().st_mtime_ns == stamp
    smaller = make_config(config.data.input_files, **{"data.sentencepiece_vocab_size": 300})
    assert (
        corpus_source.load_or_train_tokenizer(
            DataSettings.of(smaller.data), str(tmp_path)
        ).vocab_size
        == 300
    )
    assert len(list(tmp_path.glob("sentencepiece_*.model"))) == 2
    # The trained tokenizer feeds prepare directly.
    splits = pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), tokenizer, str(tmp_path)
    )
    pipeline.check_token_ids(splits["train"], tokenizer.vocab_size, "train")


def test_every_process_trains_the_same_tokenizer(config, sp_tokenizer, tmp_path):
    """Hosts train on their own disks; they must agree on the vocabulary the model uses."""
    hosts = [
        corpus_source.load_or_train_tokenizer(
            DataSettings.of(config.data), str(tmp_path / f"host{i}"), i, 2
        )
        for i in range(2)
    ]
    assert vocabulary(hosts[0]) == vocabulary(hosts[1]) == vocabulary(sp_tokenizer)
    text = "Return a new list containing all items from the iterable in ascending order."
    assert hosts[0].encode(text) == hosts[1].encode(text) == sp_tokenizer.encode(text)


def test_retrained_tokenizer_keeps_its_fingerprint(config, tmp_path):
    first = corpus_source.load_or_train_tokenizer(DataSettings.of(config.data), str(tmp_path / "a"))
    second = corpus_source.load_or_train_tokenizer(
        DataSettings.of(config.data), str(tmp_path / "b")
    )
    assert vocabulary(first) == vocabulary(second)
    assert first.fingerprint() == second.fingerprint()


def test_load_tokenizer_from_a_sentencepiece_vocab_file(config, sp_tokenizer, tmp_path):
    model = tmp_path / "given.model"
    model.write_bytes(sp_tokenizer._model_bytes)
    given = make_config(config.data.input_files, **{"data.vocab_file": str(model)})
    tokenizer = corpus_source.load_or_train_tokenizer(
        DataSettings.of(given.data), str(tmp_path / "cache")
    )
    assert tokenizer.fingerprint() == sp_tokenizer.fingerprint()
    assert not (tmp_path / "cache").exists()  # nothing trained


# ----------------------------------------------------------------------------- errors


def test_corpus_too_small_for_one_batch(sp_tokenizer, documents, tmp_path):
    path = write_documents(tmp_path / "small.txt", documents[:3])
    config = make_config(path, **{"train.global_batch_size": 256})
    splits = pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(tmp_path / "cache")
    )
    assert 0 < len(splits["train"]) < 256
    with pytest.raises(
        pipeline.DataError, match=r"fewer than one batch of 256: use a larger corpus"
    ):
        loaders.BatchLoader(splits["train"], 256, seed=0)


def test_text_source_without_input_files(sp_tokenizer, tmp_path):
    config = make_config("")
    message = r"data.source=text needs --config.data.input_files"
    with pytest.raises(pipeline.DataError, match=message):
        corpus_source.read_documents(DataSettings.of(config.data), 0, 1, corpus.CorpusStats())
    with pytest.raises(pipeline.DataError, match=message):
        pipeline.prepare(
            DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(tmp_path)
        )
    with pytest.raises(pipeline.DataError, match=message):
        corpus_source.load_or_train_tokenizer(DataSettings.of(config.data), str(tmp_path))


def test_missing_input_file_is_named(sp_tokenizer, tmp_path):
    config = make_config(str(tmp_path / "nope.txt"))
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        pipeline.prepare(
            DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(tmp_path)
        )


def test_tfds_source_without_a_name(corpus_file):
    config = make_config(corpus_file, **{"data.source": "tfds"})
    with pytest.raises(pipeline.DataError, match=r"needs --config\.data\.tfds_name"):
        corpus_source.read_documents(DataSettings.of(config.data), 0, 1, corpus.CorpusStats())


def test_wordpiece_needs_a_vocab_file(corpus_file, tmp_path):
    config = make_config(corpus_file, **{"data.tokenizer": "wordpiece"})
    with pytest.raises(
        pipeline.DataError,
        match=r"data.tokenizer=wordpiece needs "
        r"--config.data.vocab_file",
    ):
        corpus_source.load_or_train_tokenizer(DataSettings.of(config.data), str(tmp_path))


def test_nonexistent_vocab_file(corpus_file, tmp_path):
    config = make_config(
        corpus_file,
        **{"data.tokenizer": "wordpiece", "data.vocab_file": str(tmp_path / "vocab.txt")},
    )
    with pytest.raises(pipeline.DataError, match=r"vocab.txt' does not exist"):
        corpus_source.load_or_train_tokenizer(DataSettings.of(config.data), str(tmp_path))


@pytest.mark.parametrize("text", ["", "\n\n   \n\t\n"])
def test_empty_corpus_file(sp_tokenizer, tmp_path, text):
    path = tmp_path / "empty.txt"
    path.write_text(text)
    config = make_config(str(path))
    with pytest.raises(pipeline.DataError, match="no usable documents"):
        pipeline.prepare(
            DataSettings.of(config.data), short_phase(config), sp_tokenizer, str(tmp_path / "cache")
        )
    assert not list((tmp_path / "cache").glob("*/meta.json"))


def test_check_token_ids_rejects_a_small_model_vocab(static, sp_tokenizer):
    largest = int(np.asarray(static["train"].features["input_ids"]).max())
    pipeline.check_token_ids(static["train"], largest + 1, "train data (short)")
    with pytest.raises(
        pipeline.DataError,
        match=rf"train data \(short\): input_ids holds id {largest} >= "
        rf"model.vocab_size=100; set --config.model.vocab_size",
    ):
        pipeline.check_token_ids(static["train"], 100, "train data (short)")


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("source", "hdfs", "'default', 'text', 'tfds'"),
        ("masking", "random", "'static', 'dynamic'"),
        ("masking", "Dynamic", "'static', 'dynamic'"),
        ("strip_accents", "sometimes", "'auto', 'true', 'false'"),
        ("text_format", "line", "'auto', 'lines', 'paragraphs'"),
        ("tokenizer", "unigram", "'wordpiece', 'sentencepiece', 'bpe'"),
    ],
)
def test_a_bad_choice_is_one_line_when_the_settings_are_built(corpus_file, field, value, allowed):
    """Checked once, where config.data becomes DataSettings (before any data is touched)."""
    config = make_config(corpus_file, **{f"data.{field}": value})
    with pytest.raises(pipeline.DataError) as refused:
        DataSettings.of(config.data)
    assert str(refused.value) == (
        f"data.{field}={value!r} is not one of {allowed}; set --config.data.{field}"
    )


@pytest.mark.parametrize(
    "value, expected", [("auto", None), ("true", True), ("False", False), (True, True)]
)
def test_strip_accents_option(corpus_file, value, expected):
    config = make_config(corpus_file)
    config.data.strip_accents = value if isinstance(value, str) else str(value)
    assert DataSettings.of(config.data).strip_accents_option is expected


# ----------------------------------------------------------------------------- whole words

WHOLE_WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "bird",
    "sat",
    "saw",
    "on",
    "under",
    "near",
    "mat",
    "tree",
    "house",
    "and",
    "quick",
    "slow",
    "walk",
    "jump",
    "play",
    "read",
    "talk",
    "re",
    "un",
    ".",
    ",",
]
PIECES = ["##s", "##ed", "##ing", "##er", "##ly", "##play", "##read", "##walk", "##able"]
SURFACE_WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "bird",
    "sat",
    "saw",
    "on",
    "under",
    "near",
    "mat",
    "tree",
    "house",
    "and",
    "cats",
    "dogs",
    "walking",
    "jumped",
    "player",
    "reads",
    "talking",
    "quickly",
    "slowly",
    "replayed",
    "unreadable",
    "rewalked",
    "readable",
    "replaying",
    "walker",
    "jumps",
]


@pytest.fixture(scope="module")
def wordpiece_vocab(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("wordpiece") / "vocab.txt"
    path.write_text("\n".join([*tokenization.SPECIAL_TOKENS, *WHOLE_WORDS, *PIECES]) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def wordpiece_corpus(tmp_path_factory) -> str:
    rng = random.Random(0)

    def sentence() -> str:
        words = [rng.choice(SURFACE_WORDS) for _ in range(rng.randint(4, 12))]
        return " ".join(words).capitalize() + "."

    documents = [[sentence() for _ in range(rng.randint(2, 9))] for _ in range(120)]
    return write_documents(tmp_path_factory.mktemp("wp_corpus") / "words.txt", documents)


def word_groups(
    row: np.ndarray, length: int, continuation: np.ndarray, unmaskable
) -> list[list[int]]:
    """Positions of each word: a "##" piece belongs to the previous maskable token's word."""
    groups: list[list[int]] = []
    for position in range(length):
        token = int(row[position])
        if token in unmaskable:
            continue
        if continuation[token] and groups:
            groups[-1].append(position)
        else:
            groups.append([position])
    return groups


def check_whole_words(features, original, tokenizer) -> int:
    """Every word is masked entirely or not at all; returns how many "##" pieces were masked."""
    continuation = tokenizer.continuation_mask()
    unmaskable = {tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id, tokenizer.mask_id}
    lengths = np.asarray(features["input_mask"]).sum(1)
    masked_pieces = 0
    for i in range(len(original)):
        count = int(features["masked_lm_weights"][i].sum())
        masked = set(features["masked_lm_positions"][i, :count].tolist())
        for group in word_groups(original[i], int(lengths[i]), continuation, unmaskable):
            hit = [p in masked for p in group]
            assert all(hit) or not any(hit), (i, group, sorted(masked))
        for p in masked:
            if continuation[original[i, p]]:
                masked_pieces += 1
                # (A "##" piece right after [CLS], left by truncation, starts its own word.)
                previous = max(
                    (q for q in range(p) if original[i, q] not in unmaskable), default=None
                )
                assert previous is None or previous in masked, (i, p, sorted(masked))
    return masked_pieces


def test_whole_word_masking_with_wordpiece(wordpiece_vocab, wordpiece_corpus, tmp_path):
    tokenizer = tokenization.WordPieceTokenizer(wordpiece_vocab)
    assert tokenizer.tokenize("Unreadable replaying.") == [
        "un",
        "##read",
        "##able",
        "re",
        "##play",
        "##ing",
        ".",
    ]
    config = make_config(
        wordpiece_corpus,
        **{
            "data.tokenizer": "wordpiece",
            "data.vocab_file": wordpiece_vocab,
            "data.whole_word_mask": True,
        },
    )
    loaded = corpus_source.load_or_train_tokenizer(DataSettings.of(config.data), str(tmp_path))
    assert loaded.fingerprint() == tokenizer.fingerprint()
    splits = pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), tokenizer, str(tmp_path)
    )
    for split in splits.values():
        features = split.features
        original = check_layout(features, tokenizer, SEQ, PREDS)
        assert not (original == tokenizer.unk_id).any()
        check_masks(features, original, tokenizer, 0.15, PREDS, exact_count=False)
        assert check_whole_words(features, original, tokenizer) > (
            200 if split is splits["train"] else 5
        )

    # Dynamic whole-word masking in the loader follows the same rule.
    dynamic_config = make_config(
        wordpiece_corpus,
        **{
            "data.tokenizer": "wordpiece",
            "data.vocab_file": wordpiece_vocab,
            "data.whole_word_mask": True,
            "data.masking": "dynamic",
        },
    )
    train = pipeline.prepare(
        DataSettings.of(dynamic_config.data), short_phase(dynamic_config), tokenizer, str(tmp_path)
    )["train"]
    loader = dynamic_loader(train, tokenizer, whole_word=True)
    batches = [loader.batch(k) for k in range(6)]
    features = {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}
    original = np.asarray(train.features["input_ids"])[features["row"]]
    check_masks(features, original, tokenizer, 0.15, PREDS, exact_count=False)
    assert check_whole_words(features, original, tokenizer) > 20
