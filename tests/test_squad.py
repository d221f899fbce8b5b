"""Tests for bertjax.tasks.squad: reading, features, post-processing; real-data round trip when present."""

import json
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.datasets.squad import squad_dataset_builder
from tensorflow_datasets.question_answering import qa_utils

from bertjax.data import tokenization
from bertjax.tasks import features, squad, squad_eval, squad_predict
from bertjax.tasks.squad import SquadExample

SHARED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data"
)
DEV_V11 = os.path.join(SHARED, "squad", "dev-v1.1.json")
UNCASED_VOCAB = os.path.join(SHARED, "bert-base-uncased", "vocab.txt")

LETTERS = list("abcdefghijklmn")
WORDS = [
    "s",
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "steve",
    "smith",
    "##s",
    "who",
    "was",
    "he",
    "born",
    "in",
    "1895",
    "1943",
    "cafe",
]
PUNCT = list(".,()-'")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("\n".join([*tokenization.SPECIAL_TOKENS, *WORDS, *LETTERS, *PUNCT]) + "\n")
    return tokenization.WordPieceTokenizer(str(vocab))


def _squad_json(qas, context):
    return {
        "version": "test",
        "data": [{"title": "T", "paragraphs": [{"context": context, "qas": qas}]}],
    }


def _qa(qid, answers, **extra):
    return {
        "id": qid,
        "question": "who?",
        "answers": [{"text": t, "answer_start": s} for t, s in answers],
        **extra,
    }


# ---------------------------------------------------------------------------
# Reading

CONTEXT = "The cat sat on the mat. Steve Smith's cat was born in (1895-1943)."


def test_split_context_words_and_offsets():
    words, offsets = squad.split_context("  The cat\u202fsat\n on ")
    assert words == ["The", "cat", "sat", "on"]
    assert offsets == [-1, -1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3]


def test_read_json_training_locates_answers_and_counts_skips(tmp_path):
    qas = [
        _qa("ok", [("the mat", CONTEXT.index("the mat"))]),
        _qa("several", [("1895", CONTEXT.index("1895")), ("1943", CONTEXT.index("1943"))]),
        _qa("wrong_offset", [("cat", 0)]),
        _qa("outside", [("cat", 1000)]),
        _qa("none", []),
    ]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(_squad_json(qas, CONTEXT)))
    examples, skipped = squad.read_squad(str(path), is_training=True, version_2_with_negative=False)
    assert skipped == {"answer_not_found": 1, "answer_outside_context": 1, "no_answer": 1}
    ok, several = examples
    assert ok.doc_tokens[4:6] == ["the", "mat."] and (ok.start_position, ok.end_position) == (4, 5)
    assert ok.orig_answer_text == "the mat" and ok.answers == ["the mat"]
    assert (
        several.doc_tokens[several.start_position] == "(1895-1943)."
        and several.orig_answer_text == "1895"
    )
    assert several.answers == ["1895", "1943"]  # All golds are kept for evaluation.

    examples, skipped = squad.read_squad(
        str(path), is_training=False, version_2_with_negative=False
    )
    assert skipped == {} and [e.qas_id for e in examples] == [
        "ok",
        "several",
        "wrong_offset",
        "outside",
        "none",
    ]
    assert all(e.start_position == e.end_position == -1 for e in examples)


def test_read_json_v2_keeps_unanswerable_questions(tmp_path):
    qas = [
        _qa("no", [], is_impossible=True, plausible_answers=[{"text": "cat", "answer_start": 4}]),
        _qa("yes", [("cat", 4)], is_impossible=False),
    ]
    path = tmp_path / "train-v2.json"
    path.write_text(json.dumps(_squad_json(qas, CONTEXT)))
    examples, skipped = squad.read_squad(str(path), is_training=True, version_2_with_negative=True)
    assert skipped == {}
    assert [(e.is_impossible, e.start_position, e.orig_answer_text) for e in examples] == [
        (True, -1, ""),
        (False, 1, "cat"),
    ]
    # Read as v1.1, the unanswerable training question has no answer to learn from.
    _, skipped = squad.read_squad(str(path), is_training=True, version_2_with_negative=False)
    assert skipped == {"no_answer": 1}


