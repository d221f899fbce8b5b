"""The issue-27 benchmark corpus: the twelve shared Gutenberg books in the original format
(one sentence per line, a blank line between documents of 40 paragraphs), repeated.

    python benchmarks/data_prep/make_corpus.py DATA/gutenberg SCRATCH/books_x1.txt --copies=1
    python benchmarks/data_prep/make_corpus.py DATA/gutenberg SCRATCH/books_x14.txt --copies=14
"""
from __future__ import annotations

import argparse
import glob
import os

from bertjax.data import corpus

PARAGRAPHS_PER_DOCUMENT = 40


def documents(book: str) -> list[list[str]]:
    """A book's paragraphs, split into sentences, 40 paragraphs to a document."""
    with open(book, encoding="utf-8", errors="replace") as f:
        blocks = f.read().replace("\r\n", "\n").split("\n\n")
    paragraphs = [" ".join(block.split()) for block in blocks]
    paragraphs = [p for p in paragraphs if p]
    step = PARAGRAPHS_PER_DOCUMENT
    return [[s for p in paragraphs[i:i + step] for s in corpus.split_sentences(p)]
            for i in range(0, len(paragraphs), step)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("books", help="the directory of the pg*.txt books")
    parser.add_argument("output")
    parser.add_argument("--copies", type=int, default=1)
    args = parser.parse_args()
    books = sorted(glob.glob(os.path.join(args.books, "pg*.txt")))
    text = "\n\n".join("\n".join(doc) for book in books for doc in documents(book)) + "\n\n"
    with open(args.output, "w", encoding="utf-8") as f:
        for _ in range(args.copies):
            f.write(text)
    print(f"{args.output}: {os.path.getsize(args.output) / 1e6:.1f} MB, "
          f"{text.count(chr(10) * 2) * args.copies} documents")


if __name__ == "__main__":
    main()
