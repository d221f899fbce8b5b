"""What every phase's preparation starts from, per data config: the corpus (this process's
reader and documents of the configured source, the corpus's identity and cache fingerprint), the
tokenizer (a vocab file's, or a SentencePiece model trained on the corpus once and cached), the
special tokens, and `Derived`: these computed once for all phases (`data.pipeline` prepares
each phase from them)."""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import shutil
from collections.abc import Iterator
from typing import Any

from absl import logging

from bertjax.data import corpora, corpus, instances, prepared_files, shard_sources, tokenization
from bertjax.data.errors import DataError
from bertjax.data.settings import DataSettings
from bertjax.runtime import failures, files, locks


def corpus_reader(
    data: DataSettings, process_index: int, process_count: int
) -> shard_sources.CorpusReader:
    """This process's documents of the configured source (its settings checked now)."""
    source = corpora.get(data.source)
    return shard_sources.CorpusReader(source, source.arguments(data), process_index, process_count)


def read_documents(
    data: DataSettings, process_index: int, process_count: int, stats: corpus.CorpusStats
) -> Iterator[list[str]]:
    """Documents of this process's shard, from the configured source."""
    reader = corpus_reader(data, process_index, process_count)
    return (document for _, document in reader.documents(stats))


def source_identity(data: DataSettings) -> dict[str, Any]:
    """What identifies the raw corpus: files with their sizes, or the dataset's name (with
    `data.prepared_dir`: as recorded there, so the corpus need not be on this host)."""
    if data.prepared_dir:
        prepared = data.prepared_dir
        found = files.glob(
            os.path.join(
                prepared if files.is_remote(prepared) else glob.escape(prepared), "*", "meta.json"
            )
        )
        if not found:
            raise DataError(
                f"data.prepared_dir={data.prepared_dir!r} holds no prepared data "
                "(no */meta.json); run python -m bertjax.prepare --output=DIR first"
            )
        return prepared_files.read_meta(os.path.dirname(found[0]))[0].get("source", {})
    return corpora.get(data.source).identity(data)


def _source_fingerprint(identity: dict[str, Any]) -> dict[str, Any]:
    """The cache keys' view of the corpus: its `identity` (source_identity) plus file times."""
    if "files" not in identity:
        return identity
    return {**identity, "mtimes": [int(files.getmtime(f)) for f, _ in identity["files"]]}


class Derived:
    """What every phase's preparation derives from the data settings and the tokenizer,
    computed once (on first use) and shared by the phases: the corpus's identity and cache
    fingerprint, and the special tokens."""

    def __init__(self, data: DataSettings, tokenizer: tokenization.Tokenizer) -> None:
        self.settings, self.tokenizer = data, tokenizer

    @functools.cached_property
    def source(self) -> dict[str, Any]:
        """`source_identity(data)`."""
        return source_identity(self.settings)

    @functools.cached_property
    def source_fingerprint(self) -> dict[str, Any]:
        return _source_fingerprint(self.source)

    @functools.cached_property
    def specials(self) -> instances.SpecialTokens:
        return specials_of(self.tokenizer, self.settings.whole_word_mask)


def load_or_train_tokenizer(
    data: DataSettings, cache_dir: str, process_index: int = 0, process_count: int = 1
) -> tokenization.Tokenizer:
    """The configured tokenizer; with sentencepiece and no vocab_file, one is trained on the
    corpus (once, cached) so the default run needs no download. Every process trains on the
    whole corpus, not its shard, so that all processes get the same vocabulary."""
    if data.vocab_file:
        if not files.exists(data.vocab_file):
            raise DataError(
                f"data.vocab_file={data.vocab_file!r} does not exist; pass a "
                "Google vocab.txt (wordpiece), a SentencePiece .model or a "
                "BPE tokenizer.json (bpe)"
            )
        return tokenization.load_tokenizer(
            data.tokenizer, data.vocab_file, data.do_lower_case, data.strip_accents_option
        )
    if data.tokenizer != "sentencepiece":
        file = "vocab.txt" if data.tokenizer == "wordpiece" else "tokenizer.json"
        raise DataError(
            f"data.tokenizer={data.tokenizer} needs --config.data.vocab_file={file} "
            "(or use data.tokenizer=sentencepiece to train one on the corpus)"
        )
    key = prepared_files.cache_key(
        {
            "source": _source_fingerprint(source_identity(data)),
            "size": data.sentencepiece_vocab_size,
            "lower": data.do_lower_case,
        }
    )
    prefix = os.path.join(cache_dir, f"sentencepiece_{key}")

    def train() -> None:
        logging.info(
            "Training a SentencePiece model (%d tokens) on the corpus -> %s.model",
            data.sentencepiece_vocab_size,
            prefix,
        )
        sentences = (s for doc in read_documents(data, 0, 1, corpus.CorpusStats()) for s in doc)
        tmp_prefix = f"{prefix}.tmp{os.getpid()}"
        try:
            tokenization.train_sentencepiece(
                sentences,
                tmp_prefix,
                data.sentencepiece_vocab_size,
                do_lower_case=data.do_lower_case,
            )
        except ValueError as e:  # (SentencePiece's own writes report no cause: a full disk
            full = shutil.disk_usage(cache_dir).free < 1 << 20  # is recognised by its space)
            for ext in (".model", ".vocab"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp_prefix + ext)
            if full:
                line = failures.os_error_line(files.no_space(tmp_prefix + ".model"))
                raise DataError(
                    f"{line}; the unfinished SentencePiece model was removed; kept: "
                    f"the data prepared before (in {cache_dir})"
                ) from e
            raise DataError(f"could not train a SentencePiece model on the corpus: {e}") from e
        for ext in (".model", ".vocab"):
            os.replace(tmp_prefix + ext, prefix + ext)

    locks.build_once(prefix + ".model", prefix + ".model", train)
    try:
        return tokenization.SentencePieceTokenizer(prefix + ".model")
    except ValueError as e:  # truncated or replaced in the cache
        raise DataError(
            f"the cached SentencePiece model {prefix}.model is damaged ({e}); "
            f"delete it and {prefix}.vocab to train it again"
        ) from e


def specials_of(
    tokenizer: tokenization.Tokenizer, whole_word_mask: bool
) -> instances.SpecialTokens:
    return instances.SpecialTokens(
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
        mask_id=tokenizer.mask_id,
        pad_id=tokenizer.pad_id,
        vocab_size=tokenizer.vocab_size,
        never_mask=tokenizer.special_ids(),
        continuation=tokenizer.continuation_mask() if whole_word_mask else None,
    )