def test_read_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"absent\.json"):
        squad.read_squad(str(tmp_path / "absent.json"), False, False)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json is not a valid JSON"):
        squad.read_squad(str(bad), False, False)
    bad.write_text(json.dumps({"version": "1.1"}))
    with pytest.raises(ValueError, match='"data" list'):
        squad.read_squad(str(bad), False, False)
    bad.write_text(json.dumps({"data": [{"title": "no paragraphs"}]}))
    with pytest.raises(ValueError, match=r'data\[0\] is not an article with a "paragraphs" list'):
        squad.read_squad(str(bad), False, False)
    bad.write_text(json.dumps(_squad_json([{"id": "q", "answers": []}], CONTEXT)))
    with pytest.raises(ValueError, match=r"data\[0\].paragraphs\[0\].*'question'"):
        squad.read_squad(str(bad), False, False)
    with pytest.raises(ValueError, match=r"tfds:squad/v1\.1:validation"):
        squad.read_squad("tfds:squad", False, False)


@pytest.mark.parametrize(
    "field, damage",
    [
        ("context", lambda p: p.update(context=5)),
        ("question", lambda p: p["qas"][0].update(question=None)),
        ("text", lambda p: p["qas"][0]["answers"][0].update(text=3)),
        ("has no attribute", lambda p: p.update(qas={"q": 1})),  # (a dict, not a list)
    ],
)
def test_wrongly_typed_entries_are_named_not_tracebacks(field, damage, tmp_path):
    """Values of the wrong type (before: a TypeError or AttributeError traceback) are one
    ValueError naming the file, the paragraph and the field."""
    data = _squad_json([_qa("q", [("Steve", 0)])], "Steve Smith was born.")
    damage(data["data"][0]["paragraphs"][0])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(
        ValueError,
        match=rf"bad.json: data\[0\].paragraphs\[0\]: malformed "
        rf"SQuAD entry.*{field}",
    ):
        squad.read_squad(str(bad), True, False)


def test_a_file_without_usable_questions_is_refused(tmp_path, tokenizer):
    """No feature at all (before: a traceback after the run had started) is one error."""
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"version": "1.1", "data": []}))
    options = features.TaskOptions(task="squad", train_file=str(empty), predict_file=str(empty))
    with pytest.raises(features.TaskDataError, match=r"SQuAD dev: no usable questions in .*empty"):
        squad_predict.SquadFinetune(options, tokenizer).load("dev")


class BertjaxTinySquad(squad_dataset_builder.Builder):
    """tfds's own squad builder (configs v1.1 and v2.0, its JSON parsing and features) reading the
    train.json/dev.json of `manual_dir` instead of downloading."""

    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put train.json and dev.json (official SQuAD layout) in manual_dir."
    )

    def _info(self):
        v1 = self.builder_config.name == "v1.1"
        features = qa_utils.squadlike_features() if v1 else squad_dataset_builder._v2_features()
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        return {
            "train": self._generate_examples(os.path.join(dl_manager.manual_dir, "train.json")),
            "validation": self._generate_examples(os.path.join(dl_manager.manual_dir, "dev.json")),
        }


def test_read_tfds_v1_and_v2(tmp_path):
    qas = [
        _qa("yes", [("Steve Smith's", CONTEXT.index("Steve"))], is_impossible=False),
        _qa("no", [], is_impossible=True, plausible_answers=[]),
    ]
    for name in ("train.json", "dev.json"):
        (tmp_path / name).write_text(json.dumps(_squad_json(qas, CONTEXT)))
    data_dir = str(tmp_path / "tfds")
    for config in ("v1.1", "v2.0"):
        builder = BertjaxTinySquad(config=config, data_dir=data_dir)
        builder.download_and_prepare(
            file_format="array_record",
            download_config=tfds.download.DownloadConfig(manual_dir=str(tmp_path)),
        )

    examples, skipped = squad.read_squad(
        "tfds:bertjax_tiny_squad/v2.0:validation", False, True, data_dir=data_dir
    )
    by_id = {e.qas_id: e for e in examples}
    assert skipped == {} and set(by_id) == {"yes", "no"}
    assert by_id["no"].is_impossible and by_id["no"].answers == []
    assert not by_id["yes"].is_impossible and by_id["yes"].answers == ["Steve Smith's"]
    assert by_id["yes"].doc_tokens == CONTEXT.split()

    examples, skipped = squad.read_squad(
        "tfds:bertjax_tiny_squad/v1.1:train", True, False, data_dir=data_dir
    )
    assert skipped == {"no_answer": 1}
    (yes,) = examples
    assert (yes.start_position, yes.end_position, yes.orig_answer_text) == (6, 7, "Steve Smith's")
    examples, _ = squad.read_squad(
        "tfds:bertjax_tiny_squad/v1.1:validation[:1]", False, False, data_dir=data_dir
    )
    assert len(examples) == 1


