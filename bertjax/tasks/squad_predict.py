"""SQuAD post-processing with the original run_squad.py semantics, and the fine-tuning adapter.

* `postprocess`: n-best spans over every window of an example (only starts with maximal
  context, ends not before starts, at most `max_answer_length` tokens), mapped back to the
  original text with the BasicTokenizer alignment of `get_final_text`; for v2.0 the null
  score is the smallest [CLS] start+end score over the windows, and the answer is "" when
  null score - best span score > `null_score_diff_threshold`. A v2.0 example without any
  valid span predicts "" with null odds 1e6 (the original crashed).
* `write_predictions`: predictions.json, nbest_predictions.json (and null_odds.json).
* `SquadFinetune`: reading, features, span loss, scoring (`squad_eval`) for bertjax.finetune.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from absl import logging

from bertjax.data import tokenization
from bertjax.data.bpe import BYTE_LEVEL_SPACE
from bertjax.data.tokenization import basic_tokenize
from bertjax.models import families
from bertjax.models.layers import losses
from bertjax.runtime import files
from bertjax.tasks import features, squad, squad_eval
from bertjax.tasks.squad import SquadExample, SquadFeatures

# Null odds of a v2.0 example without any valid span: "certainly unanswerable" (the original's
# initial null score).
NO_SPAN_NULL_ODDS = 1e6


def _join_pieces(pieces: Sequence[str]) -> str:
    """Text of sub-tokens: WordPiece drops "##" continuations, SentencePiece turns "▁" into
    spaces, byte-level BPE "Ġ" (bytes outside ASCII stay in its byte alphabet: the answer is
    then the whole words, `get_final_text`'s fallback)."""
    if any(p.startswith("\u2581") for p in pieces):
        text = "".join(pieces).replace("\u2581", " ")
    elif any(p.startswith(BYTE_LEVEL_SPACE) for p in pieces):
        text = "".join(pieces).replace(BYTE_LEVEL_SPACE, " ")
    else:
        text = " ".join(pieces).replace(" ##", "").replace("##", "")
    return " ".join(text.split())


def _strip_spaces(text: str) -> tuple[str, list[int]]:
    """Text without spaces, and the position in `text` of each of its characters."""
    positions = [i for i, c in enumerate(text) if c != " "]
    return text.replace(" ", ""), positions


def get_final_text(pred_text: str, orig_text: str, do_lower_case: bool) -> str:
    """The part of `orig_text` (original words) that `pred_text` (normalized tokens) covers.

    Both are aligned character by character after BasicTokenizer-normalizing `orig_text` and
    dropping spaces; when that fails (e.g. accents stripped), the whole `orig_text` is returned.
    """
    tok_text = " ".join(basic_tokenize(orig_text, do_lower_case))
    start = tok_text.find(pred_text)
    if start == -1:
        return orig_text
    end = start + len(pred_text) - 1
    orig_ns_text, orig_positions = _strip_spaces(orig_text)
    tok_ns_text, tok_positions = _strip_spaces(tok_text)
    if len(orig_ns_text) != len(tok_ns_text):
        return orig_text
    tok_to_ns = {position: i for i, position in enumerate(tok_positions)}
    if start not in tok_to_ns or end not in tok_to_ns:
        return orig_text
    return orig_text[orig_positions[tok_to_ns[start]] : orig_positions[tok_to_ns[end]] + 1]


def _top_indexes(logits: np.ndarray, n: int) -> np.ndarray:
    """Indexes of the n largest logits, ties in index order (the original's stable sort)."""
    return np.argsort(-logits, kind="stable")[:n]


def _feature_candidates(
    features: SquadFeatures,
    f: int,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int,
    max_answer_length: int,
) -> np.ndarray:
    """Valid (start, end) pairs among the top starts x top ends of window f, in the original's order."""
    starts = _top_indexes(start_logits, n_best_size)
    ends = _top_indexes(end_logits, n_best_size)
    token_map, max_context = features.token_to_orig_map[f], features.token_is_max_context[f]
    start_ok = np.array(
        [s in token_map and max_context.get(s, False) for s in starts.tolist()], dtype=bool
    )
    end_ok = np.array([e in token_map for e in ends.tolist()], dtype=bool)
    start_grid, end_grid = np.meshgrid(starts, ends, indexing="ij")
    length = end_grid - start_grid + 1
    valid = start_ok[:, None] & end_ok[None, :] & (length >= 1) & (length <= max_answer_length)
    return np.stack([start_grid[valid], end_grid[valid]], axis=-1)


class _Candidate(NamedTuple):
    feature: int
    start: int
    end: int
    start_logit: float
    end_logit: float


def _softmax(scores: Sequence[float]) -> list[float]:
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    return [e / sum(exps) for e in exps]


def _example_prediction(  # noqa: C901 (run_squad.py's write_predictions, step for step)
    example: SquadExample,
    features: SquadFeatures,
    feature_indexes: Sequence[int],
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int,
    max_answer_length: int,
    do_lower_case: bool,
    version_2_with_negative: bool,
) -> tuple[list[dict[str, Any]], float | None]:
    """The n-best list of one example and, for v2.0, its null score (None for v1.1 or no windows)."""
    candidates: list[_Candidate] = []
    null: _Candidate | None = None
    for f in feature_indexes:
        starts_f, ends_f = start_logits[f].astype(np.float64), end_logits[f].astype(np.float64)
        if version_2_with_negative and (
            null is None or starts_f[0] + ends_f[0] < null.start_logit + null.end_logit
        ):
            null = _Candidate(f, 0, 0, float(starts_f[0]), float(ends_f[0]))
        for s, e in _feature_candidates(
            features, f, starts_f, ends_f, n_best_size, max_answer_length
        ).tolist():
            candidates.append(_Candidate(f, s, e, float(starts_f[s]), float(ends_f[e])))
    if null is not None:
        candidates.append(null)
    candidates.sort(
        key=lambda c: c.start_logit + c.end_logit, reverse=True
    )  # Stable, as the original.

    nbest: list[tuple[str, float, float]] = []
    seen = set()
    for c in candidates:
        if len(nbest) >= n_best_size:
            break
        text = ""
        if c.start > 0:
            token_map = features.token_to_orig_map[c.feature]
            pred_text = _join_pieces(features.tokens[c.feature][c.start : c.end + 1])
            orig_text = " ".join(example.doc_tokens[token_map[c.start] : token_map[c.end] + 1])
            text = get_final_text(pred_text, orig_text, do_lower_case)
            if text in seen:
                continue
        seen.add(text)
        nbest.append((text, c.start_logit, c.end_logit))
    if version_2_with_negative and "" not in seen:
        null_logits = (null.start_logit, null.end_logit) if null is not None else (0.0, 0.0)
        nbest.append(("", *null_logits))
    if not nbest:
        nbest.append(("empty", 0.0, 0.0))
    probabilities = _softmax([s + e for _, s, e in nbest])
    nbest_json = [
        {"text": text, "probability": p, "start_logit": s, "end_logit": e}
        for (text, s, e), p in zip(nbest, probabilities)
    ]
    return nbest_json, (null.start_logit + null.end_logit if null is not None else None)


def postprocess(
    examples: Sequence[SquadExample],
    features: SquadFeatures,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    *,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    do_lower_case: bool = True,
    version_2_with_negative: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]], dict[str, float]]:
    """Answer texts from per-window start/end logits [N, S], as the original write_predictions.

    Returns predictions {qas_id: text}, the n-best lists {qas_id: [{text, probability,
    start_logit, end_logit}]} and, for v2.0, null odds {qas_id: null score - best span score}
    (empty for v1.1). For v2.0 the prediction is "" when the null odds exceed the threshold.
    """
    if start_logits.shape != end_logits.shape or start_logits.shape[0] != len(features):
        raise ValueError(
            f"logits shapes {start_logits.shape} and {end_logits.shape} do not match {len(features)} features"
        )
    by_example = collections.defaultdict(list)
    for f, example_index in enumerate(features.example_index):
        by_example[example_index].append(f)
    predictions, all_nbest, null_odds = {}, {}, {}
    no_span = 0
    for example_index, example in enumerate(examples):
        nbest, null_score = _example_prediction(
            example,
            features,
            by_example[example_index],
            start_logits,
            end_logits,
            n_best_size,
            max_answer_length,
            do_lower_case,
            version_2_with_negative,
        )
        all_nbest[example.qas_id] = nbest
        if not version_2_with_negative:
            predictions[example.qas_id] = nbest[0]["text"]
            continue
        best = next((entry for entry in nbest if entry["text"]), None)
        if best is None:
            no_span += 1
            null_odds[example.qas_id] = NO_SPAN_NULL_ODDS
            predictions[example.qas_id] = ""
            continue
        null_odds[example.qas_id] = null_score - best["start_logit"] - best["end_logit"]
        predictions[example.qas_id] = (
            "" if null_odds[example.qas_id] > null_score_diff_threshold else best["text"]
        )
    if no_span:
        logging.warning("%d SQuAD examples have no valid answer span; predicted no answer", no_span)
    return predictions, all_nbest, null_odds


