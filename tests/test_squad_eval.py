"""Tests for bertjax.tasks.squad_eval against hand-computed official SQuAD v1.1/v2.0 scores."""

import json
import os
import subprocess
import sys

import pytest

from bertjax.tasks import metrics, squad_eval
from bertjax.tasks.squad import SquadExample

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "text, normalized",
    [
        ("The Quick,  brown fox!", "quick brown fox"),
        ("an apple a day", "apple day"),
        ("Another theme, Anthem", "another theme anthem"),  # Articles only as whole words.
        (
            "U.S.-based (1895–1943)",
            "usbased 1895–1943",
        ),  # ASCII punctuation only: the en dash stays.
        ("Café\u00a0ÜBER\tthe", "café über"),  # Unicode lower case; Unicode whitespace collapses.
        ("", ""),
        ("the a an", ""),
    ],
)
def test_normalize_answer(text, normalized):
    assert squad_eval.normalize_answer(text) == normalized


def test_exact_and_f1_hand_computed():
    assert squad_eval.exact_match_score("The cat.", "cat") == 1.0
    assert squad_eval.exact_match_score("cats", "cat") == 0.0
    # "cat sat" vs "cat sat down": precision 1, recall 2/3 -> F1 0.8.
    assert squad_eval.f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    # Repeated tokens count at most as often as in the other text: common {x:1, y:1}.
    assert squad_eval.f1_score("x x y", "x y y") == pytest.approx(2 / 3)
    assert squad_eval.f1_score("dog", "cat") == 0.0


def test_empty_answers_differ_between_v1_and_v2():
    # v1.1: nothing overlaps, so F1 0 even when both are empty; EM compares strings.
    assert squad_eval.f1_score("", "") == 0.0
    assert squad_eval.f1_score("the", "a") == 0.0
    assert squad_eval.exact_match_score("", "") == 1.0
    # v2.0: an empty side scores 1 if both are empty, else 0.
    assert squad_eval.f1_score("", "", version_2=True) == 1.0
    assert squad_eval.f1_score("the", "a", version_2=True) == 1.0
    assert squad_eval.f1_score("", "cat", version_2=True) == 0.0
    assert squad_eval.f1_score("cat", "", version_2=True) == 0.0


def _dataset(qas):
    """An official-layout dataset with one paragraph holding `qas` = [(id, [gold texts])]."""
    return {
        "version": "test",
        "data": [
            {
                "title": "t",
                "paragraphs": [
                    {
                        "context": "unused",
                        "qas": [
                            {
                                "id": qid,
                                "question": "?",
                                "answers": [{"text": g, "answer_start": 0} for g in golds],
                            }
                            for qid, golds in qas
                        ],
                    }
                ],
            }
        ],
    }


def test_v1_evaluate_max_over_golds_and_missing_prediction():
    dataset = _dataset(
        [("q1", ["Denver Broncos", "the Broncos"]), ("q2", ["cat sat down", "dog"]), ("q3", ["x"])]
    )
    predictions = {"q1": "broncos", "q2": "the cat sat"}  # q3 missing: scores 0 but counts.
    result = squad_eval.evaluate(dataset, predictions)
    assert result == pytest.approx({"exact_match": 100 / 3, "f1": 100 * (1 + 0.8 + 0) / 3})


def test_evaluate_accepts_examples_path_and_data_list(tmp_path):
    dataset = _dataset([("q1", ["Denver Broncos"]), ("q2", ["cat sat down"])])
    predictions = {"q1": "Denver", "q2": "cat sat down"}
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(dataset))
    examples = [
        SquadExample("q1", "?", [], answers=["Denver Broncos"]),
        SquadExample("q2", "?", [], answers=["cat sat down"]),
    ]
    expected = {"exact_match": 50.0, "f1": 100 * (2 / 3 + 1) / 2}
    for source in (dataset, dataset["data"], str(path), examples):
        assert squad_eval.evaluate(source, predictions) == pytest.approx(expected)


# A hand-worked v2.0 case:
#   q1 answerable, right (EM 1, F1 1), na 0.1      q2 answerable, partial (EM 0, F1 0.8), na 0.6
#   q3 unanswerable, answered (EM 0, F1 0), na 0.05 q4 unanswerable, no answer (EM 1, F1 1), na 0.9
V2_DATASET = _dataset([("q1", ["Denver"]), ("q2", ["cat sat down"]), ("q3", []), ("q4", [])])
V2_PREDICTIONS = {"q1": "Denver", "q2": "cat sat", "q3": "something", "q4": ""}
V2_NA_PROBS = {"q1": 0.1, "q2": 0.6, "q3": 0.05, "q4": 0.9}


def test_v2_scores_breakdown_and_threshold_search():
    result = squad_eval.evaluate(
        V2_DATASET, V2_PREDICTIONS, V2_NA_PROBS
    )  # na_prob_thresh 1.0: raw scores.
    assert result == pytest.approx(
        {
            "exact": 50.0,
            "f1": 100 * 2.8 / 4,
            "total": 4,
            "HasAns_exact": 50.0,
            "HasAns_f1": 90.0,
            "HasAns_total": 2,
            "NoAns_exact": 50.0,
            "NoAns_f1": 50.0,
            "NoAns_total": 2,
            # Start at 2 (all predicted unanswerable); in na order: q3 -1 -> 1, q1 +1 -> 2 (not better),
            # q2 +0 / +0.8 -> 2 / 2.8, q4 +0. EM never beats 2 (threshold stays 0.0); F1 peaks at q2.
            "best_exact": 50.0,
            "best_exact_thresh": 0.0,
            "best_f1": 70.0,
            "best_f1_thresh": 0.6,
        }
    )