# ---------------------------------------------------------------------------
# Features

# 14 one-token words; with a 1-token query and max_seq_length 12 a window holds 8 of them, and
# stride 3 gives windows [0, 7], [3, 10], [6, 13]. Best window per token, by
# min(left, right) + 0.01 * 8 with ties to the first window (hand-computed):
BEST_WINDOW = [0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]


def _letters_example(qas_id="e", start=-1, end=-1, is_impossible=False):
    text = " ".join(LETTERS[start : end + 1]) if start >= 0 else ""
    return SquadExample(qas_id, "who", list(LETTERS), text, start, end, is_impossible)


def _window_features(tokenizer, examples, is_training=False):
    return squad.convert_examples_to_features(
        examples, tokenizer, max_seq_length=12, doc_stride=3, is_training=is_training
    )


def test_windows_maps_and_max_context(tokenizer):
    features, counts = _window_features(tokenizer, [_letters_example()])
    assert counts["features"] == 3 and counts["multi_window_examples"] == 1
    assert features.doc_span_index == [0, 1, 2] and features.example_index == [0, 0, 0]
    for window, first in enumerate((0, 3, 6)):
        words = LETTERS[first : first + 8]
        assert features.tokens[window] == ["[CLS]", "who", "[SEP]", *words, "[SEP]"]
        assert features.input_ids[window].tolist() == tokenizer.convert_tokens_to_ids(
            features.tokens[window]
        )
        assert features.token_to_orig_map[window] == {3 + i: first + i for i in range(8)}
        assert features.token_is_max_context[window] == {
            3 + i: BEST_WINDOW[first + i] == window for i in range(8)
        }
    assert features.segment_ids.tolist() == [[0] * 3 + [1] * 9] * 3
    assert features.input_mask.tolist() == [[1] * 12] * 3
    assert features.start_positions.tolist() == features.end_positions.tolist() == [0, 0, 0]


def test_training_targets_in_window_out_of_window_and_impossible(tokenizer):
    examples = [
        _letters_example("gh", 6, 7),
        _letters_example("bc", 1, 2),
        _letters_example("none", is_impossible=True),
    ]
    features, counts = _window_features(tokenizer, examples, is_training=True)
    # "g h" (words 6-7) lies in all three windows; "b c" only in the first.
    assert features.start_positions.tolist() == [9, 6, 3, 4, 0, 0, 0, 0, 0]
    assert features.end_positions.tolist() == [10, 7, 4, 5, 0, 0, 0, 0, 0]
    assert counts["out_of_window_features"] == 2 and counts["impossible_features"] == 3


def test_subwords_improved_answer_span_padding_and_query_truncation(tokenizer):
    words = "Steve Smith's cats (1895-1943).".split()
    example = SquadExample("q", "who was he", words, "1895", 3, 3)
    features, counts = squad.convert_examples_to_features(
        [example], tokenizer, max_seq_length=20, max_query_length=2, is_training=True
    )
    assert counts["truncated_queries"] == 1
    doc = ["steve", "smith", "'", "s", "cat", "##s", "(", "1895", "-", "1943", ")", "."]
    assert features.tokens[0] == ["[CLS]", "who", "was", "[SEP]", *doc, "[SEP]"]
    assert features.token_to_orig_map[0] == dict(
        zip(range(4, 16), [0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3])
    )
    # The answer word "(1895-1943)." spans 6 tokens; the improved span is the "1895" token alone.
    assert features.start_positions.tolist() == features.end_positions.tolist() == [11]
    assert features.input_mask[0].tolist() == [1] * 17 + [0] * 3
    assert features.segment_ids[0].tolist() == [0] * 4 + [1] * 13 + [0] * 3
    assert features.input_ids[0, 17:].tolist() == [0, 0, 0] and features.input_ids.dtype == np.int32


