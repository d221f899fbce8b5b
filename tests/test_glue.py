"""GLUE readers (TSV layouts, CoLA raw, parquet), bad-row counting, encoding, submissions."""

import os
from pathlib import Path

import numpy as np
import pytest

from bertjax.data import tokenization
from bertjax.tasks import features, glue, glue_tasks, metrics

GLUE_DIR = "/work/shared/data/glue"
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c", "d", "."]


@pytest.fixture
def tokenizer(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(VOCAB) + "\n")
    return tokenization.WordPieceTokenizer(str(path))


def write(path, lines, bom=False):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8-sig" if bom else "utf-8") as f:
        f.write("\n".join(lines) + "\n")


def test_mrpc_tsv_counts_bad_rows_and_keeps_quotes(tmp_path):
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    write(
        tmp_path / "MRPC" / "train.tsv",
        [
            header,
            '1\t1\t2\tHe said "hi\tb c',
            "0\t3\t4\ta\tb",
            "x\t5\t6\ta\tb",
            "1\t7\t8\tonly four",
        ],
        bom=True,
    )
    examples, skipped = glue.read_examples(glue_tasks.get_task("mrpc"), "train", str(tmp_path))
    assert [(e.text_a, e.text_b, e.label) for e in examples] == [
        ('He said "hi', "b c", "1"),
        ("a", "b", "0"),
    ]
    assert skipped == {"unknown label": 1, "missing column": 1}


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    """Latin-1 bytes in a TSV (before: a UnicodeDecodeError naming no file)."""
    (tmp_path / "SST-2").mkdir()
    (tmp_path / "SST-2" / "train.tsv").write_bytes(
        "sentence\tlabel\ncaf\xe9\t1\n".encode("latin-1")
    )
    with pytest.raises(
        features.TaskDataError,
        match=r"SST-2/train.tsv is not UTF-8 text \(byte "
        r"18: invalid continuation byte\); convert it to UTF-8",
    ):
        glue.read_examples(glue_tasks.get_task("sst2"), "train", str(tmp_path))


def test_cola_raw_layout_dev_is_in_plus_out_of_domain(tmp_path):
    raw = tmp_path / "CoLA" / "cola_public" / "raw"
    write(raw / "in_domain_dev.tsv", ["src\t1\t\ta b .", "src\t0\t*\tb a ."])
    write(raw / "out_of_domain_dev.tsv", ["src\t1\t\tc d ."])
    examples, _ = glue.read_examples(glue_tasks.get_task("cola"), "dev", str(tmp_path))
    assert [(e.text_a, e.label) for e in examples] == [
        ("a b .", "1"),
        ("b a .", "0"),
        ("c d .", "1"),
    ]


def test_rte_parquet_and_missing_split_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(tmp_path / "RTE")
    pq.write_table(
        pa.table(
            {"sentence1": ["a b", "c"], "sentence2": ["b", "d"], "label": [1, 0], "idx": [0, 1]}
        ),
        tmp_path / "RTE" / "validation.parquet",
    )
    examples, _ = glue.read_examples(glue_tasks.get_task("rte"), "dev", str(tmp_path))
    assert [e.label for e in examples] == ["not_entailment", "entailment"]
    with pytest.raises(features.TaskDataError, match=r"train\.tsv"):
        glue.read_examples(glue_tasks.get_task("rte"), "train", str(tmp_path))
    with pytest.raises(ValueError, match="unknown GLUE task"):
        glue_tasks.get_task("mnli-x")


def test_encode_truncates_the_longer_text_and_writes_a_submission(tmp_path, tokenizer):
    task = glue_tasks.get_task("stsb")
    examples = [glue.Example("7", "a b c d a b c d", "a", 4.2), glue.Example("8", "a", "b", 1.0)]
    encoded = glue.encode(task, examples, tokenizer, max_seq_length=8)
    ids = {v: k for k, v in enumerate(VOCAB)}
    assert encoded["input_ids"][0].tolist() == [
        ids[t] for t in "[CLS] a b c d [SEP] a [SEP]".split()
    ]
    assert encoded["segment_ids"][0].tolist() == [0] * 6 + [1] * 2
    assert encoded["input_mask"][1].tolist() == [1] * 5 + [0] * 3
    assert encoded["labels"].tolist() == pytest.approx([4.2, 1.0])
    path = glue.write_submission(task, "test", examples, np.array([5.7, 1.23456]), str(tmp_path))
    assert os.path.basename(path) == "STS-B.tsv"
    assert Path(path).read_text() == "index\tprediction\n7\t5.000\n8\t1.235\n"
    mnli = glue_tasks.get_task("mnli")
    assert mnli.test_splits == ["test_matched", "test_mismatched", "ax"]
    path = glue.write_submission(mnli, "ax", examples, np.array([0, 1]), str(tmp_path))
    assert Path(path).read_text() == "index\tprediction\n7\tcontradiction\n8\tentailment\n"


