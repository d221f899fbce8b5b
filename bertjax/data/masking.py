"""Masked-LM masking of whole chunks of instances at once, with the rule of Google's original
``create_pretraining_data.py`` (static preparation and the loader's dynamic masking alike).

The rule, per instance of ``length`` tokens ([CLS] and [SEP] counted):
``min(max_predictions, max(1, round(length * masked_lm_prob)))`` predictions are chosen among
the candidate positions (every token but [CLS], [SEP] and ``SpecialTokens.never_mask``), taken
in random word order, a word skipped when it would overshoot (so whole-word masking may choose
fewer, even none); each chosen token becomes [MASK] with probability ``mask_mix[0]`` (0.8), a
uniformly random id of the whole vocabulary with probability ``mask_mix[1]`` (0.1), and stays
unchanged otherwise. Without whole-word masking every candidate is its own word, and the rule
is a uniformly random subset of that size.

The random stream is counter-based (docs/deviations.md): every draw is a splitmix64 hash of
(key, row, position, purpose): one orders the candidates, one picks [MASK], random id (the
same draw, rescaled, picks which id) or kept; so an instance's masks depend only on the key and its row
number, not on the chunk or batch that holds it, nor on how many processes prepare the data.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bertjax.data.instances import SpecialTokens

PAPER_MASK_MIX = (0.8, 0.1)  # (P[MASK], P[random token]); the rest keep the original token

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_LAST = np.uint64(0xFFFFFFFFFFFFFFFF)
_POSITION_BITS = np.uint64(0xFFFF)  # an order key's low bits: its position (keys unique per row)
_ORDER, _CHOICE = 1, 2  # what a draw is for


def check_mask_mix(mask_token_prob: float, random_token_prob: float) -> None:
    """Raises ValueError unless both are probabilities with a sum of at most 1."""
    if not (
        0 <= mask_token_prob <= 1
        and 0 <= random_token_prob <= 1
        and mask_token_prob + random_token_prob <= 1 + 1e-9
    ):
        raise ValueError(
            f"mask_token_prob={mask_token_prob} and random_token_prob={random_token_prob} must "
            "be in [0, 1] with a sum of at most 1 (the rest keep the original token)"
        )


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place on a uint64 array."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _draws(row_bases: np.ndarray, positions: np.ndarray, purpose: int) -> np.ndarray:
    """64 random bits for each (row, position) of broadcastable `row_bases` and `positions`."""
    counters = positions.astype(np.uint64) * np.uint64(4) + np.uint64(purpose)
    return _mix(row_bases + counters * _GOLDEN)


def _uniform(bits: np.ndarray) -> np.ndarray:
    """Floats in [0, 1) from 64 random bits each (53 of them)."""
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclasses.dataclass(frozen=True)
class MaskingRule:
    """The masking settings; `apply` masks a chunk of padded instances."""

    specials: SpecialTokens
    masked_lm_prob: float
    max_predictions: int
    whole_word_mask: bool = False
    mask_mix: tuple[float, float] = PAPER_MASK_MIX
    # Bool [vocab_size]: True where a token may be masked (set from `specials`).
    _maskable: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_mask_mix(*self.mask_mix)
        if self.whole_word_mask and self.specials.continuation is None:
            raise ValueError("whole_word_mask needs SpecialTokens.continuation.")
        maskable = np.ones(self.specials.vocab_size, bool)
        maskable[sorted(self.specials.unmaskable)] = False
        object.__setattr__(self, "_maskable", maskable)

    def apply(
        self, tokens: np.ndarray, lengths: np.ndarray, key: int, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Masks instances `tokens` ([N, L], any integer type, padded after `lengths`) whose
        row numbers are `rows` ([N]), drawing from `key`; returns (masked tokens, the same type;
        positions [N, max_predictions] ascending, then 0; labels, the original ids there, then
        0; counts [N]). `tokens` is not modified."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, np.int64)
        width = int(lengths.max(initial=1))  # (no candidate after the longest instance)
        steps = np.arange(width)
        candidate = (steps[None] < lengths[:, None]) & self._maskable[tokens[:, :width]]
        wanted = np.minimum(
            self.max_predictions,
            np.maximum(1, np.rint(lengths * self.masked_lm_prob).astype(np.int64)),
        )
        row_bases = _mix(np.asarray(rows, np.uint64) * _GOLDEN + np.uint64(key))
        keys = (_draws(row_bases[:, None], steps[None], _ORDER) & ~_POSITION_BITS) | steps.astype(
            np.uint64
        )[None]
        if self.whole_word_mask:
            chosen = self._whole_words(tokens[:, :width], candidate, keys, wanted)
        else:
            chosen = candidate & (
                keys <= self._kth_smallest(np.where(candidate, keys, _LAST), wanted)
            )
        return self._outputs(tokens, chosen, row_bases)

    def _kth_smallest(self, keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
        """[N, 1]: each row's `wanted`-th smallest key."""
        most = min(self.max_predictions, keys.shape[1])
        smallest = np.sort(np.partition(keys, most - 1, axis=1)[:, :most], axis=1)
        return np.take_along_axis(smallest, np.minimum(wanted, most)[:, None] - 1, axis=1)

    def _whole_words(
        self, tokens: np.ndarray, candidate: np.ndarray, keys: np.ndarray, wanted: np.ndarray
    ) -> np.ndarray:
        """Chosen positions: whole words in random order, a word skipped if it would overshoot.
        A continuation piece joins the previous candidate's word, even across a skipped [SEP],
        as the original's "##" rule does."""
        num, width = tokens.shape
        first = candidate & (np.cumsum(candidate, axis=1) == 1)
        continuation = self.specials.continuation
        assert continuation is not None  # (checked when the rule was made)
        starts = candidate & (~continuation[tokens] | first)
        word_of = np.maximum.accumulate(np.where(starts, np.arange(width)[None], 0), axis=1)
        flat = (np.arange(num)[:, None] * width + word_of)[candidate]
        sizes = np.bincount(flat, minlength=num * width).reshape(num, width)
        order = np.argsort(np.where(starts, keys, _LAST), axis=1)
        sorted_sizes = np.take_along_axis(sizes, order, axis=1)
        taken_sorted = np.zeros((num, width), bool)
        count = np.zeros(num, np.int64)
        for rank in range(int(starts.sum(axis=1).max(initial=0))):
            size = sorted_sizes[:, rank]
            take = (size > 0) & (count + size <= wanted)
            count += np.where(take, size, 0)
            taken_sorted[:, rank] = take
            if ((count >= wanted) | (size == 0)).all():
                break
        taken = np.zeros((num, width), bool)
        np.put_along_axis(taken, order, taken_sorted, axis=1)
        return candidate & np.take_along_axis(taken, word_of, axis=1)

    def _outputs(
        self, tokens: np.ndarray, chosen: np.ndarray, row_bases: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Masked tokens, positions, labels and counts of the `chosen` positions."""
        counts = chosen.sum(axis=1)
        rows, columns = np.nonzero(chosen)  # row-major: positions ascend within a row
        slots = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.zeros((len(tokens), self.max_predictions), np.int32)
        labels = np.zeros((len(tokens), self.max_predictions), tokens.dtype)
        positions[rows, slots] = columns
        labels[rows, slots] = tokens[rows, columns]
        choice = _uniform(_draws(row_bases[rows], columns, _CHOICE))
        as_mask = choice < self.mask_mix[0]
        as_random = ~as_mask & (choice < self.mask_mix[0] + self.mask_mix[1])
        # Within [m, m + r) the draw is uniform again: rescaled, it picks the random id.
        scaled = (choice[as_random] - self.mask_mix[0]) / max(self.mask_mix[1], 1e-300)
        random_ids = np.minimum(
            (scaled * self.specials.vocab_size).astype(np.int64), self.specials.vocab_size - 1
        )
        masked = tokens.copy()
        masked[rows[as_mask], columns[as_mask]] = self.specials.mask_id
        masked[rows[as_random], columns[as_random]] = random_ids
        return masked, positions, labels, counts