def test_features_reject_bad_inputs(tokenizer):
    with pytest.raises(ValueError, match=r"'e' has no answer word span .* is_training=True"):
        squad.convert_examples_to_features([_letters_example()], tokenizer, is_training=True)
    example = SquadExample("long", "who was he", list(LETTERS))
    with pytest.raises(
        ValueError, match=r"max_seq_length 6 .* question 'long' after its 3-token query"
    ):
        squad.convert_examples_to_features([example], tokenizer, max_seq_length=6)


# ---------------------------------------------------------------------------
# Post-processing


@pytest.mark.parametrize(
    "pred_text, orig_text, expected",
    [
        ("steve smith", "Steve Smith's", "Steve Smith"),  # Drops the "'s" the word carries.
        ("1895", "(1895-1943).", "1895"),
        ("cafe", "Café's", "Café"),  # Accent stripped, same length: aligned.
        ("foobar", "foo\u200bbar baz", "foo\u200bbar baz"),  # Dropped control char: lengths differ.
        ("dog", "Steve Smith's", "Steve Smith's"),  # Not found.
    ],
)
def test_get_final_text(pred_text, orig_text, expected):
    assert squad_predict.get_final_text(pred_text, orig_text, do_lower_case=True) == expected


def _crafted_logits(features):
    """Logits for the three letter windows: a -10 floor and a few chosen peaks."""
    start = np.full((len(features), 12), -10.0, np.float32)
    end = np.full((len(features), 12), -10.0, np.float32)
    start[0, 9], end[0, 10] = 9.0, 9.0  # "g h" in window 0, where "g" lacks max context: skipped.
    start[1, 6], end[1, 7] = 5.0, 4.0  # "g h" in window 1 (max context): score 9, the answer.
    end[1, 5] = 8.0  # Before every max-context start of window 1: never valid.
    start[2, 6], end[2, 10] = 8.0, 8.0  # "j ... n": 5 tokens, over max_answer_length 3.
    end[2, 7] = 0.5  # "j k": score 8.5, second best.
    return start, end


def test_postprocess_v1_picks_best_valid_span(tokenizer):
    example = _letters_example()
    features, _ = _window_features(tokenizer, [example])
    start, end = _crafted_logits(features)
    predictions, nbest, null_odds = squad_predict.postprocess(
        [example], features, start, end, max_answer_length=3
    )
    assert predictions == {"e": "g h"} and null_odds == {}
    entries = nbest["e"]
    assert entries[0] == pytest.approx(
        {
            "text": "g h",
            "probability": entries[0]["probability"],
            "start_logit": 5.0,
            "end_logit": 4.0,
        }
    )
    assert entries[1] == pytest.approx(
        {
            "text": "j k",
            "probability": entries[1]["probability"],
            "start_logit": 8.0,
            "end_logit": 0.5,
        }
    )
    assert len(entries) == 20 and len({e["text"] for e in entries}) == 20
    scores = np.array([e["start_logit"] + e["end_logit"] for e in entries])
    assert np.all(np.diff(scores) <= 0)
    expected = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    np.testing.assert_allclose([e["probability"] for e in entries], expected, rtol=1e-12)
    assert all(len(e["text"].split()) <= 3 for e in entries)


def test_postprocess_v1_without_valid_span_says_empty(tokenizer):
    example = _letters_example()
    features, _ = _window_features(tokenizer, [example])
    start = np.zeros((3, 12), np.float32)
    start[:, 0] = 1.0  # The only start considered (n_best_size 1) is [CLS].
    predictions, nbest, _ = squad_predict.postprocess(
        [example], features, start, start, n_best_size=1
    )
    assert predictions == {"e": "empty"} and nbest["e"][0]["probability"] == 1.0


def test_postprocess_v2_null_score_and_threshold(tokenizer):
    example = _letters_example()
    features, _ = _window_features(tokenizer, [example])
    start, end = _crafted_logits(features)
    start[:, 0], end[:, 0] = [2.0, 0.5, 3.0], [1.0, 0.5, 3.0]  # Null score: min over windows = 1.0.
    kwargs = dict(max_answer_length=3, version_2_with_negative=True)
    predictions, nbest, null_odds = squad_predict.postprocess(
        [example], features, start, end, **kwargs
    )
    assert null_odds == {"e": pytest.approx(1.0 - 9.0)} and predictions == {"e": "g h"}
    null_entries = [e for e in nbest["e"] if e["text"] == ""]
    assert len(null_entries) == 1 and (
        null_entries[0]["start_logit"],
        null_entries[0]["end_logit"],
    ) == (
        0.5,
        0.5,
    )
    predictions, _, _ = squad_predict.postprocess(
        [example], features, start, end, null_score_diff_threshold=-8.5, **kwargs
    )
    assert predictions == {"e": ""}
    # With n_best_size 1 each window's top start and top end make no valid span: no answer, certainly.
    predictions, nbest, null_odds = squad_predict.postprocess(
        [example], features, start, end, n_best_size=1, **kwargs
    )
    assert predictions == {"e": ""} and null_odds == {"e": squad_predict.NO_SPAN_NULL_ODDS}
    assert [e["text"] for e in nbest["e"]] == [""]


