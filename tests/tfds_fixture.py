"""A tiny tensorflow-datasets builder, prepared in array_record format by tests."""

import tensorflow_datasets as tfds

NUM_TEXT_RECORDS = 10


def record_text(index: int) -> str:
    """Text of record ``index``: two paragraphs, three sentences, a unique marker."""
    return (
        f"Record {index} begins here. It has a second sentence.\n"
        f"A new paragraph {index} follows."
    )


class BertjaxTinyText(tfds.core.GeneratorBasedBuilder):
    """Ten short English texts plus one empty text (registered as "bertjax_tiny_text")."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for index in range(NUM_TEXT_RECORDS):
            yield index, {"text": record_text(index)}
        yield NUM_TEXT_RECORDS, {"text": ""}


def prepare(data_dir: str) -> str:
    """Builds the dataset into data_dir in array_record format; returns its name."""
    builder = BertjaxTinyText(data_dir=data_dir)
    builder.download_and_prepare(file_format="array_record")
    return builder.name


class BertjaxDocsText(tfds.core.GeneratorBasedBuilder):
    """200 real English documents (stdlib documentation), one per record, for training runs."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        from bertjax.data import corpus

        documents = (doc for doc in corpus.default_corpus() if len(doc) >= 2)
        for index, document in zip(range(200), documents):
            yield index, {"text": " ".join(document)}


def prepare_docs(data_dir: str) -> str:
    """Builds the 200-document dataset into data_dir (array_record); returns its name."""
    builder = BertjaxDocsText(data_dir=data_dir)
    builder.download_and_prepare(file_format="array_record")
    return builder.name
