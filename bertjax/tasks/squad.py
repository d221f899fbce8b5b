"""SQuAD v1.1/v2.0: reading, features and post-processing with the original run_squad.py semantics.

  * Reading (`read_squad`): official JSON files or prepared tfds datasets (`tfds:squad/v1.1:train`).
    The context is split on whitespace (" \\t\\r\\n" and U+202F) into `doc_tokens`; a training
    answer is located through the character-to-word map of its `answer_start`. Training questions
    whose answer text is not found at that place are counted and skipped, with a warning.
  * Features (`convert_examples_to_features`): `[CLS] query [SEP] doc [SEP]` windows of the
    WordPiece-split document, `doc_stride` apart; each document token records the word it came
    from and whether this window gives it the most context (min(left, right) + 0.01 * length).
    Training targets are token positions, 0 ([CLS]) when the answer is not fully inside the
    window or the question is unanswerable.
  * Post-processing (`postprocess`): n-best spans over every window of an example (only starts
    with maximal context, ends not before starts, at most `max_answer_length` tokens), mapped back
    to the original text with the BasicTokenizer alignment of `get_final_text`; for v2.0 the null
    score is the smallest [CLS] start+end score over the windows, and the answer is "" when
    null score - best span score > `null_score_diff_threshold`.

Deviations from the original, all for robustness: a training question with several answers uses
the first (the original raised); answers whose offsets fall outside the context are counted and
skipped (the original raised IndexError); a v2.0 example without any valid span predicts "" with
null odds 1e6 (the original crashed). `read_squad` takes an optional `data_dir` for tfds.
Plausible answers of v2.0 are not used, as in the original.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from absl import logging

from bertjax.data.tokenization import CLS, SEP, Tokenizer, basic_tokenize

# Null odds of a v2.0 example without any valid span: "certainly unanswerable" (the original's
# initial null score).
NO_SPAN_NULL_ODDS = 1e6


@dataclasses.dataclass
class SquadExample:
    """One question over a whitespace-tokenized context (positions are word indices, -1 if none)."""

    qas_id: str
    question_text: str
    doc_tokens: list[str]
    orig_answer_text: str = ""
    start_position: int = -1
    end_position: int = -1
    is_impossible: bool = False
    answers: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SquadFeatures:
    """N windows: model inputs [N, S] int32, training targets [N] int32, and per-window maps.

    `token_to_orig_map[i]` maps a document token's position to its word in the example's
    doc_tokens; `token_is_max_context[i]` says whether window i is that token's best window.
    """

    input_ids: np.ndarray
    input_mask: np.ndarray
    segment_ids: np.ndarray
    start_positions: np.ndarray
    end_positions: np.ndarray
    example_index: list[int]
    doc_span_index: list[int]
    tokens: list[list[str]]
    token_to_orig_map: list[dict[int, int]]
    token_is_max_context: list[dict[int, bool]]

    def __len__(self) -> int:
        return len(self.example_index)


# ---------------------------------------------------------------------------
# Reading


class _Question(NamedTuple):
    """One question as stored in either source; answers are (text, answer_start) pairs."""

    qas_id: str
    question: str
    context: str
    answers: list[tuple[str, int]]
    is_impossible: bool


def _is_whitespace(char: str) -> bool:
    """The original's whitespace for splitting contexts: space, tab, CR, LF, narrow nbsp."""
    return char in " \t\r\n" or ord(char) == 0x202F


def split_context(context: str) -> tuple[list[str], list[int]]:
    """Whitespace words of the context, and the word index of every character."""
    words: list[str] = []
    char_to_word_offset = []
    after_space = True
    for char in context:
        if _is_whitespace(char):
            after_space = True
        elif after_space:
            words.append(char)
            after_space = False
        else:
            words[-1] += char
        char_to_word_offset.append(len(words) - 1)
    return words, char_to_word_offset


