"""Tests for bertjax.data.masking: the original masking rule, applied to chunks of instances.

Statistical checks compare the rule's expectation with what the chunked masking draws, over
thousands of instances, within 4 standard deviations (a false alarm about once in 16,000 runs
per check); every draw is seeded, so a run is repeatable.
"""

import random

import numpy as np
import pytest

from bertjax.data import instances as inst, masking

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
VOCAB = 1000
CONTINUATION = np.arange(VOCAB) % 3 == 0  # every third id continues a word ("##" pieces)
SPECIALS = inst.SpecialTokens(CLS, SEP, MASK, PAD, VOCAB, frozenset({PAD, UNK}), CONTINUATION)
SEQ, PREDS = 128, 20
SIGMAS = 4


def make_rows(seed: int, num: int, unk_share: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    """`num` padded `[CLS] A [SEP] B [SEP]` rows of 5-128 tokens (ids 5..VOCAB-1, some [UNK])."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, SEQ + 1, num)
    tokens = rng.integers(5, VOCAB, (num, SEQ)).astype(np.int32)
    tokens[rng.random((num, SEQ)) < unk_share] = UNK
    steps = np.arange(SEQ)[None]
    tokens[:, 0] = CLS
    tokens[steps == (lengths[:, None] - 1)] = SEP
    tokens[steps == (lengths[:, None] // 2)] = SEP
    tokens[steps >= lengths[:, None]] = PAD
    return tokens, lengths


@pytest.fixture(scope="module")
def rows():
    return make_rows(0, 6000)


def wanted(lengths, prob=0.15, preds=PREDS):
    return np.minimum(preds, np.maximum(1, np.rint(lengths * prob))).astype(int)


def candidates(tokens, lengths):
    real = np.arange(tokens.shape[1])[None] < lengths[:, None]
    return real & ~np.isin(tokens, [CLS, SEP, PAD, UNK])


def chosen_mask(positions, counts, width=SEQ):
    out = np.zeros((len(positions), width), bool)
    rows, slots = np.nonzero(np.arange(positions.shape[1])[None] < counts[:, None])
    out[rows, positions[rows, slots]] = True
    return out


def within(observed, expected, variance, what):
    assert abs(observed - expected) <= SIGMAS * np.sqrt(variance), (
        f"{what}: {observed} against {expected} +- {SIGMAS} x {np.sqrt(variance):.3g}"
    )


def original_mask(tokens, rng, prob, preds, whole_word, mix=(0.8, 0.1)):
    """The original's create_masked_lm_predictions (per instance, random.Random), with the
    mix's two shares drawn as one choice: the reference the chunked masking must match."""
    groups = []
    for i, token in enumerate(tokens):
        if token in (CLS, SEP, PAD, UNK):
            continue
        if whole_word and groups and CONTINUATION[token]:
            groups[-1].append(i)
        else:
            groups.append([i])
    rng.shuffle(groups)
    num_to_predict = min(preds, max(1, round(len(tokens) * prob)))
    output, positions = list(tokens), []
    for group in groups:
        if len(positions) >= num_to_predict:
            break
        if len(positions) + len(group) > num_to_predict:
            continue
        for index in group:
            u = rng.random()
            if u < mix[0]:
                output[index] = MASK
            elif u < mix[0] + mix[1]:
                output[index] = rng.randint(0, VOCAB - 1)
            positions.append(index)
    return output, sorted(positions)


# ----------------------------------------------------------------------------- exact rules


@pytest.mark.parametrize("prob,preds", [(0.15, PREDS), (0.5, 7), (0.02, PREDS)])
def test_each_instance_gets_the_rules_number_of_predictions(rows, prob, preds):
    tokens, lengths = make_rows(1, 2000, unk_share=0.3)  # some rows with few candidates
    rule = masking.MaskingRule(SPECIALS, prob, preds)
    _, positions, _, counts = rule.apply(tokens, lengths, 5, np.arange(len(tokens)))
    expected = np.minimum(wanted(lengths, prob, preds), candidates(tokens, lengths).sum(1))
    np.testing.assert_array_equal(counts, expected)
    assert (counts < wanted(lengths, prob, preds)).any()  # the few-candidate rows were there
    assert positions.shape == (len(tokens), preds)


def test_specials_are_never_masked_and_labels_are_the_originals(rows):
    tokens, lengths = rows
    ids, positions, labels, counts = masking.MaskingRule(SPECIALS, 0.15, PREDS).apply(
        tokens, lengths, 7, np.arange(len(tokens))
    )
    chosen = chosen_mask(positions, counts)
    assert not (chosen & ~candidates(tokens, lengths)).any()
    assert chosen.sum() == counts.sum()  # no position chosen twice
    slots = np.arange(PREDS)[None] < counts[:, None]
    assert (np.diff(np.where(slots, positions, SEQ), axis=1) > 0)[slots[:, 1:]].all()
    np.testing.assert_array_equal(
        labels, np.where(slots, np.take_along_axis(tokens, positions, 1), 0)
    )
    assert not positions[~slots].any() and not labels[~slots].any()
    np.testing.assert_array_equal(ids[~chosen], tokens[~chosen])  # the rest untouched
    assert ids.dtype == labels.dtype == tokens.dtype


@pytest.mark.parametrize("mix", [(0.8, 0.1), (1.0, 0.0), (0.0, 0.2), (0.5, 0.5)])
def test_replacements_follow_the_mix(rows, mix):
    """80% [MASK] / 10% random id / 10% kept (or the switch's mix), within 4 sigma."""
    tokens, lengths = rows
    ids, positions, labels, counts = masking.MaskingRule(SPECIALS, 0.15, PREDS, mask_mix=mix).apply(
        tokens, lengths, 11, np.arange(len(tokens))
    )
    slots = np.arange(PREDS)[None] < counts[:, None]
    shown = np.take_along_axis(ids, positions, 1)[slots]
    original = labels[slots]
    n = len(shown)
    assert n > 50_000
    hit = mix[1] / VOCAB  # a random id may be [MASK] or the original id
    as_mask, kept = shown == MASK, shown == original
    shares = {
        "mask": (as_mask.sum(), mix[0] + hit),
        "kept": (kept.sum(), 1 - sum(mix) + hit),
        "random": ((~as_mask & ~kept).sum(), mix[1] - 2 * hit),
    }
    for name, (count, p) in shares.items():
        within(count, n * p, n * p * (1 - p) + 1e-9, f"{name} share of {mix}")
    random_ids = shown[~as_mask & ~kept]
    if len(random_ids):  # uniform over the whole vocabulary, special ids included
        within(
            random_ids.mean(), (VOCAB - 1) / 2, (VOCAB**2 / 12) / len(random_ids), "mean random id"
        )
        assert random_ids.min() < 5


def test_every_candidate_is_equally_likely(rows):
    """Without whole words the chosen set is a uniform subset: each of an instance's C
    candidates is chosen with probability k/C, wherever it stands."""
    tokens, lengths = rows
    _, positions, _, counts = masking.MaskingRule(SPECIALS, 0.15, PREDS).apply(
        tokens, lengths, 13, np.arange(len(tokens))
    )
    cand = candidates(tokens, lengths)
    p = np.where(cand, (counts / cand.sum(1))[:, None], 0.0)
    chosen = chosen_mask(positions, counts)
    rank = np.cumsum(cand, axis=1) - 1
    where = np.where(cand, (rank * 8) // cand.sum(1, keepdims=True), -1)  # 8 bins of rank
    for b in range(8):
        in_bin = where == b
        within(
            chosen[in_bin].sum(),
            p[in_bin].sum(),
            (p * (1 - p))[in_bin].sum(),
            f"chosen in rank bin {b}",
        )


def test_whole_words_are_masked_together_and_skipped_when_too_long():
    tokens = np.array([[CLS, 5, 6, 9, 8, 10, SEP]], np.int32)  # [5 ##6 ##9] [8] [10]
    rule = masking.MaskingRule(SPECIALS, 0.3, PREDS, whole_word_mask=True)  # 2 predictions
    for key in range(40):  # the 3-piece word never fits: always 8 and 10
        _, positions, _, counts = rule.apply(tokens, np.array([7]), key, np.array([0]))
        assert positions[0, : counts[0]].tolist() == [4, 5]
    with pytest.raises(ValueError, match="continuation"):
        masking.MaskingRule(inst.SpecialTokens(CLS, SEP, MASK, PAD, VOCAB), 0.15, PREDS, True)


def test_whole_word_masking_matches_the_original_rule(rows):
    """Words whole or untouched, and per-instance counts, multi-piece words and positions
    chosen as often as by the original's per-instance algorithm (4 sigma, two samples)."""
    tokens, lengths = rows
    rule = masking.MaskingRule(SPECIALS, 0.15, PREDS, whole_word_mask=True)
    _, positions, _, counts = rule.apply(tokens, lengths, 17, np.arange(len(tokens)))
    chosen = chosen_mask(positions, counts)
    rng = random.Random(0)
    reference = np.zeros_like(chosen)
    for i in range(len(tokens)):
        _, picked = original_mask(tokens[i, : lengths[i]].tolist(), rng, 0.15, PREDS, True)
        reference[i, picked] = True
    cand = candidates(tokens, lengths)
    continues = cand & CONTINUATION[tokens] & (np.cumsum(cand, 1) > 1)
    for what, ours, theirs in (
        ("per-instance count", chosen.sum(1), reference.sum(1)),
        ("continuation pieces", (chosen & continues).sum(1), (reference & continues).sum(1)),
        (
            "count short of wanted",
            wanted(lengths) - chosen.sum(1),
            wanted(lengths) - reference.sum(1),
        ),
        ("first half of the row", chosen[:, : SEQ // 2].sum(1), reference[:, : SEQ // 2].sum(1)),
    ):
        variance = (ours.var() + theirs.var()) / len(tokens)
        within(ours.mean(), theirs.mean(), variance, what)
    # Whole words: a continuation piece is chosen exactly when the piece before it
    # (the previous candidate) is.
    previous = np.where(cand, np.arange(SEQ)[None], -1)
    previous = np.maximum.accumulate(
        np.concatenate([np.full((len(cand), 1), -1), previous[:, :-1]], 1), axis=1
    )
    rows_, cols = np.nonzero(continues)
    np.testing.assert_array_equal(chosen[rows_, cols], chosen[rows_, previous[rows_, cols]])
    assert (chosen & continues).sum() > 1000


def test_masks_depend_only_on_key_and_row(rows):
    """The same row gets the same masks in any chunk; another key, other masks."""
    tokens, lengths = rows[0][:500], rows[1][:500]
    rule = masking.MaskingRule(SPECIALS, 0.15, PREDS)
    whole = rule.apply(tokens, lengths, 3, np.arange(500))
    order = np.random.default_rng(0).permutation(500)[:100]
    part = rule.apply(tokens[order], lengths[order], 3, order)
    for a, b in zip(whole, part):
        np.testing.assert_array_equal(a[order], b)
    again = rule.apply(tokens, lengths, 3, np.arange(500))
    for a, b in zip(whole, again):
        np.testing.assert_array_equal(a, b)
    other = rule.apply(tokens, lengths, 4, np.arange(500))
    assert (other[1] != whole[1]).any(axis=1).mean() > 0.9


@pytest.mark.slow
def test_chunked_masking_statistics_equal_the_original_over_many_instances():
    """200,000 instances: the per-instance count distribution with whole words, and the
    replacement shares, against the original per-instance algorithm (4 sigma)."""
    tokens, lengths = make_rows(5, 200_000)
    rule = masking.MaskingRule(SPECIALS, 0.15, PREDS, whole_word_mask=True)
    ids, positions, labels, counts = rule.apply(tokens, lengths, 23, np.arange(len(tokens)))
    rng = random.Random(1)
    theirs = np.array(
        [
            len(original_mask(tokens[i, : lengths[i]].tolist(), rng, 0.15, PREDS, True)[1])
            for i in range(len(tokens))
        ]
    )
    for k in range(PREDS + 1):
        ours_k, theirs_k = (counts == k).mean(), (theirs == k).mean()
        within(
            ours_k,
            theirs_k,
            (ours_k * (1 - ours_k) + theirs_k * (1 - theirs_k)) / len(tokens) + 1e-12,
            f"share of instances with {k} predictions",
        )
    slots = np.arange(PREDS)[None] < counts[:, None]
    shown = np.take_along_axis(ids, positions, 1)[slots]
    n = len(shown)
    within((shown == MASK).sum(), n * (0.8 + 1e-4), n * 0.8 * 0.2, "[MASK] share")
    within((shown == labels[slots]).sum(), n * (0.1 + 1e-4), n * 0.1 * 0.9, "kept share")
