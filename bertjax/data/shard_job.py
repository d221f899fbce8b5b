"""One shard's whole preparation (read its documents from its descriptor, tokenize, held-out
split, pairs, masks, write), run in worker processes, one shard per worker.

A shard's result depends only on its documents and its index, so any number of workers
writes the same bytes. Workers are `spawn`ed (forking a process that may already run JAX's
threads can deadlock); a script that starts preparation without an
`if __name__ == "__main__":` guard gets one clear error instead of a hang.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import multiprocessing
import os
import random
import signal
from collections.abc import Iterable, Iterator

import numpy as np

from bertjax.data import instances, masking, shard_format, shard_sources, token_cache, tokenization
from bertjax.errors import UserError

CHUNK_ROWS = 4096  # rows masked and written at a time
MASK_STREAM = 1  # hashed with a split's seed: its masking stream
INSTANCE_ROUTE_FACTOR = 3  # whole documents holding more than this x eval_fraction of tokens


class WorkerError(UserError, RuntimeError):
    """A worker process failed to start or died (e.g. a script without the `__main__` guard)."""


GUARD_MESSAGE = (
    "data preparation started again inside a worker process, which re-imports "
    'your script: put the code that starts it under `if __name__ == "__main__":` '
    "(or set data.num_workers=1)"
)


def check_not_in_spawned_import() -> None:
    """Raises WorkerError when called while a spawned child, still starting, re-runs its
    parent's script (multiprocessing marks that phase with `_inheriting`)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise WorkerError(GUARD_MESSAGE)