def _json_questions(path: str) -> Iterator[_Question]:
    """Questions of an official SQuAD JSON file (v1.1 or v2.0)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"SQuAD file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a valid JSON file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError(
            f'{path}: expected the official SQuAD layout, an object with a "data" list of articles'
        )
    for article_index, article in enumerate(data["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise ValueError(f'{path}: data[{article_index}] is not an article with a "paragraphs" list')
        for paragraph_index, paragraph in enumerate(paragraphs):
            where = f"{path}: data[{article_index}].paragraphs[{paragraph_index}]"
            try:
                context = paragraph["context"]
                for qa in paragraph["qas"]:
                    answers = [(a["text"], int(a["answer_start"])) for a in qa.get("answers", [])]
                    yield _Question(
                        qa["id"], qa["question"], context, answers, bool(qa.get("is_impossible", False))
                    )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: malformed SQuAD entry, missing or bad field {e}") from None


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _tfds_questions(name: str, split: str, data_dir: str | None) -> Iterator[_Question]:
    """Questions of a prepared tfds dataset with the features of `squad/v1.1` or `squad/v2.0`."""
    from bertjax.data.corpus import _open_tfds_source  # Lazy: tfds is slow to import.

    source = _open_tfds_source(name, split, data_dir)
    for record in source:
        answers = record["answers"]
        pairs = [(_text(t), int(s)) for t, s in zip(answers["text"], answers["answer_start"])]
        is_impossible = bool(record.get("is_impossible", False))
        yield _Question(
            _text(record["id"]), _text(record["question"]), _text(record["context"]), pairs, is_impossible
        )


def _questions(source: str, data_dir: str | None) -> Iterator[_Question]:
    if not source.startswith("tfds:"):
        return _json_questions(source)
    name, _, split = source[len("tfds:") :].partition(":")  # A split may be sliced: "train[:10%]".
    if not name or not split:
        raise ValueError(f"tfds source must look like 'tfds:squad/v1.1:validation', got {source!r}")
    return _tfds_questions(name, split, data_dir)


def _training_span(
    question: _Question, words: list[str], char_to_word: list[int]
) -> tuple[str, int, int] | str:
    """(answer text, start word, end word) of the first answer, or the reason to skip it."""
    if not question.answers or not question.answers[0][0]:
        return "no_answer"
    text, start_char = question.answers[0]
    end_char = start_char + len(text) - 1
    if start_char < 0 or end_char >= len(char_to_word):
        return "answer_outside_context"
    start, end = char_to_word[start_char], char_to_word[end_char]
    # The original compares whitespace-joined words with the whitespace-cleaned answer, so
    # answers that don't match at their offset (bad annotation) are skipped.
    if " ".join(words[start : end + 1]).find(" ".join(text.split())) == -1:
        return "answer_not_found"
    return text, start, end


def read_squad(
    source: str, is_training: bool, version_2_with_negative: bool, data_dir: str | None = None
) -> tuple[list[SquadExample], dict[str, int]]:
    """Reads SQuAD questions from an official JSON path or `tfds:NAME:SPLIT` (tfds `data_dir`).

    Returns the examples and counts of skipped training questions by reason (also logged):
    no_answer, answer_outside_context, answer_not_found.
    """
    examples = []
    skipped: dict[str, int] = collections.Counter()
    split_cache: dict[str, tuple[list[str], list[int]]] = {}
    for question in _questions(source, data_dir):
        if question.context not in split_cache:  # Questions come grouped by context: keep the last.
            split_cache = {question.context: split_context(question.context)}
        words, char_to_word = split_cache[question.context]
        example = SquadExample(
            qas_id=question.qas_id,
            question_text=question.question,
            doc_tokens=words,
            is_impossible=version_2_with_negative and question.is_impossible,
            answers=[text for text, _ in question.answers],
        )
        if is_training and not example.is_impossible:
            span = _training_span(question, words, char_to_word)
            if isinstance(span, str):
                skipped[span] += 1
                logging.warning(
                    "Skipping SQuAD question %s (%s): answer %r", question.qas_id, span, question.answers[:1]
                )
                continue
            example.orig_answer_text, example.start_position, example.end_position = span
        examples.append(example)
    if skipped:
        logging.warning("%s: read %d questions, skipped %s", source, len(examples), dict(skipped))
    return examples, dict(skipped)


# ---------------------------------------------------------------------------
# Features


def _doc_spans(num_tokens: int, max_tokens_for_doc: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) windows over the document tokens, `doc_stride` apart, the last reaching the end."""
    spans = []
    start = 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens_for_doc)
        spans.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, doc_stride)
    return spans


