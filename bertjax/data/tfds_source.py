"""Pretraining documents from a tensorflow-datasets dataset prepared in ``array_record``
format, read by random access without TensorFlow (and the random-access source the task
readers use for their tfds datasets)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from bertjax.data import corpora, corpus, sentences
from bertjax.data.errors import DataError

if TYPE_CHECKING:
    from bertjax.data.settings import DataSettings

TfdsArguments = tuple[str, str, str | None, str]  # name, split, data_dir, text_key


def _text_to_document(text: bytes | str) -> corpus.Document:
    """Splits a text into paragraphs at newlines, then each paragraph into sentences."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return [
        s for paragraph in text.splitlines() for s in sentences.split_sentences(paragraph.strip())
    ]


def open_tfds_source(name: str, split: str, data_dir: str | None) -> Sequence[Any]:
    """Returns the random-access data source of a prepared array_record dataset."""
    import tensorflow_datasets as tfds  # Imported lazily: slow, and only needed here.

    how_to_prepare = (
        f"Prepare it first with `tfds build {name} --file_format=array_record"
        + (f" --data_dir={data_dir}`" if data_dir else "`")
        + ", or pass data_dir= pointing at a directory where it is already prepared."
    )
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError as error:  # neither prepared nor known to this tfds
        where = data_dir or tfds.core.constants.DATA_DIR
        raise FileNotFoundError(
            f"tfds dataset {name!r} is not prepared in {where}, and this tensorflow-datasets "
            f"has no builder for it. {how_to_prepare}"
        ) from error
    if not builder.is_prepared():
        raise FileNotFoundError(
            f"tfds dataset {name!r} is not prepared in {builder.data_dir}. {how_to_prepare}"
        )
    try:
        return builder.as_data_source(split=split)
    except (NotImplementedError, ValueError) as error:
        raise ValueError(
            f"tfds dataset {name!r} at {builder.data_dir} cannot be read by random access "
            f"(needs array_record format; reading without TensorFlow). {how_to_prepare}"
        ) from error


def read_tfds(
    name: str,
    split: str = "train",
    data_dir: str | None = None,
    text_key: str = "text",
    process_index: int = 0,
    process_count: int = 1,
    stats: corpus.CorpusStats | None = None,
) -> Iterator[corpus.Document]:
    """Reads documents from a tfds dataset in array_record format, without TensorFlow.

    Each example's ``text_key`` field becomes one document: split into paragraphs
    at newlines and into sentences with ``sentences.split_sentences``. Process ``i`` of ``n``
    reads records ``i, i + n, i + 2n, ...``. Errors (dataset not prepared, wrong
    format, unknown text_key) are raised when this is called.
    """
    positioned = positioned_tfds(
        name, split, data_dir, text_key, process_index, process_count, stats
    )
    return (document for _, document in positioned)


def positioned_tfds(
    name: str,
    split: str,
    data_dir: str | None,
    text_key: str,
    process_index: int,
    process_count: int,
    stats: corpus.CorpusStats | None = None,
    start: int | None = None,
) -> Iterator[tuple[int, corpus.Document]]:
    """`(record index, document)` as `read_tfds` reads them, from the first (counted into
    `stats`) or, not counted again, from the record index `start` (one this returned)."""
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"Need 0 <= process_index < process_count, got {process_index}, {process_count}."
        )
    source = open_tfds_source(name, split, data_dir)
    if len(source) and text_key not in source[0]:
        raise KeyError(
            f"text_key {text_key!r} is not a feature of tfds dataset {name!r}; "
            f"available keys: {sorted(source[0])}."
        )
    file_stats = corpus.CorpusStats(files=1)
    where = [0]  # the record of the document `counted` passes on (it reads none ahead)

    def documents() -> Iterator[corpus.Document]:
        for index in range(process_index if start is None else start, len(source), process_count):
            document = _text_to_document(source[index][text_key])
            if document:
                where[0] = index
                yield document
            else:
                file_stats.skipped_empty_documents += 1

    read = documents()
    if start is None:
        read = corpus.counted(
            f"tfds:{name}/{split}",
            read,
            file_stats,
            stats if stats is not None else corpus.CorpusStats(),
        )
    return ((where[0], document) for document in read)


def _tfds_arguments(data: DataSettings) -> TfdsArguments:
    if not data.tfds_name:
        raise DataError("data.source=tfds needs --config.data.tfds_name=NAME")
    return (data.tfds_name, data.tfds_split, data.tfds_data_dir or None, data.tfds_text_key)


def _tfds_documents(
    arguments: TfdsArguments,
    index: int,
    count: int,
    stats: corpus.CorpusStats | None,
    start: int | None,
) -> Iterator[tuple[int, corpus.Document]]:
    return positioned_tfds(*arguments, index, count, stats, start)


def _tfds_identity(data: DataSettings) -> dict[str, Any]:
    return {"tfds": [data.tfds_name, data.tfds_split, data.tfds_data_dir, data.tfds_text_key]}


corpora.register(corpora.Source("tfds", _tfds_arguments, _tfds_documents, _tfds_identity))