def test_v2_no_answer_threshold_applies():
    # Above 0.5, q2 (0.6) and q4 (0.9) are predicted unanswerable: q2 scores 0, q4 scores 1.
    result = squad_eval.evaluate(V2_DATASET, V2_PREDICTIONS, V2_NA_PROBS, na_prob_thresh=0.5)
    assert result["exact"] == 50.0 and result["f1"] == pytest.approx(50.0)
    # Above 0.0 everything is predicted unanswerable: right exactly for q3 and q4.
    result = squad_eval.evaluate(V2_DATASET, V2_PREDICTIONS, V2_NA_PROBS, na_prob_thresh=0.0)
    assert (
        result["exact"] == result["f1"] == 50.0
        and result["HasAns_exact"] == 0.0
        and result["NoAns_exact"] == 100.0
    )


def test_v2_without_na_probs_and_with_missing_predictions():
    predictions = {k: v for k, v in V2_PREDICTIONS.items() if k != "q2"}
    result = squad_eval.evaluate(
        V2_DATASET, predictions
    )  # v2 detected from the unanswerable questions.
    assert "best_exact" not in result
    assert result == pytest.approx(
        {
            "exact": 200 / 3,
            "f1": 200 / 3,
            "total": 3,  # The missing q2 is left out of every total.
            "HasAns_exact": 100.0,
            "HasAns_f1": 100.0,
            "HasAns_total": 1,
            "NoAns_exact": 50.0,
            "NoAns_f1": 50.0,
            "NoAns_total": 2,
        }
    )


def test_v2_gold_answers_that_normalize_to_empty_mean_no_answer():
    dataset = _dataset([("q1", ["The", "."])])
    assert squad_eval.evaluate(dataset, {"q1": ""}, version_2=True)["exact"] == 100.0
    assert squad_eval.evaluate(dataset, {"q1": "the"}, version_2=True)["f1"] == 100.0
    assert squad_eval.evaluate(dataset, {"q1": "cat"}, version_2=True)["f1"] == 0.0


def test_evaluate_errors_are_clear():
    with pytest.raises(ValueError, match="na_probs has no entry"):
        squad_eval.evaluate(V2_DATASET, V2_PREDICTIONS, {"q1": 0.0})
    with pytest.raises(ValueError, match="version_2=True"):
        squad_eval.evaluate(V2_DATASET, V2_PREDICTIONS, version_2=False)
    with pytest.raises(ValueError, match='"data"'):
        squad_eval.evaluate({"version": "1.1"}, {})
    with pytest.raises(ValueError, match=r"data\[0\] is malformed: .*'answers'"):
        squad_eval.evaluate({"data": [{"paragraphs": [{"qas": [{"id": "q"}]}]}]}, {})
    with pytest.raises(ValueError, match="No question has a prediction"):
        squad_eval.evaluate(V2_DATASET, {})


def test_cli_prints_official_dict(tmp_path):
    data, preds, probs = (
        tmp_path / "dev.json",
        tmp_path / "predictions.json",
        tmp_path / "null_odds.json",
    )
    data.write_text(json.dumps(V2_DATASET))
    preds.write_text(json.dumps(V2_PREDICTIONS))
    probs.write_text(json.dumps(V2_NA_PROBS))
    run = [sys.executable, "-m", "bertjax.tasks.squad_eval"]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    out = subprocess.run(
        [*run, str(data), str(preds), f"--na_prob_file={probs}"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["best_f1"] == pytest.approx(70.0)
    out = subprocess.run(
        [*run, str(tmp_path / "absent.json"), str(preds)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1 and out.stderr.startswith("error:") and "absent.json" in out.stderr


def test_squad_scores_print_as_percent_and_glue_as_fractions():
    """SQuAD's EM/F1 keep the official scripts' 0-100 and print with a % sign; counts and
    thresholds do not; GLUE's and CoNLL's fractions (0-1) print as they are."""
    from bertjax.tasks import glue, ner, squad_predict

    percent = squad_predict.SquadFinetune.percent_metrics
    scores = squad_eval.evaluate(V2_DATASET, V2_PREDICTIONS, V2_NA_PROBS)
    assert {k for k in scores if "total" not in k and "thresh" not in k} <= percent
    assert not {k for k in scores if "total" in k or "thresh" in k} & percent
    assert {"exact_match", "f1"} <= percent  # v1.1's keys
    stats = {
        "dev/f1": {"mean": 88.5, "std": 0.25, "median": 88.5},
        "dev/total": {"mean": 4.0, "std": 0.0, "median": 4.0},
    }
    lines, _ = metrics.summary_lines("squad", stats, 2, {}, percent)
    assert lines == [
        "squad dev/f1: mean 88.50% std 0.25% median 88.50% over 2 seeds",
        "squad dev/total: mean 4.0000 std 0.0000 median 4.0000 over 2 seeds",
    ]
    assert glue.GlueFinetune.percent_metrics == ner.NerFinetune.percent_metrics == frozenset()
    assert metrics.metric_value("f1", 0.885) == "0.8850"
