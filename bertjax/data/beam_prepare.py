"""Shards prepared by an Apache Beam pipeline (`python -m bertjax.prepare --runner=beam`).

The driver reads the corpus once, a document at a time, and cuts it into shards of
`data.shard_bytes` exactly as the local job does, keeping only each shard's descriptor (where
its first document is, how many documents: `shard_sources.ShardSource`), so its memory does not
grow with the corpus; Beam runs `shard_job.prepare_shard` on each descriptor, spread over its
workers by a Reshuffle, and each worker reads its shard's documents itself, from the corpus
files (which every worker must therefore see). A shard's files depend only on its documents and
index, so they equal the local job's byte for byte. Each worker writes its shard, and its
counts as a small JSON, into the job's unfinished directory, which must therefore be on a
filesystem every worker sees (a local disk for the DirectRunner, a shared mount for Flink or
Spark workers); the driver then reads the counts back and finishes as the local job does
(`pipeline.build`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator

from bertjax.data import shard_job, shard_sources
from bertjax.errors import UserError

INSTALL = (
    "--runner=beam needs Apache Beam: pip install -e '.[beam]' in its own virtual "
    "environment (Beam pins protobuf<7 and pyarrow<26, older than this project's other "
    "packages want)"
)


class BeamMissing(UserError, ImportError):
    """apache_beam is not installed (the message says how to install it)."""


def _counts_path(output: str, index: int) -> str:
    return os.path.join(output, "counts", f"shard_{index:05d}.json")


def _prepare(shard: shard_sources.ShardSource, job: shard_job.ShardJob) -> int:
    """One shard on a Beam worker: its files, then its counts beside them; returns its index."""
    counts = shard_job.prepare_shard(job, shard)
    path = _counts_path(job.output, shard.index)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(counts, f)
    os.replace(path + ".tmp", path)  # a retried bundle rewrites the same bytes
    return shard.index


def shard_runner(
    beam_options: list[str],
) -> Callable[
    [shard_job.ShardJob, Iterable[shard_sources.ShardSource], int], Iterator[dict[str, int]]
]:
    """A `pipeline.build(run_shards=...)` that prepares the shards with Beam, run with
    `beam_options` (e.g. ["--runner=DirectRunner", "--direct_num_workers=2"]); BeamMissing
    at once if apache_beam is not installed."""
    try:
        import apache_beam as beam
        from apache_beam.options.pipeline_options import PipelineOptions
    except ImportError as e:
        raise BeamMissing(INSTALL) from e

    def run(
        job: shard_job.ShardJob, shards: Iterable[shard_sources.ShardSource], num_workers: int = 0
    ) -> Iterator[dict[str, int]]:
        del num_workers  # the runner's options say how many workers
        elements = list(shards)  # descriptors only: a few numbers per shard
        try:
            with beam.Pipeline(options=PipelineOptions(beam_options)) as p:
                _ = (
                    p
                    | "Shards" >> beam.Create(elements)
                    | beam.Reshuffle()
                    | "Prepare" >> beam.Map(_prepare, job)
                )
        except Exception as e:  # the runner's own error, whatever its type
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise shard_job.WorkerError(
                f"the Beam pipeline ({' '.join(beam_options)}) failed: {first}"
            ) from e
        for index in range(len(elements)):
            path = _counts_path(job.output, index)
            if not os.path.exists(path):
                raise shard_job.WorkerError(
                    f"the Beam pipeline finished without shard {index}'s counts ({path}): its "
                    "workers must write to a filesystem the driver sees"
                )
            with open(path) as f:
                yield json.load(f)
        shutil.rmtree(os.path.join(job.output, "counts"), ignore_errors=True)

    return run