def _max_context_span(spans: Sequence[tuple[int, int]], num_tokens: int) -> np.ndarray:
    """For every document token, the span giving it the most context (the original's
    _check_is_max_context): score min(left, right context) + 0.01 * span length, first best wins."""
    best_score = np.full(num_tokens, -np.inf)
    best_span = np.zeros(num_tokens, dtype=np.int64)
    for index, (start, length) in enumerate(spans):
        positions = np.arange(start, start + length)
        score = np.minimum(positions - start, start + length - 1 - positions) + 0.01 * length
        better = score > best_score[positions]
        best_score[positions[better]] = score[better]
        best_span[positions[better]] = index
    return best_span


def _improve_answer_span(
    doc_tokens: Sequence[str], start: int, end: int, tokenize: Callable[[str], list[str]], answer_text: str
) -> tuple[int, int]:
    """The sub-span of [start, end] whose tokens equal the tokenized answer, if any.

    A word such as "(1895-1943)." maps to several tokens of which the answer "1895" is one; the
    word-level span would take them all.
    """
    answer = " ".join(tokenize(answer_text))
    for new_start in range(start, end + 1):
        for new_end in range(end, new_start - 1, -1):
            if " ".join(doc_tokens[new_start : new_end + 1]) == answer:
                return new_start, new_end
    return start, end


def _subword_document(
    words: Sequence[str], tokenize_word: Callable[[str], list[str]]
) -> tuple[list[str], list[int], list[int]]:
    """Sub-tokens of all words, the word of every sub-token, and every word's first sub-token."""
    tokens, token_to_word, word_to_token = [], [], []
    for word_index, word in enumerate(words):
        word_to_token.append(len(tokens))
        for piece in tokenize_word(word):
            token_to_word.append(word_index)
            tokens.append(piece)
    return tokens, token_to_word, word_to_token


def _answer_tokens(
    example: SquadExample, doc: Sequence[str], word_to_token: Sequence[int], tokenizer: Tokenizer
) -> tuple[int, int]:
    """First and last document token of a training answer: its words' tokens, then narrowed."""
    start = word_to_token[example.start_position]
    after = example.end_position + 1
    end = word_to_token[after] - 1 if after < len(word_to_token) else len(doc) - 1
    return _improve_answer_span(doc, start, end, tokenizer.tokenize, example.orig_answer_text)


