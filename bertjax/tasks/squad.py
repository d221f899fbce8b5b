"""SQuAD v1.1/v2.0: reading and features with the original run_squad.py semantics
(post-processing and the fine-tuning adapter: `squad_predict`).

  * Reading (`read_squad`): official JSON files or prepared tfds datasets (`tfds:squad/v1.1:train`).
    The context is split on whitespace (" \\t\\r\\n" and U+202F) into `doc_tokens`; a training
    answer is located through the character-to-word map of its `answer_start`. Training questions
    whose answer text is not found at that place are counted and skipped, with a warning.
  * Features (`convert_examples_to_features`): `[CLS] query [SEP] doc [SEP]` windows of the
    WordPiece-split document, `doc_stride` apart; each document token records the word it came
    from and whether this window gives it the most context (min(left, right) + 0.01 * length).
    Training targets are token positions, 0 ([CLS]) when the answer is not fully inside the
    window or the question is unanswerable.

Deviations from the original, all for robustness: a training question with several answers uses
the first (the original raised); answers whose offsets fall outside the context are counted and
skipped (the original raised IndexError). `read_squad` takes an optional `data_dir` for tfds.
Plausible answers of v2.0 are not used, as in the original.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from absl import logging

from bertjax.data import tfds_source
from bertjax.data.tokenization import CLS, SEP, Tokenizer
from bertjax.runtime import files
from bertjax.tasks.features import word_tokenizer


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
        with files.open(path, encoding="utf-8") as f:
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
            raise ValueError(
                f'{path}: data[{article_index}] is not an article with a "paragraphs" list'
            )
        for paragraph_index, paragraph in enumerate(paragraphs):
            where = f"{path}: data[{article_index}].paragraphs[{paragraph_index}]"
            try:
                context = _string(paragraph["context"], "context")
                for qa in paragraph["qas"]:
                    answers = [
                        (_string(a["text"], "text"), int(a["answer_start"]))
                        for a in qa.get("answers", [])
                    ]
                    yield _Question(
                        qa["id"],
                        _string(qa["question"], "question"),
                        context,
                        answers,
                        bool(qa.get("is_impossible", False)),
                    )
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(
                    f"{where}: malformed SQuAD entry, missing or bad field {e}"
                ) from None


def _string(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field!r} is {type(value).__name__}, not text")
    return value


def _text(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _tfds_questions(name: str, split: str, data_dir: str | None) -> Iterator[_Question]:
    """Questions of a prepared tfds dataset with the features of `squad/v1.1` or `squad/v2.0`."""

    source = tfds_source.open_tfds_source(name, split, data_dir)
    for record in source:
        answers = record["answers"]
        pairs = [(_text(t), int(s)) for t, s in zip(answers["text"], answers["answer_start"])]
        is_impossible = bool(record.get("is_impossible", False))
        yield _Question(
            _text(record["id"]),
            _text(record["question"]),
            _text(record["context"]),
            pairs,
            is_impossible,
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
                    "Skipping SQuAD question %s (%s): answer %r",
                    question.qas_id,
                    span,
                    question.answers[:1],
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
    doc_tokens: Sequence[str],
    start: int,
    end: int,
    tokenize: Callable[[str], list[str]],
    answer_text: str,
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
    tokens: list[str] = []
    token_to_word: list[int] = []
    word_to_token: list[int] = []
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
    return _improve_answer_span(
        doc, start, end, word_tokenizer(tokenizer), example.orig_answer_text
    )


def convert_examples_to_features(  # noqa: PLR0915 (run_squad.py's, step for step)
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
    # Contexts repeat across questions.
    tokenize_word = functools.cache(word_tokenizer(tokenizer))
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
            "%d SQuAD examples have an empty context and get no features",
            counts["examples_without_features"],
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
