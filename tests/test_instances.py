"""Tests for bertjax.data.instances: sentence pairs, masking and features."""

import itertools
import random

import numpy as np
import pytest

from bertjax.data import instances as inst

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
VOCAB = 1000
SPECIALS = inst.SpecialTokens(
    cls_id=CLS,
    sep_id=SEP,
    mask_id=MASK,
    pad_id=PAD,
    vocab_size=VOCAB,
    never_mask=frozenset({PAD, UNK}),
)
SEQ, PREDS = 128, 20


def make_corpus(seed: int, num_docs: int = 200, num_single: int = 20) -> list[list[list[int]]]:
    """Docs of 2-30 sentences of 1-40 ids in [5, 1000) (a few [UNK]), then one-sentence docs."""
    rng = random.Random(seed)

    def sentence() -> list[int]:
        length = rng.randint(1, 40)
        return [UNK if rng.random() < 0.02 else rng.randrange(5, VOCAB) for _ in range(length)]

    docs = [[sentence() for _ in range(rng.randint(2, 30))] for _ in range(num_docs)]
    return docs + [[sentence()] for _ in range(num_single)]


@pytest.fixture(scope="module")
def corpus():
    return make_corpus(0)


@pytest.fixture(scope="module")
def pairs(corpus):
    return inst.create_instances(corpus, SEQ, 0.1, 5, random.Random(12345), SPECIALS)


def split_pair(instance):
    """Returns (A, B) of a ``[CLS] A [SEP] B [SEP]`` instance."""
    first_sep = int(np.flatnonzero(instance.tokens == SEP)[0])
    return instance.tokens[1:first_sep].tolist(), instance.tokens[first_sep + 1 : -1].tolist()


# ---------------------------------------------------------------------------
# Sentence pairs
# ---------------------------------------------------------------------------


def test_instance_layout(pairs):
    assert len(pairs) > 2000
    for p in pairs:
        seps = np.flatnonzero(p.tokens == SEP)
        assert p.tokens.dtype == p.segment_ids.dtype == np.int32
        assert p.tokens[0] == CLS and len(seps) == 2 and seps[1] == len(p.tokens) - 1
        assert seps[0] - 1 >= 1 and seps[1] - seps[0] >= 2  # A and B are non-empty.
        assert (p.segment_ids[: seps[0] + 1] == 0).all()
        assert (p.segment_ids[seps[0] + 1 :] == 1).all()
        assert len(p.tokens) <= SEQ


def test_pairs_come_from_consecutive_sentences(corpus, pairs):
    """Without truncation, A+B of a real next pair is a run of whole sentences of one document."""
    runs = {
        tuple(token for sentence in doc[start:stop] for token in sentence)
        for doc in corpus
        for start in range(len(doc))
        for stop in range(start + 2, len(doc) + 1)
        if sum(map(len, doc[start:stop])) <= SEQ - 3
    }
    untruncated_next = [p for p in pairs if not p.is_random_next and len(p.tokens) < SEQ]
    assert len(untruncated_next) > 100
    assert all(
        tuple(itertools.chain.from_iterable(split_pair(p))) in runs for p in untruncated_next
    )


def test_next_sentence_is_random_about_half_the_time():
    multi_docs = make_corpus(1, num_single=0)
    multi = inst.create_instances(multi_docs, SEQ, 0.1, 5, random.Random(1), SPECIALS)
    fraction = np.mean([p.is_random_next for p in multi])
    assert 0.45 < fraction < 0.6  # A bit above 0.5: one-sentence chunks at document ends.
    singles = [doc[:1] for doc in make_corpus(2)]
    single_pairs = inst.create_instances(singles, SEQ, 0.1, 2, random.Random(2), SPECIALS)
    assert len(single_pairs) == 2 * len(singles)
    assert all(p.is_random_next for p in single_pairs)


class RecordingRandom(random.Random):
    """Counts randint calls by their bounds."""

    def __init__(self, seed):
        super().__init__(seed)
        self.randint_bounds = []

    def randint(self, a, b):
        self.randint_bounds.append((a, b))
        return super().randint(a, b)


def test_short_seq_prob_shortens_about_that_fraction_of_targets(corpus):
    rng = RecordingRandom(3)
    inst.create_instances(corpus, SEQ, 0.1, 5, rng, SPECIALS)
    # Only the short target is drawn with bounds (2, max_num_tokens), once per document pass.
    short_fraction = rng.randint_bounds.count((2, SEQ - 3)) / (5 * len(corpus))
    assert 0.07 < short_fraction < 0.13

    def mean_length(short_seq_prob):
        pairs = inst.create_instances(corpus, SEQ, short_seq_prob, 1, random.Random(4), SPECIALS)
        return np.mean([len(p.tokens) for p in pairs])

    assert mean_length(1.0) < 0.8 * mean_length(0.0)


