"""Official SQuAD evaluation: v1.1 (EM/F1) and v2.0 (EM/F1, HasAns/NoAns, best null threshold).

The numbers follow the official evaluation scripts' definitions exactly:
  * normalize_answer: lower case, drop ASCII punctuation, drop the articles a/an/the, collapse
    whitespace; EM compares normalized strings, F1 is the bag-of-tokens overlap; both take the
    max over gold answers.
  * v1.1: every question counts; a missing prediction scores 0. Keys `exact_match`, `f1`.
  * v2.0: gold answers that normalize to "" are dropped and an unanswerable question's only gold
    answer is ""; F1 is 1 when prediction and gold are both empty, 0 when only one is. A question
    counts as predicted unanswerable when its na_prob > na_prob_thresh. Missing predictions are
    left out of every total (as the official script does; its HasAns/NoAns breakdown crashes on
    them instead, here they are left out there too). With na_probs, the best thresholds on the
    scores before thresholding are searched as the official `find_best_thresh`.

CLI (prints the result as JSON, like the official scripts):
  python -m bertjax.tasks.squad_eval dev-v2.0.json predictions.json [--na_prob_file=null_odds.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import string
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

from bertjax.runtime import console

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)

# A question: its id and the texts of all its gold answers ([] when unanswerable).
Question = tuple[str, list[str]]


def normalize_answer(text: str) -> str:
    """Lower case, remove punctuation, articles and extra whitespace (official order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    """1.0 when both normalize to the same string, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str, version_2: bool = False) -> float:
    """Token-overlap F1 of the normalized texts.

    v1.1 scores 0 whenever nothing overlaps (also when both are empty); v2.0 scores an empty
    prediction or gold 1 when both are empty and 0 otherwise.
    """
    prediction_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(ground_truth).split()
    if version_2 and (not prediction_tokens or not gold_tokens):
        return float(prediction_tokens == gold_tokens)
    common = collections.Counter(prediction_tokens) & collections.Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _questions(examples_or_dataset: Any) -> list[Question]:
    """(id, gold texts) from SquadExamples, an official JSON path, its parsed dict or its "data"."""
    if isinstance(examples_or_dataset, str):
        with open(examples_or_dataset, encoding="utf-8") as f:
            examples_or_dataset = json.load(f)
    if isinstance(examples_or_dataset, Mapping):
        if "data" not in examples_or_dataset:
            raise ValueError('SQuAD dataset JSON must have a top-level "data" list of articles.')
        examples_or_dataset = examples_or_dataset["data"]
    questions = []
    for index, item in enumerate(examples_or_dataset):
        if not isinstance(item, Mapping):  # A SquadExample.
            questions.append((item.qas_id, list(item.answers)))
            continue
        try:  # An official article.
            for paragraph in item["paragraphs"]:
                for qa in paragraph["qas"]:
                    questions.append((qa["id"], [a["text"] for a in qa["answers"]]))
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"SQuAD dataset article data[{index}] is malformed: missing or bad field {e}"
            ) from None
    return questions


def _evaluate_v1(questions: Sequence[Question], predictions: Mapping[str, str]) -> dict[str, float]:
    """Official v1.1: mean over all questions of the max EM/F1 over gold answers, in percent."""
    exact = f1 = 0.0
    for qid, golds in questions:
        if qid not in predictions:
            continue
        exact += max(exact_match_score(predictions[qid], gold) for gold in golds)
        f1 += max(f1_score(predictions[qid], gold) for gold in golds)
    total = len(questions)
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


def _raw_scores_v2(
    questions: Sequence[Question], predictions: Mapping[str, str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Official v2.0 per-question EM and F1 (before the no-answer threshold)."""
    exact, f1 = {}, {}
    for qid, answers in questions:
        if qid not in predictions:
            continue
        golds = [g for g in answers if normalize_answer(g)] or [""]
        exact[qid] = max(exact_match_score(predictions[qid], g) for g in golds)
        f1[qid] = max(f1_score(predictions[qid], g, version_2=True) for g in golds)
    return exact, f1


def _apply_threshold(
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    has_ans: Mapping[str, bool],
    thresh: float,
) -> dict[str, float]:
    """Questions with na_prob > thresh are predicted unanswerable: right iff they have no answer."""
    return {
        qid: float(not has_ans[qid]) if na_probs[qid] > thresh else s for qid, s in scores.items()
    }


def _summary(
    exact: Mapping[str, float], f1: Mapping[str, float], qids: Sequence[str]
) -> dict[str, float]:
    total = len(qids)
    return {
        "exact": 100.0 * sum(exact[q] for q in qids) / total,
        "f1": 100.0 * sum(f1[q] for q in qids) / total,
        "total": total,
    }


def best_threshold(
    predictions: Mapping[str, str],
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    has_ans: Mapping[str, bool],
) -> tuple[float, float]:
    """Official find_best_thresh: (best score in percent, the na_prob threshold reaching it).

    Start with everything predicted unanswerable (score = number of unanswerable questions), then
    admit questions as answered in increasing na_prob order and keep the best running score.
    """
    score = best = float(sum(not v for v in has_ans.values()))
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if has_ans[qid]:
            score += scores[qid]
        elif predictions[qid]:
            score -= 1
        if score > best:
            best, best_thresh = score, na_probs[qid]
    return 100.0 * best / len(scores), best_thresh


def _evaluate_v2(
    questions: Sequence[Question],
    predictions: Mapping[str, str],
    na_probs: Mapping[str, float] | None,
    na_prob_thresh: float,
) -> dict[str, float]:
    """Official v2.0 result dict (exact, f1, total, HasAns_*, NoAns_*, best_* with na_probs)."""
    has_ans = {qid: bool(golds) for qid, golds in questions}
    exact_raw, f1_raw = _raw_scores_v2(questions, predictions)
    probs = na_probs if na_probs is not None else dict.fromkeys(predictions, 0.0)
    missing_probs = [qid for qid in exact_raw if qid not in probs]
    if missing_probs:
        raise ValueError(
            f"na_probs has no entry for {len(missing_probs)} predicted questions, e.g. {missing_probs[0]!r}"
        )
    exact = _apply_threshold(exact_raw, probs, has_ans, na_prob_thresh)
    f1 = _apply_threshold(f1_raw, probs, has_ans, na_prob_thresh)
    result = _summary(exact, f1, list(exact))
    for prefix, wanted in (("HasAns", True), ("NoAns", False)):
        qids = [qid for qid in exact if has_ans[qid] == wanted]
        if qids:
            result.update({f"{prefix}_{k}": v for k, v in _summary(exact, f1, qids).items()})
    if na_probs is not None:
        result["best_exact"], result["best_exact_thresh"] = best_threshold(
            predictions, exact_raw, na_probs, has_ans
        )
        result["best_f1"], result["best_f1_thresh"] = best_threshold(
            predictions, f1_raw, na_probs, has_ans
        )
    return result


def evaluate(
    examples_or_dataset: Any,
    predictions: Mapping[str, str],
    na_probs: Mapping[str, float] | None = None,
    na_prob_thresh: float = 1.0,
    version_2: bool | None = None,
) -> dict[str, float]:
    """Scores predictions {question id: text} with the official SQuAD definitions.

    `examples_or_dataset`: SquadExamples, an official JSON file path, the parsed JSON or its
    "data" list. `version_2` None picks v2.0 when na_probs are given or any question has no gold
    answer, else v1.1. Missing predictions are logged (v1.1 scores them 0, v2.0 leaves them out).
    """
    questions = _questions(examples_or_dataset)
    if not questions:
        raise ValueError("No questions to evaluate.")
    missing = sum(qid not in predictions for qid, _ in questions)
    if missing:
        logging.warning("%d of %d questions have no prediction.", missing, len(questions))
    if version_2 is None:
        version_2 = na_probs is not None or any(not golds for _, golds in questions)
    if not version_2:
        if any(not golds for _, golds in questions):
            raise ValueError(
                "SQuAD v1.1 evaluation needs a gold answer for every question; use version_2=True."
            )
        return _evaluate_v1(questions, predictions)
    if missing == len(questions):
        raise ValueError("No question has a prediction.")
    return _evaluate_v2(questions, predictions, na_probs, na_prob_thresh)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: the official scripts' arguments; prints the result dict as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_file", help="official SQuAD JSON (v1.1 or v2.0)")
    parser.add_argument("pred_file", help="predictions.json: {question id: answer text}")
    parser.add_argument(
        "--na_prob_file", help="null_odds.json: {question id: no-answer score} (v2.0)"
    )
    parser.add_argument(
        "--na_prob_thresh", type=float, default=1.0, help="predict no answer above this na_prob"
    )
    parser.add_argument(
        "--version_2", action="store_true", help="force v2.0 scoring (default: detect)"
    )
    args = parser.parse_args(argv)
    try:
        with open(args.pred_file, encoding="utf-8") as f:
            predictions = json.load(f)
        na_probs = None
        if args.na_prob_file:
            with open(args.na_prob_file, encoding="utf-8") as f:
                na_probs = json.load(f)
        result = evaluate(
            args.data_file, predictions, na_probs, args.na_prob_thresh, args.version_2 or None
        )
    except (OSError, ValueError) as e:
        console.error(str(e))
        return 1
    console.say(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
