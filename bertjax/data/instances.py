"""Pretraining instances with the semantics of Google's original ``create_pretraining_data.py``.

Everything works on token ids. ``create_instances`` makes the sentence pairs
(segment A, segment B, is-random-next label), drawing from a ``random.Random`` in exactly
the order the original does, so the same seed gives the same structure. The one difference:
the original masks each pair right after creating it, with the same RNG; here masking is
separate (``data.masking``: whole chunks of pairs at once, statically or again every epoch),
with its own random stream. The pair structure equals the original's run with the masking
draws left out of the RNG stream.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import numpy as np

Sentence = Sequence[int] | np.ndarray  # token ids (int32 arrays, as tokenized)
TokenDocument = Sequence[Sentence]


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens, and which tokens masking must skip or group.

    ``never_mask`` lists ids that are never chosen for prediction, in addition to
    ``cls_id`` and ``sep_id``. ``continuation`` (bool, one entry per vocabulary
    id) marks tokens that continue the previous word, e.g. WordPiece "##" pieces;
    only whole-word masking needs it.
    """

    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    vocab_size: int
    never_mask: frozenset[int] = frozenset()
    continuation: np.ndarray | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.continuation is not None and self.continuation.shape != (self.vocab_size,):
            raise ValueError(
                f"continuation must have shape ({self.vocab_size},), got {self.continuation.shape}."
            )

    @property
    def unmaskable(self) -> frozenset[int]:
        """All ids that are never masked: [CLS], [SEP] and ``never_mask``."""
        return self.never_mask | {self.cls_id, self.sep_id}


@dataclasses.dataclass(frozen=True, eq=False)
class Instance:
    """One unmasked sentence pair: ``[CLS] A [SEP] B [SEP]`` (compare arrays, not instances)."""

    tokens: np.ndarray  # int32 [length]
    b_start: int  # where segment B starts (len(tokens) when there is none)
    is_random_next: bool

    @property
    def segment_ids(self) -> np.ndarray:
        """int32 [length]: 0 for [CLS] A [SEP], 1 for B [SEP]."""
        return (np.arange(len(self.tokens)) >= self.b_start).astype(np.int32)


# ---------------------------------------------------------------------------
# Sentence pairs
# ---------------------------------------------------------------------------


def _random_segments(
    documents: Sequence[TokenDocument], document_index: int, target_length: int, rng: random.Random
) -> list[Sentence]:
    """Segment B's sentences for a random next: consecutive sentences of another document.

    Like the original, this tries 10 times to draw a different document; with a
    single-document corpus it therefore uses the same document (still labelled
    random next).
    """
    for _ in range(10):
        random_index = rng.randint(0, len(documents) - 1)
        if random_index != document_index:
            break
    random_document = documents[random_index]
    start = rng.randint(0, len(random_document) - 1)
    taken, length = [], 0
    for segment in random_document[start:]:
        taken.append(segment)
        length += len(segment)
        if length >= target_length:
            break
    return taken


def _trims(
    a_length: int, b_length: int, max_num_tokens: int, rng: random.Random
) -> tuple[int, int, int, int]:
    """How many tokens the original's truncation takes from the front and back of A, then of
    B: it trims the longer segment (B on ties) at a random end, a token at a time, until the
    pair fits, with one ``rng.random()`` per token, as drawn here."""
    trims = a_length + b_length - max_num_tokens
    if trims <= 0:
        return 0, 0, 0, 0
    from_front = [rng.random() < 0.5 for _ in range(trims)]
    # Which segment loses each token follows from the lengths alone: the longer one until
    # both are equal, then B and A in turn.
    lead = min(abs(a_length - b_length), trims)
    leading, rest_b, rest_a = from_front[:lead], from_front[lead::2], from_front[lead + 1 :: 2]
    a_draws, b_draws = (
        (leading + rest_a, rest_b) if a_length > b_length else (rest_a, leading + rest_b)
    )
    a_front, b_front = sum(a_draws), sum(b_draws)
    return a_front, len(a_draws) - a_front, b_front, len(b_draws) - b_front


def _make_instance(
    segments_a: list[Sentence],
    segments_b: list[Sentence],
    is_random_next: bool,
    max_num_tokens: int,
    rng: random.Random,
    specials: SpecialTokens,
) -> Instance:
    """``[CLS] A [SEP] B [SEP]`` of the sentences, truncated to fit (`_trims`), or
    ``[CLS] A [SEP]`` (one segment) when B is empty."""
    a_length = sum(map(len, segments_a))
    b_length = sum(map(len, segments_b))
    a_front, a_back, b_front, b_back = _trims(a_length, b_length, max_num_tokens, rng)
    joined = np.concatenate([*segments_a, *segments_b])
    a = joined[a_front : a_length - a_back]
    b = joined[a_length + b_front : a_length + b_length - b_back]
    assert len(a), "segment A must keep at least one token"
    tokens = np.empty(len(a) + len(b) + (3 if len(b) else 2), np.int32)
    tokens[0], tokens[len(a) + 1], tokens[-1] = specials.cls_id, specials.sep_id, specials.sep_id
    tokens[1 : len(a) + 1] = a
    tokens[len(a) + 2 : len(tokens) - 1] = b
    return Instance(tokens, min(len(a) + 2, len(tokens)), is_random_next)