def test_truncation_draws_and_trims_as_the_original_loop():
    """The original trims one token at a time (the longer segment, B on ties, at the front
    if rng.random() < 0.5); the batched trim gives the same segments and RNG state."""

    def original(a, b, max_num_tokens, rng):
        a, b = a.tolist(), b.tolist()
        while len(a) + len(b) > max_num_tokens:
            trunc = a if len(a) > len(b) else b
            if rng.random() < 0.5:
                del trunc[0]
            else:
                trunc.pop()
        return [a, b]

    sizes = random.Random(0)
    for seed in range(300):
        a = np.arange(sizes.randint(1, 90), dtype=np.int32)
        b = np.arange(100, 100 + sizes.randint(0, 90), dtype=np.int32)
        limit = sizes.randint(max(1, len(a) // 2), 130)
        ours, theirs = random.Random(seed), random.Random(seed)
        a_front, a_back, b_front, b_back = inst._trims(len(a), len(b), limit, ours)
        got = a[a_front : len(a) - a_back], b[b_front : len(b) - b_back]
        want = original(a, b, limit, theirs)
        assert [x.tolist() for x in got] == want and ours.random() == theirs.random()


def test_truncation_fits_and_cuts_front_and_back():
    # Ids are unique and increasing, so sentence starts/ends are recognizable.
    rng = random.Random(5)
    next_id = 5
    docs, starts, ends = [], set(), set()
    for _ in range(60):
        doc = []
        for _ in range(rng.randint(1, 6)):
            length = rng.randint(1, 120)
            doc.append(list(range(next_id, next_id + length)))
            starts.add(next_id)
            ends.add(next_id + length - 1)
            next_id += length
        docs.append(doc)
    specials = inst.SpecialTokens(CLS, SEP, MASK, PAD, vocab_size=next_id)
    pairs = inst.create_instances(docs, 64, 0.1, 3, random.Random(6), specials)
    cut_front = cut_back = 0
    for p in pairs:
        assert len(p.tokens) <= 64
        for segment in split_pair(p):
            cut_front += segment[0] not in starts
            cut_back += segment[-1] not in ends
    assert cut_front > 20 and cut_back > 20


class ScriptedRandom(random.Random):
    """Replays scripted results and checks that the calls come in the expected order."""

    def __init__(self, script):
        super().__init__(0)
        self.script = list(script)

    def _next(self, *call):
        expected_call, result = self.script.pop(0)
        assert call == expected_call
        return result

    def random(self):
        return self._next("random")

    def randint(self, a, b):
        return self._next("randint", a, b)

    def shuffle(self, x):
        if self._next("shuffle", len(x)) == "reverse":
            x.reverse()


def test_rng_call_order_with_truncation_and_short_target():
    docs = [[[10, 11], [12, 13], [14, 15]], [[20, 21, 22]]]
    rng = ScriptedRandom(
        [
            (("shuffle", 2), None),
            # Document 0: full target 4; the first chunk is two sentences, B is the real next.
            (("random",), 0.5),
            (("randint", 1, 1), 1),
            (("random",), 0.7),
            # Last sentence alone: random next from document 1, B too long, cut from the front.
            (("randint", 0, 1), 1),
            (("randint", 0, 0), 0),
            (("random",), 0.3),
            # Document 1: short target 2; random next, document 0 from sentence 1; A cut at the back.
            (("random",), 0.05),
            (("randint", 2, 4), 2),
            (("randint", 0, 1), 0),
            (("randint", 0, 2), 1),
            (("random",), 0.9),
            (("shuffle", 3), None),
        ]
    )
    pairs = inst.create_instances(docs, 7, 0.1, 1, rng, SPECIALS)
    assert not rng.script
    assert [p.tokens.tolist() for p in pairs] == [
        [CLS, 10, 11, SEP, 12, 13, SEP],
        [CLS, 14, 15, SEP, 21, 22, SEP],
        [CLS, 20, 21, SEP, 12, 13, SEP],
    ]
    assert [p.is_random_next for p in pairs] == [False, True, True]


def test_rng_call_order_puts_back_unused_sentences():
    docs = [[[10], [11], [12]], [[20], [21]]]
    rng = ScriptedRandom(
        [
            (("shuffle", 2), None),
            # Chunk of 3 sentences, A = [10], random next: document 0 is redrawn, B from document 1.
            (("random",), 0.5),
            (("randint", 1, 2), 1),
            (("random",), 0.2),
            (("randint", 0, 1), 0),
            (("randint", 0, 1), 1),
            (("randint", 0, 1), 1),
            # The unused sentences 11 and 12 form the next pair.
            (("randint", 1, 1), 1),
            (("random",), 0.6),
            (("random",), 0.9),
            (("randint", 1, 1), 1),
            (("random",), 0.99),
            (("shuffle", 3), "reverse"),
        ]
    )
    pairs = inst.create_instances(docs, 20, 0.0, 1, rng, SPECIALS)
    assert not rng.script
    assert [p.tokens.tolist() for p in pairs] == [
        [CLS, 20, SEP, 21, SEP],
        [CLS, 11, SEP, 12, SEP],
        [CLS, 10, SEP, 21, SEP],
    ]


def test_same_seed_same_instances(corpus, pairs):
    again = inst.create_instances(corpus, SEQ, 0.1, 5, random.Random(12345), SPECIALS)
    assert len(again) == len(pairs)
    for a, b in zip(again, pairs):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.segment_ids, b.segment_ids)
        assert a.is_random_next == b.is_random_next
    other = inst.create_instances(corpus, SEQ, 0.1, 5, random.Random(54321), SPECIALS)
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(other, pairs))