@dataclasses.dataclass(frozen=True)
class ShardJob:
    """What every shard's preparation needs (sent once to each worker)."""

    tokenizer: tokenization.Tokenizer | None  # None: documents come tokenized
    specials: instances.SpecialTokens
    max_seq_length: int
    max_predictions: int
    masked_lm_prob: float
    short_seq_prob: float
    dupe_factor: int
    whole_word_mask: bool
    mask_mix: tuple[float, float]
    eval_fraction: float
    seed: int
    shard_seed: tuple[int, ...]  # (seed, 0): hashed with the shard index
    dynamic: bool
    next_sentence_prediction: bool
    output: str  # the shards go to output/{train,eval}/shard_NNNNN
    reader: shard_sources.CorpusReader | None = None  # where each shard reads its documents
    tokens: str = ""  # where each shard's token ids are kept for every phase ("": not kept)

    def masking_rule(self) -> masking.MaskingRule:
        """How this job's instances are masked."""
        return masking.MaskingRule(
            self.specials,
            self.masked_lm_prob,
            self.max_predictions,
            self.whole_word_mask,
            self.mask_mix,
        )


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from several integers (stable across processes and runs)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def split_eval_documents(documents: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Holds out a seeded random `eval_fraction` of documents (at least one if any)."""
    if eval_fraction <= 0 or len(documents) < 2:
        return documents, []
    order = np.random.default_rng([seed, 1]).permutation(len(documents))
    num_eval = max(1, round(len(documents) * eval_fraction))
    eval_ids = set(order[:num_eval].tolist())
    train = [d for i, d in enumerate(documents) if i not in eval_ids]
    return train, [d for i, d in enumerate(documents) if i in eval_ids]


def mask_key(seed: int) -> int:
    """The masking stream of the instances made with random.Random(`seed`)."""
    return hash_seed(seed, MASK_STREAM)


def _tokens(documents: list) -> int:
    return sum(len(sentence) for document in documents for sentence in document)


def stored_chunks(
    created: list[instances.Instance], job: ShardJob, key: int | None
) -> Iterator[dict[str, np.ndarray]]:
    """Stored rows of `created`, CHUNK_ROWS at a time, each chunk masked at once with the
    random stream `key` (row i of `created` is row i of the stream); None: unmasked."""
    rule = None if key is None else job.masking_rule()
    for first_row in range(0, max(len(created), 1), CHUNK_ROWS):
        chunk = created[first_row : first_row + CHUNK_ROWS]
        rows = shard_format.unmasked_rows(
            [i.tokens for i in chunk],
            [i.b_start for i in chunk],
            [i.is_random_next for i in chunk],
            job.max_seq_length,
            job.max_predictions,
            job.specials.vocab_size,
            job.specials.pad_id,
        )
        yield _masked(rows, rule, key, first_row)


def _masked(
    chunk: dict[str, np.ndarray], rule: masking.MaskingRule | None, key: int | None, first_row: int
) -> dict[str, np.ndarray]:
    """Stored rows `chunk` (rows `first_row`... of the stream `key`) masked by `rule`."""
    if rule is None or key is None:  # (either both or neither)
        return chunk
    rows = np.arange(first_row, first_row + len(chunk["lengths"]))
    ids, positions, labels, counts = rule.apply(chunk["input_ids"], chunk["lengths"], key, rows)
    for name, values in (
        ("input_ids", ids),
        ("masked_lm_positions", positions),
        ("masked_lm_ids", labels),
        ("num_predictions", counts),
    ):
        chunk[name] = values.astype(chunk[name].dtype, copy=False)
    return chunk


def write_split(
    created: list[instances.Instance], job: ShardJob, key: int | None, directory: str
) -> int:
    """Writes `created` to `directory` as they are masked (see `stored_chunks`); returns how
    many."""
    writer = shard_format.ShardWriter(
        directory, len(created), job.max_seq_length, job.max_predictions, job.specials.vocab_size
    )
    for chunk in stored_chunks(created, job, key):
        writer.write(chunk)
    writer.close()
    return len(created)


def prepare_shard(job: ShardJob, source: shard_sources.ShardSource) -> dict[str, int]:
    """Reads the documents of shard `source` (with `job.reader`) and writes the shard of both
    splits; returns its counts."""
    shard, reader, tokenizer = source.index, job.reader, job.tokenizer
    assert reader is not None and tokenizer is not None, "a job that prepares shards has both"
    tokenized, found = token_cache.tokenized_shard(
        job.tokens, shard, lambda: reader.read(source), tokenizer
    )
    counts = collections.Counter(found)
    counts["documents"] += len(tokenized)
    train_docs, eval_docs = split_eval_documents(tokenized, job.eval_fraction, job.seed + shard)
    by_instances = (
        job.eval_fraction > 0
        and eval_docs
        and _tokens(eval_docs) > INSTANCE_ROUTE_FACTOR * job.eval_fraction * counts["tokens"]
    )
    if by_instances:
        train_docs, eval_docs = tokenized, []
    seed = hash_seed(*job.shard_seed, shard, job.max_seq_length)
    rng = random.Random(seed)
    created = instances.create_instances(
        train_docs,
        job.max_seq_length,
        job.short_seq_prob,
        job.dupe_factor,
        rng,
        job.specials,
        job.next_sentence_prediction,
    )
    del train_docs, tokenized
    eval_rng = random.Random(seed + 1)
    if by_instances:  # a seeded eval_fraction of the instances, masked statically
        held = np.random.default_rng([job.seed + shard, 2]).random(len(created)) < job.eval_fraction
        held_out = [instance for instance, h in zip(created, held) if h]
        created = [instance for instance, h in zip(created, held) if not h]
        counts["eval_instance_route_shards"] = 1
    else:
        held_out = instances.create_instances(
            eval_docs,
            job.max_seq_length,
            job.short_seq_prob,
            1,
            eval_rng,
            job.specials,
            job.next_sentence_prediction,
        )
        counts["eval_documents"] = len(eval_docs)
    name = f"shard_{shard:05d}"
    for split, rows, key in (
        ("train", created, None if job.dynamic else mask_key(seed)),
        ("eval", held_out, mask_key(seed + 1)),
    ):
        if rows:
            counts[f"{split}_instances"] = write_split(
                rows, job, key, os.path.join(job.output, split, name)
            )
    return dict(counts)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle


def run_shards(
    job: ShardJob, shards: Iterable[shard_sources.ShardSource], num_workers: int
) -> Iterator[dict[str, int]]:
    """Prepares every shard (in `num_workers` processes; 0: one per core; each reads its own
    documents), yielding each shard's counts in shard order."""
    check_not_in_spawned_import()
    num_workers = num_workers or os.cpu_count() or 1
    if num_workers <= 1:
        for shard in shards:
            yield prepare_shard(job, shard)
        return
    with concurrent.futures.ProcessPoolExecutor(
        num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_sigint
    ) as pool:
        # The job (with the tokenizer) goes with every shard, not to the workers' start: a
        # start message larger than a pipe's buffer hangs the parent if the child dies early.
        pending: collections.deque = collections.deque()
        try:
            for shard in shards:
                pending.append(pool.submit(prepare_shard, job, shard))
                while len(pending) > num_workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except concurrent.futures.process.BrokenProcessPool as e:
            raise WorkerError(
                f"a data preparation worker process died ({e}); the usual "
                "cause is a script that starts preparation without `if __name__ "
                '== "__main__":` (spawned workers re-import it; their error '
                "is above), else memory: lower data.shard_bytes"
            ) from e
        finally:
            for future in pending:
                future.cancel()
