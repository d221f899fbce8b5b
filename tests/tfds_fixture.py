"""Tiny tensorflow-datasets builders, prepared in array_record format by tests."""

import tensorflow_datasets as tfds

NUM_TEXT_RECORDS = 10


def record_text(index: int) -> str:
    """Text of record ``index``: two paragraphs, three sentences, a unique marker."""
    return (
        f"Record {index} begins here. It has a second sentence.\n"
        f"A new paragraph {index} follows."
    )


class _TextBuilder(tfds.core.GeneratorBasedBuilder):
    """A one-split ("train") dataset with a single `text` feature."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}


class BertjaxTinyText(_TextBuilder):
    """Ten short English texts plus one empty text (registered as "bertjax_tiny_text")."""

    def _generate_examples(self):
        for index in range(NUM_TEXT_RECORDS):
            yield index, {"text": record_text(index)}
        yield NUM_TEXT_RECORDS, {"text": ""}


class BertjaxDocsText(_TextBuilder):
    """200 real English documents (stdlib documentation), one per record, for training runs."""

    def _generate_examples(self):
        from bertjax.data import corpus

        documents = (doc for doc in corpus.default_corpus() if len(doc) >= 2)
        for index, document in zip(range(200), documents):
            yield index, {"text": " ".join(document)}


def _prepare(builder_class: type, data_dir: str) -> str:
    builder = builder_class(data_dir=data_dir)
    builder.download_and_prepare(file_format="array_record")
    return builder.name


def prepare(data_dir: str) -> str:
    """Builds the 10-record dataset into data_dir (array_record); returns its name."""
    return _prepare(BertjaxTinyText, data_dir)


def prepare_docs(data_dir: str) -> str:
    """Builds the 200-document dataset into data_dir (array_record); returns its name."""
    return _prepare(BertjaxDocsText, data_dir)