def _instances_from_document(
    documents: Sequence[TokenDocument],
    document_index: int,
    max_seq_length: int,
    short_seq_prob: float,
    rng: random.Random,
    specials: SpecialTokens,
    next_sentence_prediction: bool = True,
) -> list[Instance]:
    """Cuts one document into sentence pairs (the original ``create_instances_from_document``).

    Without ``next_sentence_prediction`` B is always the chunk's actual continuation, and a
    one-sentence chunk becomes a one-segment instance ``[CLS] A [SEP]`` (the paper's "No NSP").
    """
    document = documents[document_index]
    max_num_tokens = max_seq_length - 3  # Room for [CLS], [SEP], [SEP].
    # As in the original, the (sometimes short) target is drawn once per document.
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)

    instances = []
    chunk: list[Sentence] = []
    chunk_length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target_seq_length:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            segments_a = chunk[:a_end]
            is_random_next = next_sentence_prediction and (len(chunk) == 1 or rng.random() < 0.5)
            if is_random_next:
                target_b_length = target_seq_length - sum(map(len, segments_a))
                segments_b = _random_segments(documents, document_index, target_b_length, rng)
                # B came from elsewhere, so the chunk's unused sentences start the next pair.
                i -= len(chunk) - a_end
            else:
                segments_b = chunk[a_end:]
            instances.append(
                _make_instance(
                    segments_a, segments_b, is_random_next, max_num_tokens, rng, specials
                )
            )
            chunk = []
            chunk_length = 0
        i += 1
    return instances


def _check_documents(documents: Sequence[TokenDocument]) -> None:
    for doc_index, document in enumerate(documents):
        if not document:
            raise ValueError(f"Document {doc_index} is empty; drop empty documents first.")
        for sentence_index, sentence in enumerate(document):
            if not len(sentence):
                raise ValueError(
                    f"Sentence {sentence_index} of document {doc_index} has no tokens; "
                    "drop empty sentences first."
                )


def create_instances(
    documents: Sequence[TokenDocument],
    max_seq_length: int,
    short_seq_prob: float,
    dupe_factor: int,
    rng: random.Random,
    specials: SpecialTokens,
    next_sentence_prediction: bool = True,
) -> list[Instance]:
    """Makes unmasked sentence pairs from tokenized documents, as the original does.

    ``documents`` are lists of non-empty sentences of token ids. Like the original,
    the documents are shuffled once (on a copy), then every document is cut into
    pairs ``dupe_factor`` times, then all pairs are shuffled. An empty corpus
    gives ``[]``; a one-document corpus takes "random" B segments from itself.
    ``next_sentence_prediction=False``: no random B (see ``_instances_from_document``).
    """
    if max_seq_length < 5:
        raise ValueError(
            f"max_seq_length must be at least 5 ([CLS] A [SEP] B [SEP]), got {max_seq_length}."
        )
    _check_documents(documents)
    if not documents:
        return []
    all_documents = list(documents)
    rng.shuffle(all_documents)
    instances = []
    for _ in range(dupe_factor):
        for document_index in range(len(all_documents)):
            instances.extend(
                _instances_from_document(
                    all_documents,
                    document_index,
                    max_seq_length,
                    short_seq_prob,
                    rng,
                    specials,
                    next_sentence_prediction,
                )
            )
    rng.shuffle(instances)
    return instances


# ---------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------


def _padded(
    values: np.ndarray, length: int, pad: int | float, dtype: type, name: str
) -> np.ndarray:
    if len(values) > length:
        raise ValueError(f"{name} has {len(values)} entries, more than the fixed size {length}.")
    out: np.ndarray = np.full(length, pad, dtype)
    out[: len(values)] = values
    return out


def to_features(
    tokens: np.ndarray,
    segment_ids: np.ndarray,
    is_random_next: bool,
    masked_positions: np.ndarray,
    masked_labels: np.ndarray,
    max_seq_length: int,
    max_predictions_per_seq: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """The original pretraining TFRecord features as fixed-shape numpy arrays.

    ``next_sentence_labels`` is 1 for a random B and 0 when B really follows A.
    Padding prediction slots have position 0, id 0 and weight 0.0.
    """
    seq, preds = max_seq_length, max_predictions_per_seq
    return {
        "input_ids": _padded(tokens, seq, pad_id, np.int32, "tokens"),
        "input_mask": _padded(np.ones(len(tokens)), seq, 0, np.int32, "tokens"),
        "segment_ids": _padded(segment_ids, seq, 0, np.int32, "segment_ids"),
        "masked_lm_positions": _padded(masked_positions, preds, 0, np.int32, "masked_positions"),
        "masked_lm_ids": _padded(masked_labels, preds, 0, np.int32, "masked_labels"),
        "masked_lm_weights": _padded(
            np.ones(len(masked_labels)), preds, 0.0, np.float32, "masked_labels"
        ),
        "next_sentence_labels": np.array(int(is_random_next), np.int32),
    }
