"""Sentences in English text: `split_sentences` (simple deterministic rules: sentence-final
punctuation before a capital, a digit or an opening quote, except after an abbreviation or an
initial), and whether lines look like one sentence each (the text files' "auto" format)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence

# Sentence-final punctuation, optional closing quotes/brackets, then whitespace.
_BOUNDARY = re.compile(r"[.!?]+[\"'\u201d\u2019\u00bb)\]]*\s+")
_SENTENCE_OPENERS = "\"'\u201c\u2018\u00ab(["
_ABBREVIATIONS = frozenset(
    """mr. mrs. ms. dr. prof. st. jr. sr. mt. rev. hon. gen. col. lt. sgt. capt. gov.
    sen. rep. pres. vs. etc. e.g. i.e. cf. al. viz. approx. no. nos. vol. fig. figs.
    ch. sec. inc. ltd. co. corp. jan. feb. mar. apr. jun. jul. aug. sep. sept. oct.
    nov. dec.""".split()
)
# Initials and dotted acronyms such as "J." or "U.S." rarely end a sentence.
_INITIALS = re.compile(r"(?:[A-Za-z]\.)*[A-Z]")


def _ends_with_abbreviation(text: str, period_index: int) -> bool:
    """Whether the word ending at ``text[period_index] == '.'`` is an abbreviation."""
    word_start = period_index
    while word_start > 0 and not text[word_start - 1].isspace():
        word_start -= 1
    word = text[word_start:period_index].lstrip(_SENTENCE_OPENERS)
    return (word + ".").lower() in _ABBREVIATIONS or _INITIALS.fullmatch(word) is not None


def _is_boundary(text: str, match: re.Match[str]) -> bool:
    if match.end() >= len(text):
        return False
    following = text[match.end()]
    if not (following.isupper() or following.isdigit() or following in _SENTENCE_OPENERS):
        return False
    # Only a lone period can belong to an abbreviation; "?", "!" and "..." end sentences.
    is_lone_period = match.group().startswith(".") and not match.group().startswith("..")
    return not (is_lone_period and _ends_with_abbreviation(text, match.start()))


def split_sentences(text: str) -> list[str]:
    """Splits English text into sentences with simple deterministic rules."""
    sentences = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        if _is_boundary(text, match):
            sentences.append(text[start : match.end()].strip())
            start = match.end()
    sentences.append(text[start:].strip())
    return [sentence for sentence in sentences if sentence]


_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")


def looks_like_sentence_per_line(lines: Sequence[str]) -> bool:
    """Heuristic for "auto": short lines that each end one (and only one) sentence."""
    if not lines:
        return True
    median_length = statistics.median(len(line) for line in lines)
    ends_sentence = sum(bool(_SENTENCE_END.search(line)) for line in lines) / len(lines)
    multi_sentence = sum(len(split_sentences(line)) > 1 for line in lines) / len(lines)
    return median_length < 400 and ends_sentence >= 0.5 and multi_sentence < 0.2