def write_predictions(
    directory: str,
    predictions: Mapping[str, str],
    nbest: Mapping[str, list[dict[str, Any]]],
    null_odds: Mapping[str, float],
) -> None:
    """Writes predictions.json, nbest_predictions.json and (v2.0: null_odds non-empty) null_odds.json."""
    files.makedirs(directory)
    outputs: dict[str, Mapping[str, Any]] = {
        "predictions.json": predictions,
        "nbest_predictions.json": nbest,
    }
    if null_odds:
        outputs["null_odds.json"] = null_odds
    for name, content in outputs.items():
        with files.open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=4)
            f.write("\n")


# ----------------------------------------------------------------------------- fine-tuning


class SquadFinetune(features.Finetune[tuple[jax.Array, jax.Array], tuple[np.ndarray, np.ndarray]]):
    """SQuAD v1.1 / v2.0 span prediction (readers, post-processing and scorer in
    `bertjax.tasks.squad` / `squad_eval`)."""

    main_metric = "f1"
    eval_splits = ["dev"]  # noqa: RUF012 (read only, as the base class's)
    test_splits: list[str] = []  # noqa: RUF012
    percent_metrics = frozenset(  # as the official evaluate-v1.1/v2.0 scripts print them
        f"{prefix}{name}"
        for prefix in ("", "HasAns_", "NoAns_", "best_")
        for name in ("exact_match", "exact", "f1")
    )

    def __init__(self, options: features.TaskOptions, tokenizer: tokenization.Tokenizer) -> None:
        if options.causal_attention:
            raise ValueError(
                "causal_attention=True: SQuAD has no left-to-right model (the "
                "paper's LTR SQuAD adds a BiLSTM on top); set it to False"
            )
        self.options, self.tokenizer = options, tokenizer

    def model(self, model_config: families.ModelConfig) -> nn.Module:
        return families.head("span", model_config, 2, self.options)

    def load(self, split: str) -> features.SplitData:
        c, training = self.options, split == "train"
        source = c.train_file if training else c.predict_file
        examples, skipped = squad.read_squad(
            source, training, c.version_2_with_negative, c.tfds_data_dir or None
        )
        examples = features.subset(examples, c.max_train_examples, split)
        feats, counts = squad.convert_examples_to_features(
            examples, self.tokenizer, c.max_seq_length, c.doc_stride, c.max_query_length, training
        )
        if not len(feats.input_ids):
            raise features.TaskDataError(
                f"SQuAD {split}: no usable questions in {source} ({ {**skipped, **counts} })"
            )
        arrays = {
            "input_ids": feats.input_ids,
            "input_mask": feats.input_mask,
            "segment_ids": feats.segment_ids,
        }
        if training:
            arrays.update(start_positions=feats.start_positions, end_positions=feats.end_positions)
        return features.SplitData(split, arrays, (examples, feats), {**skipped, **counts})

    def num_train_examples(self, train: features.SplitData) -> int:
        """Questions, not their document windows, as run_squad.py counts `train_examples`."""
        return len(train.examples[0])

    def loss(self, logits: tuple[jax.Array, jax.Array], batch: dict[str, jax.Array]) -> losses.Loss:
        start, end = logits
        return losses.span_loss(
            start, end, batch["start_positions"], batch["end_positions"], batch["weights"]
        )

    def _postprocess(
        self, data: features.SplitData, logits: tuple[np.ndarray, np.ndarray]
    ) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]], dict[str, float]]:
        c = self.options
        examples, feats = data.examples
        return postprocess(
            examples,
            feats,
            logits[0],
            logits[1],
            n_best_size=c.n_best_size,
            max_answer_length=c.max_answer_length,
            do_lower_case=c.do_lower_case,
            version_2_with_negative=c.version_2_with_negative,
            null_score_diff_threshold=c.null_score_diff_threshold,
        )

    def evaluate(
        self, data: features.SplitData, logits: tuple[np.ndarray, np.ndarray]
    ) -> dict[str, float]:
        predictions, _, null_odds = self._postprocess(data, logits)
        result = squad_eval.evaluate(
            data.examples[0],
            predictions,
            na_probs=null_odds if self.options.version_2_with_negative else None,
            version_2=bool(self.options.version_2_with_negative),
        )
        return {k: float(v) for k, v in result.items() if isinstance(v, (int, float))}

    def write_predictions(
        self, data: features.SplitData, logits: tuple[np.ndarray, np.ndarray], directory: str
    ) -> str:
        write_predictions(directory, *self._postprocess(data, logits))
        return os.path.join(directory, "predictions.json")