def test_caller_documents_are_not_reordered(corpus):
    before = [list(map(list, doc)) for doc in corpus[:5]]
    inst.create_instances(corpus[:5], SEQ, 0.1, 1, random.Random(0), SPECIALS)
    assert corpus[:5] == before


def test_single_document_corpus_draws_random_b_from_itself():
    doc = [[10 + i] * 5 for i in range(12)]
    pairs = inst.create_instances([doc], 32, 0.0, 3, random.Random(8), SPECIALS)
    assert pairs and any(p.is_random_next for p in pairs)
    doc_tokens = {token for sentence in doc for token in sentence}
    assert all(set(p.tokens.tolist()) - {CLS, SEP} <= doc_tokens for p in pairs)


def test_empty_corpus_and_bad_input():
    assert inst.create_instances([], SEQ, 0.1, 5, random.Random(0), SPECIALS) == []
    with pytest.raises(ValueError, match="Sentence 1 of document 0"):
        inst.create_instances([[[5], []]], SEQ, 0.1, 1, random.Random(0), SPECIALS)
    with pytest.raises(ValueError, match="Document 1 is empty"):
        inst.create_instances([[[5]], []], SEQ, 0.1, 1, random.Random(0), SPECIALS)
    with pytest.raises(ValueError, match="at least 5"):
        inst.create_instances([[[5]]], 4, 0.1, 1, random.Random(0), SPECIALS)


# ---------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------


def test_to_features_shapes_and_padding(pairs):
    p = pairs[0]
    positions = np.array([1, 3], np.int32)
    labels = p.tokens[positions]
    tokens = p.tokens.copy()
    tokens[positions] = MASK
    features = inst.to_features(
        tokens, p.segment_ids, p.is_random_next, positions, labels, SEQ, PREDS, PAD
    )
    n, k = len(tokens), len(positions)
    assert {name: (f.shape, f.dtype) for name, f in features.items()} == {
        "input_ids": ((SEQ,), np.int32),
        "input_mask": ((SEQ,), np.int32),
        "segment_ids": ((SEQ,), np.int32),
        "masked_lm_positions": ((PREDS,), np.int32),
        "masked_lm_ids": ((PREDS,), np.int32),
        "masked_lm_weights": ((PREDS,), np.float32),
        "next_sentence_labels": ((), np.int32),
    }
    assert np.array_equal(features["input_ids"][:n], tokens)
    assert (features["input_ids"][n:] == PAD).all()
    assert features["input_mask"].sum() == n and features["input_mask"][:n].all()
    assert np.array_equal(features["segment_ids"][:n], p.segment_ids)
    assert not features["segment_ids"][n:].any()
    assert np.array_equal(features["masked_lm_positions"][:k], positions)
    assert np.array_equal(features["masked_lm_ids"][:k], labels)
    assert features["masked_lm_weights"].tolist() == [1.0] * k + [0.0] * (PREDS - k)
    assert not features["masked_lm_positions"][k:].any() and not features["masked_lm_ids"][k:].any()
    assert features["next_sentence_labels"] == int(p.is_random_next)


def test_to_features_rejects_overlong_inputs():
    tokens = np.arange(10, dtype=np.int32)
    with pytest.raises(ValueError, match="tokens"):
        inst.to_features(tokens, np.zeros(10), False, np.array([1]), np.array([5]), 8, 4, PAD)
    with pytest.raises(ValueError, match="masked_positions"):
        inst.to_features(tokens, np.zeros(10), False, np.arange(5), np.arange(5), 16, 4, PAD)
