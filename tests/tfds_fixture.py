"""Tiny tensorflow-datasets builders, prepared in array_record format by tests."""

import json
import os

import numpy as np
import tensorflow_datasets as tfds

NUM_TEXT_RECORDS = 10


def record_text(index: int) -> str:
    """Text of record ``index``: two paragraphs, three sentences, a unique marker."""
    return (
        f"Record {index} begins here. It has a second sentence.\nA new paragraph {index} follows."
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
        from bertjax.data import default_corpus

        documents = (doc for doc in default_corpus.default_corpus() if len(doc) >= 2)
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


def prepare_as(builder: tfds.core.DatasetBuilder, name: str) -> None:
    """Prepares `builder` (array_record) and moves it to where `tfds build NAME` writes NAME, so
    that `tfds.builder(NAME, data_dir=...)` reads it from its files, as for a dataset prepared
    elsewhere. (This tfds install has no GLUE or CoNLL-2003 builder to run offline.)"""
    builder.download_and_prepare(file_format="array_record")
    dataset, _, config = name.partition("/")
    source = os.path.join(builder.data_dir_root, builder.name, config, str(builder.version))
    target = os.path.join(builder.data_dir_root, dataset, config, str(builder.version))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(source, target)
    for file in os.listdir(target):
        if file.startswith(builder.name + "-"):
            os.rename(
                os.path.join(target, file),
                os.path.join(target, dataset + file[len(builder.name) :]),
            )
    info_path = os.path.join(target, "dataset_info.json")
    with open(info_path) as f:
        info = json.load(f)
    with open(info_path, "w") as f:
        json.dump({**info, "name": dataset}, f)


# Records with the features of tfds `glue/sst2` and `glue/mnli` (label -1 in test splits, as
# there); one training record of each task is unlabelled (-1) too.
GLUE_RECORDS = {
    "sst2": {
        "train": [("a b", 1), ("c", 0), ("d", -1)],
        "validation": [("b c", 0)],
        "test": [("a", -1), ("d c", -1)],
    },
    "mnli": {
        "train": [("a", "b", 0), ("c", "d", 2), ("b", "a", 1), ("d", "d", -1)],
        "validation_matched": [("a b", "c", 1)],
        "validation_mismatched": [("c", "a", 2)],
        "test_matched": [("b", "b", -1)],
        "test_mismatched": [("d", "a", -1)],
    },
}
MNLI_LABELS = ("entailment", "neutral", "contradiction")  # tfds's order


class BertjaxGlue(tfds.core.GeneratorBasedBuilder):
    """`glue/sst2` and `glue/mnli` features over GLUE_RECORDS."""

    VERSION = tfds.core.Version("2.0.0")
    BUILDER_CONFIGS = [  # noqa: RUF012 (tfds reads the class attribute)
        tfds.core.BuilderConfig(name="sst2"),
        tfds.core.BuilderConfig(name="mnli"),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        if self.builder_config.name == "sst2":
            texts = {"sentence": tfds.features.Text()}
            label = tfds.features.ClassLabel(names=["negative", "positive"])
        else:
            texts = {"premise": tfds.features.Text(), "hypothesis": tfds.features.Text()}
            label = tfds.features.ClassLabel(names=list(MNLI_LABELS))
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {**texts, "label": label, "idx": tfds.features.Scalar(dtype=np.int32)}
            ),
        )

    def _split_generators(self, dl_manager):
        return {
            split: self._generate_examples(records)
            for split, records in GLUE_RECORDS[self.builder_config.name].items()
        }

    def _generate_examples(self, records):
        keys = [k for k in ("sentence", "premise", "hypothesis") if k in self.info.features]
        for index, (*texts, label) in enumerate(records):
            yield index, {**dict(zip(keys, texts)), "label": label, "idx": index}


# Sentences with the `tokens` and `ner` features of tfds `conll2003`; its tag names in an order
# different from bertjax's, so the test sees that tags are mapped by name.
CONLL_TAGS = ("O", "B-LOC", "I-LOC", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-MISC", "I-MISC")
CONLL_RECORDS = {
    "train": [
        (["John", "lives", "in", "New", "York"], ["B-PER", "O", "O", "B-LOC", "I-LOC"]),
        (["Acme", "Corp"], ["B-ORG", "I-ORG"]),
    ],
    "dev": [(["Paris", "."], ["B-LOC", "O"])],
    "test": [(["Mary", "!"], ["B-PER", "O"])],
}


class BertjaxConll(tfds.core.GeneratorBasedBuilder):
    """`conll2003` features (`tokens`, `ner`) over CONLL_RECORDS."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "tokens": tfds.features.Sequence(tfds.features.Text()),
                    "ner": tfds.features.Sequence(tfds.features.ClassLabel(names=list(CONLL_TAGS))),
                }
            ),
        )

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(records) for split, records in CONLL_RECORDS.items()}

    def _generate_examples(self, records):
        for index, (tokens, tags) in enumerate(records):
            yield index, {"tokens": tokens, "ner": tags}
