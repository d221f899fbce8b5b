"""CoNLL-2003 named-entity recognition: readers (CoNLL text files, tfds `conll2003`), encoding
with the first sub-token of each word labelled (the paper's setup), and conlleval scoring.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from bertjax.data import tfds_source, tokenization
from bertjax.models import families
from bertjax.models.layers import losses
from bertjax.runtime import files
from bertjax.tasks import features, metrics

# The CoNLL-2003 tag set (IOB1 files use the same tags; B- only between touching entities).
LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
FILES = {
    "train": ("train.txt", "eng.train"),
    "dev": ("valid.txt", "dev.txt", "eng.testa"),
    "test": ("test.txt", "eng.testb"),
}
TFDS_SPLITS = {"train": "train", "dev": "dev", "test": "test"}


@dataclasses.dataclass
class Sentence:
    words: list[str]
    tags: list[str]


def read_conll_file(path: str, skips: features.SkipCounter) -> list[Sentence]:
    """Sentences of a CoNLL file: one `word ... tag` line per token (tag last), blank lines
    between sentences, `-DOCSTART-` lines ignored. Sentences with an unknown tag or a line
    without a tag are skipped and counted."""
    sentences: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []
    bad: str | None = None
    with files.open(path, encoding="utf-8") as f, features.decoding(path):
        for line in itertools.chain(f, [""]):  # (a blank line ends the last sentence)
            fields = line.split()
            if not fields or fields[0] == "-DOCSTART-":
                if bad:
                    skips[bad] += 1
                elif words:
                    sentences.append(Sentence(words, tags))
                words, tags, bad = [], [], None
            elif len(fields) < 2:
                bad = bad or "line without a tag"
            elif fields[-1] not in LABELS:
                bad = bad or "unknown label"
            else:
                words.append(fields[0])
                tags.append(fields[-1])
    return sentences


def _tfds_sentences(
    split: str, data_dir: str | None, skips: features.SkipCounter
) -> list[Sentence]:
    import tensorflow_datasets as tfds  # slow to import; only here

    names = tfds.builder("conll2003", data_dir=data_dir).info.features["ner"].feature.names
    sentences = []
    for record in tfds_source.open_tfds_source("conll2003", TFDS_SPLITS[split], data_dir):
        tags = [names[int(t)] for t in record["ner"]]
        if any(t not in LABELS for t in tags):
            skips["unknown label"] += 1
            continue
        words = [w.decode("utf-8") if isinstance(w, bytes) else w for w in record["tokens"]]
        if words:
            sentences.append(Sentence(words, tags))
    return sentences


def read_sentences(
    split: str, data_dir: str = "", tfds_data_dir: str = ""
) -> tuple[list[Sentence], dict[str, int]]:
    """One split (train/dev/test) from CoNLL text files in `data_dir`, or from tfds when empty."""
    skips = features.SkipCounter()
    if data_dir:
        path = next(
            (
                os.path.join(data_dir, name)
                for name in FILES[split]
                if files.exists(os.path.join(data_dir, name))
            ),
            None,
        )
        if path is None:
            raise features.TaskDataError(
                f"CoNLL-2003 {split}: none of {list(FILES[split])} in {data_dir}"
            )
        sentences, where = read_conll_file(path, skips), path
    else:
        sentences, where = _tfds_sentences(split, tfds_data_dir or None, skips), "tfds conll2003"
    counts = skips.report(f"CoNLL-2003 {split} ({where})")
    if not sentences:
        raise features.TaskDataError(f"CoNLL-2003 {split}: no sentences in {where} ({counts})")
    logging.info("CoNLL-2003 %s: %d sentences from %s", split, len(sentences), where)
    return sentences, counts


def encode(
    sentences: Sequence[Sentence], tokenizer: tokenization.Tokenizer, max_seq_length: int
) -> tuple[dict[str, np.ndarray], list[list[int]], dict[str, int]]:
    """`[CLS] pieces [SEP]` with each word's tag on its first sub-token (weight 1) and weight 0
    elsewhere. Returns features, each sentence's first-sub-token positions (words cut by
    `max_seq_length` have none: they are predicted "O"), and counts of truncations."""
    specials = features.special_ids(tokenizer)
    unk = tokenizer.convert_tokens_to_ids([tokenization.UNK])[0]
    encode_word = features.word_tokenizer(tokenizer, ids=True)
    rows: list[tuple[np.ndarray, ...]] = []
    positions: list[list[int]] = []
    counts: collections.Counter[str] = collections.Counter()
    for sentence in sentences:
        ids, labels, weights, starts = [specials["cls"]], [0], [0], []
        for word, tag in zip(sentence.words, sentence.tags):
            pieces = encode_word(word) or [unk]
            if len(ids) + len(pieces) > max_seq_length - 1:
                counts["sentences truncated"] += 1
                break
            starts.append(len(ids))
            ids += pieces
            labels += [LABELS.index(tag)] + [0] * (len(pieces) - 1)
            weights += [1] + [0] * (len(pieces) - 1)
        ids.append(specials["sep"])
        input_ids, input_mask, segment_ids = features.pad_row(
            ids, [0] * len(ids), max_seq_length, specials["pad"]
        )
        padding = max_seq_length - len(ids)
        rows.append(
            (
                input_ids,
                input_mask,
                segment_ids,
                np.array(labels + [0] * (1 + padding), np.int32),
                np.array(weights + [0] * (1 + padding), np.int32),
            )
        )
        positions.append(starts)
    columns = [np.stack(c).reshape(len(sentences), max_seq_length) for c in zip(*rows)]
    names = ("input_ids", "input_mask", "segment_ids", "labels", "label_weights")
    if counts:  # kept, not skipped: their words past the cut are predicted "O"
        logging.warning(
            "CoNLL-2003: %d of %d sentences truncated at max_seq_length=%d (kept; "
            'their words past it are predicted "O"); raise '
            "--config.max_seq_length to keep them whole",
            counts["sentences truncated"],
            len(sentences),
            max_seq_length,
        )
    return dict(zip(names, columns)), positions, dict(counts)


def word_tags(
    predicted_ids: np.ndarray, positions: Sequence[list[int]], sentences: Sequence[Sentence]
) -> list[list[str]]:
    """Each word's predicted tag (its first sub-token's); words cut by truncation get "O"."""
    return [
        [LABELS[int(row[p])] for p in starts] + ["O"] * (len(sentence.words) - len(starts))
        for row, starts, sentence in zip(predicted_ids, positions, sentences, strict=True)
    ]


def evaluate(sentences: Sequence[Sentence], predicted: Sequence[list[str]]) -> dict[str, float]:
    return metrics.entity_scores([s.tags for s in sentences], predicted)


def write_predictions(
    path: str, sentences: Sequence[Sentence], predicted: Sequence[list[str]]
) -> None:
    """conlleval input: `word gold predicted` per line, a blank line after each sentence."""
    with files.open(path, "w", encoding="utf-8") as f:
        for sentence, tags in zip(sentences, predicted, strict=True):
            for word, gold, tag in zip(sentence.words, sentence.tags, tags):
                f.write(f"{word} {gold} {tag}\n")
            f.write("\n")


# ----------------------------------------------------------------------------- fine-tuning


class NerFinetune(features.Finetune[jax.Array, np.ndarray]):
    """CoNLL-2003 tagging; fine-tuned, or feature-based with a frozen encoder."""

    main_metric = "f1"
    eval_splits = ["dev"]  # noqa: RUF012 (read only, as the base class's)
    test_splits = ["test"]  # noqa: RUF012
    scored_test_splits = ["test"]  # noqa: RUF012

    def __init__(self, options: features.TaskOptions, tokenizer: tokenization.Tokenizer) -> None:
        self.options, self.tokenizer = options, tokenizer
        self.frozen_encoder = bool(options.feature_based)

    def model(self, model_config: families.ModelConfig) -> nn.Module:
        return families.head("tagging", model_config, len(LABELS), self.options)

    def load(self, split: str) -> features.SplitData:
        sentences, skipped = read_sentences(
            split, self.options.data_dir, self.options.tfds_data_dir
        )
        sentences = features.subset(sentences, self.options.max_train_examples, split)
        encoded, positions, truncated = encode(
            sentences, self.tokenizer, self.options.max_seq_length
        )
        return features.SplitData(split, encoded, (sentences, positions), {**skipped, **truncated})

    def loss(self, logits: jax.Array, batch: dict[str, jax.Array]) -> losses.Loss:
        weights = batch["label_weights"] * batch["weights"][:, None]
        return losses.tagging_loss(logits, batch["labels"], weights)

    def outputs(self, logits: jax.Array) -> jax.Array:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def _tags(self, data: features.SplitData, predicted_ids: np.ndarray) -> list[list[str]]:
        sentences, positions = data.examples
        return word_tags(predicted_ids, positions, sentences)

    def evaluate(self, data: features.SplitData, predicted_ids: np.ndarray) -> dict[str, float]:
        return evaluate(data.examples[0], self._tags(data, predicted_ids))

    def write_predictions(
        self, data: features.SplitData, predicted_ids: np.ndarray, directory: str
    ) -> str:
        path = os.path.join(directory, f"{data.name}_predictions.txt")
        write_predictions(path, data.examples[0], self._tags(data, predicted_ids))
        return path
