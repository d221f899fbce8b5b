"""The issue-27 benchmark corpus: the twelve shared Gutenberg books in the original format
(one sentence per line, a blank line between documents of 40 paragraphs), repeated.

    python benchmarks/data_prep/make_corpus.py DATA/gutenberg SCRATCH/books_x1.txt --copies=1
    python benchmarks/data_prep/make_corpus.py DATA/gutenberg SCRATCH/books_x14.txt --copies=14

`--vary` makes every copy after the first differ from the others: its documents in an order of
their own and each document's sentences rotated by an offset of its own (seeded by the copy's
number), so that no two copies hold the same documents or document order.
"""

from __future__ import annotations

import argparse
import glob
import os
import random

from bertjax.data import sentences

PARAGRAPHS_PER_DOCUMENT = 40


def documents(book: str) -> list[list[str]]:
    """A book's paragraphs, split into sentences, 40 paragraphs to a document."""
    with open(book, encoding="utf-8", errors="replace") as f:
        blocks = f.read().replace("\r\n", "\n").split("\n\n")
    paragraphs = [" ".join(block.split()) for block in blocks]
    paragraphs = [p for p in paragraphs if p]
    step = PARAGRAPHS_PER_DOCUMENT
    return [
        [s for p in paragraphs[i : i + step] for s in sentences.split_sentences(p)]
        for i in range(0, len(paragraphs), step)
    ]


def varied(docs: list[list[str]], copy: int) -> str:
    """Copy `copy` of the documents: shuffled, each one's sentences rotated."""
    rng = random.Random(copy)
    order = list(range(len(docs)))
    rng.shuffle(order)
    rotated = []
    for i in order:
        k = rng.randrange(len(docs[i]))
        rotated.append(docs[i][k:] + docs[i][:k])
    return "\n\n".join("\n".join(doc) for doc in rotated) + "\n\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("books", help="the directory of the pg*.txt books")
    parser.add_argument("output")
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--vary", action="store_true", help="each copy's documents differ")
    args = parser.parse_args()
    books = sorted(glob.glob(os.path.join(args.books, "pg*.txt")))
    docs = [doc for book in books for doc in documents(book) if doc]
    text = "\n\n".join("\n".join(doc) for doc in docs) + "\n\n"
    with open(args.output, "w", encoding="utf-8") as f:
        for copy in range(args.copies):
            f.write(varied(docs, copy) if args.vary and copy else text)
    print(
        f"{args.output}: {os.path.getsize(args.output) / 1e6:.1f} MB, "
        f"{text.count(chr(10) * 2) * args.copies} documents"
    )


if __name__ == "__main__":
    main()