def test_write_predictions(tmp_path, tokenizer):
    example = _letters_example()
    features, _ = _window_features(tokenizer, [example])
    start, end = _crafted_logits(features)
    for v2 in (False, True):
        predictions, nbest, null_odds = squad_predict.postprocess(
            [example], features, start, end, version_2_with_negative=v2
        )
        directory = tmp_path / f"v2_{v2}"
        squad_predict.write_predictions(str(directory), predictions, nbest, null_odds)
        names = (
            ["nbest_predictions.json", "null_odds.json", "predictions.json"]
            if v2
            else ["nbest_predictions.json", "predictions.json"]
        )
        assert sorted(os.listdir(directory)) == names
        assert json.loads((directory / "predictions.json").read_text()) == predictions
        assert json.loads((directory / "nbest_predictions.json").read_text()) == nbest
        if v2:
            assert json.loads((directory / "null_odds.json").read_text()) == null_odds


def _peaked_round_trip(examples, features, **kwargs):
    """Predictions from logits that peak (10 vs 0) at each feature's gold start/end positions."""
    start = np.zeros(features.input_ids.shape, np.float32)
    end = np.zeros(features.input_ids.shape, np.float32)
    rows = np.arange(len(features))
    start[rows, features.start_positions] = 10.0
    end[rows, features.end_positions] = 10.0
    return squad_predict.postprocess(examples, features, start, end, **kwargs)


def test_sentencepiece_round_trip(tmp_path):
    sentences = [
        "The quick brown fox jumps over the lazy dog near the river bank.",
        "A lazy dog sleeps while the quick fox runs to the bank of the river.",
    ] * 20
    model = tokenization.train_sentencepiece(sentences, str(tmp_path / "sp"), vocab_size=60)
    sp = tokenization.SentencePieceTokenizer(model)
    context = sentences[0]
    words = context.split()
    example = SquadExample(
        "q", "Who sleeps?", words, "lazy dog", words.index("lazy"), words.index("dog")
    )
    features, _ = squad.convert_examples_to_features(
        [example], sp, max_seq_length=32, doc_stride=8, is_training=True
    )
    assert len(features) > 1 and any(t.startswith("\u2581") for t in features.tokens[0])
    predictions, _, _ = _peaked_round_trip([example], features, do_lower_case=False)
    assert predictions == {"q": "lazy dog"}


@pytest.mark.skipif(
    not (os.path.exists(DEV_V11) and os.path.exists(UNCASED_VOCAB)),
    reason="needs ../shared/data/squad/dev-v1.1.json and bert-base-uncased/vocab.txt",
)
def test_real_dev_v11_gold_round_trip():
    """Gold answers -> feature positions -> peaked logits -> postprocess -> official EM >= 99.

    Measured: EM 99.69, F1 99.75; the 33 misses are inherent to the original pipeline: 23 answers
    are part of a token ("8" of "20–18", "27,814" of "€27,814" whose "€27" is one word) or start
    mid-word in the annotation, 9 answers are longer than max_answer_length 30, and 1 original
    word holds zero-width spaces that get_final_text cannot align.
    """
    examples, skipped = squad.read_squad(DEV_V11, is_training=True, version_2_with_negative=False)
    assert skipped == {} and len(examples) == 10570
    tokenizer = tokenization.WordPieceTokenizer(UNCASED_VOCAB)
    features, counts = squad.convert_examples_to_features(examples, tokenizer, is_training=True)
    assert counts["features"] > len(examples) and counts["examples_without_features"] == 0
    predictions, _, _ = _peaked_round_trip(examples, features)
    result = squad_eval.evaluate(DEV_V11, predictions)
    assert result["exact_match"] >= 99.0 and result["f1"] >= 99.0, result