@pytest.mark.skipif(not os.path.isdir(GLUE_DIR), reason="real GLUE data not present")
def test_real_glue_files_read_completely():
    expected = {
        ("sst2", "train"): 67349,
        ("sst2", "dev"): 872,
        ("sst2", "test"): 1821,
        ("mrpc", "train"): 3668,
        ("mrpc", "dev"): 408,
        ("mrpc", "test"): 1725,
        ("cola", "train"): 8551,
        ("cola", "dev"): 1043,
        ("stsb", "dev"): 1500,
        ("stsb", "test"): 1379,
        ("rte", "train"): 2490,
        ("rte", "dev"): 277,
    }
    for (name, split), count in expected.items():
        examples, skipped = glue.read_examples(glue_tasks.get_task(name), split, GLUE_DIR)
        assert (len(examples), skipped) == (count, {}), (name, split)


def test_tfds_glue_records_labels_and_test_splits(tmp_path):
    """tfds `glue/<task>` as `tfds build glue/...` lays it out: integer labels mapped to the TSV
    label names (MNLI's tfds order differs), `idx` kept, label -1 read as unlabelled test rows."""
    import tfds_fixture

    data_dir = str(tmp_path)
    for task in ("sst2", "mnli"):
        tfds_fixture.prepare_as(
            tfds_fixture.BertjaxGlue(config=task, data_dir=data_dir), f"glue/{task}"
        )

    def read(task: str, split: str) -> tuple[list[glue.Example], dict]:  # tfds shuffles records
        examples, skipped = glue.read_examples(glue_tasks.get_task(task), split, "", data_dir)
        return sorted(examples, key=lambda e: e.index), skipped

    assert read("sst2", "train") == (
        [glue.Example("0", "a b", None, "1"), glue.Example("1", "c", None, "0")],
        {"unknown label": 1},
    )
    assert read("sst2", "test") == (
        [glue.Example("0", "a", None, None), glue.Example("1", "d c", None, None)],
        {},
    )
    examples, skipped = read("mnli", "train")
    assert [(e.text_a, e.text_b, e.label) for e in examples] == [
        ("a", "b", "entailment"),
        ("c", "d", "contradiction"),
        ("b", "a", "neutral"),
    ]
    assert skipped == {"unknown label": 1}
    assert read("mnli", "dev_mismatched")[0] == [glue.Example("0", "c", "a", "contradiction")]
    assert [e.index for e in read("mnli", "test_matched")[0]] == ["0"]
    with pytest.raises(features.TaskDataError, match=r"tfds build glue/rte.*RTE/train\.tsv"):
        read("rte", "train")


def test_baselines_and_the_warning_when_a_model_does_not_beat_them(tmp_path, tokenizer):
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    write(tmp_path / "MRPC" / "train.tsv", [header] + [f"{q}\t1\t2\ta\tb" for q in "11101"])
    write(tmp_path / "MRPC" / "dev.tsv", [header] + [f"{q}\t1\t2\ta\tb" for q in "1100"])
    write(
        tmp_path / "STS-B" / "train.tsv",
        ["i\tg\tf\ty\td\ts\tx\ta\tb\tscore"]
        + [f"{i}\tg\tf\ty\td\ts\tx\ta\tb\t{s}" for i, s in enumerate([1.0, 2.0, 4.5])],
    )
    mrpc = glue.GlueFinetune(
        features.TaskOptions(task="mrpc", data_dir=str(tmp_path), max_seq_length=8), tokenizer
    )
    how, values = mrpc.baseline(mrpc.load("train"), mrpc.load("dev"))
    assert how == "always '1', the majority class"
    assert values == {"f1": pytest.approx(2 / 3), "accuracy": 0.5}
    stsb = glue.GlueFinetune(
        features.TaskOptions(task="stsb", data_dir=str(tmp_path), max_seq_length=8), tokenizer
    )
    train = stsb.load("train")
    how, values = stsb.baseline(train, train)
    assert how == "always 2.500, the mean" and values == {"pearson": 0.0, "spearman": 0.0}

    stats = {
        "dev/f1": {"mean": 0.6, "std": 0.0, "median": 0.6},
        "dev/accuracy": {"mean": 0.75, "std": 0.0, "median": 0.75},
    }
    lines, warnings = metrics.summary_lines(
        "mrpc", stats, 1, {"dev": (how, {"f1": 2 / 3, "accuracy": 0.5})}
    )
    assert lines[0].endswith("over 1 seeds; baseline 0.6667")
    assert len(warnings) == 1 and warnings[0].startswith(
        "dev: f1 0.6000 (baseline 0.6667) do not beat the baseline that ignores the input"
    )
