"""CoNLL-2003 reading, first-sub-token labelling, word-level predictions and conlleval output."""

import os

import pytest

from bertjax.data import tokenization
from bertjax.tasks import features, ner

CONLL_DIR = "/work/shared/data/conll2003"


@pytest.fixture
def tokenizer(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text(
        "\n".join(
            [
                "[PAD]",
                "[UNK]",
                "[CLS]",
                "[SEP]",
                "[MASK]",
                "john",
                "lives",
                "in",
                "new",
                "##ark",
                ".",
            ]
        )
        + "\n"
    )
    return tokenization.WordPieceTokenizer(str(path))


def test_reader_skips_docstart_and_counts_bad_sentences(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(
        "-DOCSTART- -X- -X- O\n\nJohn NNP B-NP B-PER\nlives VBZ B-VP O\n\n"
        "Bad NN B-NP B-FOO\nrow NN I-NP O\n\nNewark NNP B-NP B-LOC\n. . O O\n"
    )
    sentences, skipped = ner.read_sentences("train", str(tmp_path))
    assert [(s.words, s.tags) for s in sentences] == [
        (["John", "lives"], ["B-PER", "O"]),
        (["Newark", "."], ["B-LOC", "O"]),
    ]
    assert skipped == {"unknown label": 1}
    with pytest.raises(features.TaskDataError, match=r"valid\.txt"):
        ner.read_sentences("dev", str(tmp_path))
    (tmp_path / "valid.txt").write_bytes(b"Jos\xe9 NNP B-NP B-PER\n")  # Latin-1: named
    with pytest.raises(features.TaskDataError, match=r"valid.txt is not UTF-8 text"):
        ner.read_sentences("dev", str(tmp_path))


def test_first_sub_token_is_labelled_and_truncation_predicts_o(tmp_path, tokenizer, caplog):
    sentence = ner.Sentence(
        ["John", "lives", "in", "Newark", "."], ["B-PER", "O", "O", "B-LOC", "O"]
    )
    encoded, positions, _ = ner.encode([sentence], tokenizer, max_seq_length=12)
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0][:8].tolist())
    assert tokens == ["[CLS]", "john", "lives", "in", "new", "##ark", ".", "[SEP]"]
    assert positions == [[1, 2, 3, 4, 6]]
    assert encoded["label_weights"][0].tolist() == [0, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0]
    labels = [ner.LABELS[i] for i, w in zip(encoded["labels"][0], encoded["label_weights"][0]) if w]
    assert labels == sentence.tags
    # At length 6, "Newark" (2 pieces) no longer fits after "[CLS] john lives in": it and
    # everything after it are cut, and predicted "O".
    with caplog.at_level("WARNING"):
        short, short_positions, counts = ner.encode([sentence], tokenizer, max_seq_length=6)
    assert short_positions == [[1, 2, 3]] and counts == {"sentences truncated": 1}
    # Kept, not skipped, and the flag that keeps them whole named.
    assert "1 of 1 sentences truncated at max_seq_length=6 (kept;" in caplog.text
    assert "skipped" not in caplog.text and "--config.max_seq_length" in caplog.text
    predicted = ner.word_tags(short["labels"], short_positions, [sentence])
    assert predicted == [["B-PER", "O", "O", "O", "O"]]
    assert ner.evaluate([sentence], predicted)["recall"] == pytest.approx(0.5)
    ner.write_predictions(str(tmp_path / "p.txt"), [sentence], predicted)
    assert (tmp_path / "p.txt").read_text().splitlines()[3] == "Newark B-LOC O"


@pytest.mark.skipif(not os.path.isdir(CONLL_DIR), reason="real CoNLL-2003 data not present")
def test_real_conll_counts():
    for split, count in (("train", 14041), ("dev", 3250), ("test", 3453)):
        sentences, skipped = ner.read_sentences(split, CONLL_DIR)
        assert (len(sentences), skipped) == (count, {})


def test_tfds_conll2003_maps_tags_by_name(tmp_path):
    """tfds `conll2003` as `tfds build conll2003` lays it out; its tag ids follow its own name
    list, which bertjax maps by name."""
    import tfds_fixture

    tfds_fixture.prepare_as(tfds_fixture.BertjaxConll(data_dir=str(tmp_path)), "conll2003")
    for split, records in tfds_fixture.CONLL_RECORDS.items():
        sentences, skipped = ner.read_sentences(split, "", str(tmp_path))
        assert sorted((s.words, s.tags) for s in sentences) == sorted(records) and skipped == {}