def convert_examples_to_features(
    examples: Sequence[SquadExample],
    tokenizer: Tokenizer,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    is_training: bool = False,
) -> tuple[SquadFeatures, dict[str, int]]:
    """Windows of every example as model inputs, with training targets when `is_training`.

    Counts: examples, features, truncated_queries, multi_window_examples,
    examples_without_features (empty documents), and when training out_of_window_features
    (answer not fully inside, target [CLS]) and impossible_features.
    """
    tokenize_word = functools.cache(tokenizer.tokenize)  # Contexts repeat across questions.
    counts = {"examples": len(examples), "truncated_queries": 0, "multi_window_examples": 0}
    counts.update(examples_without_features=0, out_of_window_features=0, impossible_features=0)
    rows: dict[str, list[Any]] = collections.defaultdict(list)
    for example_index, example in enumerate(examples):
        query = tokenizer.tokenize(example.question_text)
        if len(query) > max_query_length:
            counts["truncated_queries"] += 1
            query = query[:max_query_length]
        max_tokens_for_doc = max_seq_length - len(query) - 3
        if max_tokens_for_doc < 1:
            raise ValueError(
                f"max_seq_length {max_seq_length} leaves no room for the document of question "
                f"{example.qas_id!r} after its {len(query)}-token query; raise it or lower max_query_length"
            )
        doc, token_to_word, word_to_token = _subword_document(example.doc_tokens, tokenize_word)
        answer = None
        if is_training and not example.is_impossible:
            if not 0 <= example.start_position <= example.end_position < len(example.doc_tokens):
                raise ValueError(
                    f"training example {example.qas_id!r} has no answer word span "
                    f"({example.start_position}, {example.end_position}); read it with is_training=True"
                )
            answer = _answer_tokens(example, doc, word_to_token, tokenizer)
        spans = _doc_spans(len(doc), max_tokens_for_doc, doc_stride)
        counts["multi_window_examples"] += len(spans) > 1
        counts["examples_without_features"] += not spans
        best_span = _max_context_span(spans, len(doc))
        for span_index, (span_start, span_length) in enumerate(spans):
            window = slice(span_start, span_start + span_length)
            tokens = [CLS, *query, SEP, *doc[window], SEP]
            positions = range(len(query) + 2, len(query) + 2 + span_length)
            token_to_orig = dict(zip(positions, token_to_word[window]))
            max_context = dict(zip(positions, (best_span[window] == span_index).tolist()))
            start_target = end_target = 0
            if answer is not None:
                if span_start <= answer[0] and answer[1] < span_start + span_length:
                    offset = len(query) + 2 - span_start
                    start_target, end_target = answer[0] + offset, answer[1] + offset
                else:
                    counts["out_of_window_features"] += 1
            counts["impossible_features"] += is_training and example.is_impossible
            padding = [0] * (max_seq_length - len(tokens))
            rows["input_ids"].append(tokenizer.convert_tokens_to_ids(tokens) + padding)
            rows["input_mask"].append([1] * len(tokens) + padding)
            rows["segment_ids"].append([0] * (len(query) + 2) + [1] * (span_length + 1) + padding)
            rows["start_positions"].append(start_target)
            rows["end_positions"].append(end_target)
            rows["example_index"].append(example_index)
            rows["doc_span_index"].append(span_index)
            rows["tokens"].append(tokens)
            rows["token_to_orig_map"].append(token_to_orig)
            rows["token_is_max_context"].append(max_context)
    counts["features"] = len(rows["example_index"])
    if counts["examples_without_features"]:
        logging.warning(
            "%d SQuAD examples have an empty context and get no features", counts["examples_without_features"]
        )
    array = functools.partial(np.array, dtype=np.int32)
    features = SquadFeatures(
        input_ids=array(rows["input_ids"]).reshape(-1, max_seq_length),
        input_mask=array(rows["input_mask"]).reshape(-1, max_seq_length),
        segment_ids=array(rows["segment_ids"]).reshape(-1, max_seq_length),
        start_positions=array(rows["start_positions"]),
        end_positions=array(rows["end_positions"]),
        example_index=rows["example_index"],
        doc_span_index=rows["doc_span_index"],
        tokens=rows["tokens"],
        token_to_orig_map=rows["token_to_orig_map"],
        token_is_max_context=rows["token_is_max_context"],
    )
    return features, counts


# ---------------------------------------------------------------------------
# Post-processing


def _join_pieces(pieces: Sequence[str]) -> str:
    """Text of sub-tokens: WordPiece drops "##" continuations, SentencePiece turns "▁" into spaces."""
    if any(p.startswith("\u2581") for p in pieces):
        text = "".join(pieces).replace("\u2581", " ")
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
    start_ok = np.array([s in token_map and max_context.get(s, False) for s in starts.tolist()], dtype=bool)
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


def _example_prediction(
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
    candidates.sort(key=lambda c: c.start_logit + c.end_logit, reverse=True)  # Stable, as the original.

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
    os.makedirs(directory, exist_ok=True)
    outputs = {"predictions.json": predictions, "nbest_predictions.json": nbest}
    if null_odds:
        outputs["null_odds.json"] = null_odds
    for name, content in outputs.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=4)
            f.write("\n")
