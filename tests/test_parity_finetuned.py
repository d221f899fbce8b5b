"""Fine-tuned bertjax models exported by `python -m bertjax.convert WORKDIR OUT` load in
transformers' Auto classes and give bertjax's logits: an MRPC pair classifier (tokenized by
AutoTokenizer, the dev predictions and accuracy of the run), STS-B regression, a CoNLL-2003
tagger and a SQuAD span model, each fine-tuned here on synthetic data.

Needs the `parity` extra (pip install -e '.[parity]'); deselected by default, run with
`python -m pytest -q -m parity tests`.
"""

import csv
import json
import random
import shutil

import ml_collections
import numpy as np
import pytest

from bertjax import convert
from bertjax.interop import pretrained, pretrained_weights
from bertjax.tasks import ner
from bertjax.training import finetune_setup
from bertjax.training.finetune_settings import FinetuneSettings
from test_exports import fine_tune, write_task_data
from test_finetune import NAMES, POSITIVE, sentence

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.parity
TOLERANCE = 1e-5


def bertjax_outputs(workdir, split: str):
    """The fine-tuned model's outputs on `split`, computed by bertjax from the workdir alone
    (its tokenizer beside it, its best checkpoint), with the split's encoded features."""
    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    source = pretrained.Source(init_checkpoint=str(workdir))
    tokenizer = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
    bert_config, params = pretrained.read(str(workdir))
    task = finetune_setup.make_task(FinetuneSettings.of(config.to_dict()), tokenizer)
    data = task.load(split)
    f = data.features
    outputs = task.model(bert_config).apply(
        {"params": params}, f["input_ids"], f["segment_ids"], f["input_mask"], deterministic=True
    )
    return data, outputs


def exported(workdir, out, auto_class: str):
    """`python -m bertjax.convert WORKDIR OUT`, loaded with transformers' `auto_class`."""
    assert convert.main([str(workdir), str(out)]) == 0
    return out, getattr(transformers, auto_class).from_pretrained(str(out)).eval()


def run_hf(model, features):
    with torch.no_grad():
        return model(
            **{
                name: torch.tensor(np.asarray(features[key]), dtype=torch.long)
                for name, key in (
                    ("input_ids", "input_ids"),
                    ("token_type_ids", "segment_ids"),
                    ("attention_mask", "input_mask"),
                )
            }
        )


def test_mrpc_export_reproduces_the_dev_predictions(tmp_path):
    write_task_data(tmp_path)
    summary = fine_tune(tmp_path, "mrpc", str(tmp_path / "run"), num_train_epochs=10.0)
    data, logits = bertjax_outputs(tmp_path / "run", "dev")
    out, model = exported(tmp_path / "run", tmp_path / "hf", "AutoModelForSequenceClassification")
    assert model.config.id2label == {0: "0", 1: "1"}
    assert model.config.problem_type == "single_label_classification"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    with open(tmp_path / "MRPC" / "dev.tsv", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t"))[1:]
    encoded = tokenizer(
        [r[3] for r in rows],
        [r[4] for r in rows],
        padding="max_length",
        max_length=16,
        return_tensors="np",
    )
    np.testing.assert_array_equal(encoded["input_ids"], data.features["input_ids"])
    np.testing.assert_array_equal(encoded["token_type_ids"], data.features["segment_ids"])
    np.testing.assert_array_equal(encoded["attention_mask"], data.features["input_mask"])
    with torch.no_grad():
        theirs = model(**{k: torch.tensor(v) for k, v in encoded.items()}).logits.numpy()
    assert np.abs(theirs - np.asarray(logits)).max() <= TOLERANCE
    predictions = theirs.argmax(-1)
    assert len(set(predictions)) == 2  # (a model that predicts one class would check less)
    np.testing.assert_array_equal(predictions, np.asarray(logits).argmax(-1))
    labels = np.array([int(r[0]) for r in rows])
    assert summary["seeds"][0]["dev"]["dev"]["accuracy"] == pytest.approx(
        np.mean(predictions == labels)
    )


def test_stsb_export_is_a_regression_model(tmp_path):
    write_task_data(tmp_path)
    rng = random.Random(1)
    (tmp_path / "STS-B").mkdir()
    for split, count in (("train", 32), ("dev", 16)):
        rows = [
            "\t".join(
                [
                    "index",
                    "genre",
                    "filename",
                    "year",
                    "old_index",
                    "source1",
                    "source2",
                    "sentence1",
                    "sentence2",
                    "score",
                ]
            )
        ]
        rows += [
            "\t".join(
                ["0"] * 7 + [sentence(rng, i % 2 == 0), sentence(rng, True), f"{(i % 6) * 1.0:.1f}"]
            )
            for i in range(count)
        ]
        (tmp_path / "STS-B" / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    fine_tune(tmp_path, "stsb", str(tmp_path / "run"))
    data, logits = bertjax_outputs(tmp_path / "run", "dev")
    _, model = exported(tmp_path / "run", tmp_path / "hf", "AutoModelForSequenceClassification")
    assert model.config.problem_type == "regression" and model.config.num_labels == 1
    theirs = run_hf(model, data.features).logits.numpy()
    assert theirs.shape == (16, 1) and np.abs(theirs - np.asarray(logits)).max() <= TOLERANCE


def test_ner_and_squad_exports_give_bertjax_logits(tmp_path):
    write_task_data(tmp_path)
    rng = random.Random(2)
    (tmp_path / "conll").mkdir()
    for split, count in (("train.txt", 32), ("valid.txt", 8), ("test.txt", 8)):
        lines = ["-DOCSTART- -X- -X- O", ""]
        for _ in range(count):
            name = rng.choice(NAMES)
            lines += [
                f"{name} NNP B-NP {'B-LOC' if name == 'paris' else 'B-PER'}",
                "was VBD B-VP O",
                f"{rng.choice(POSITIVE)} JJ B-ADJP O",
                ". . O O",
                "",
            ]
        (tmp_path / "conll" / split).write_text("\n".join(lines) + "\n")
    fine_tune(
        tmp_path, "conll2003", str(tmp_path / "ner"), "ner.py", data_dir=str(tmp_path / "conll")
    )
    data, logits = bertjax_outputs(tmp_path / "ner", "dev")
    _, model = exported(tmp_path / "ner", tmp_path / "ner_hf", "AutoModelForTokenClassification")
    assert list(model.config.id2label.values()) == list(ner.LABELS)
    real = data.features["input_mask"].astype(bool)
    theirs = run_hf(model, data.features).logits.numpy()
    assert np.abs(theirs[real] - np.asarray(logits)[real]).max() <= TOLERANCE

    paragraphs = [
        {
            "context": f"{a} was good . {b} was bad .",
            "qas": [
                {
                    "id": f"q{i}",
                    "question": "what was good ?",
                    "answers": [{"text": a, "answer_start": 0}],
                }
            ],
        }
        for i, (a, b) in enumerate(rng.sample(NAMES, 2) for _ in range(16))
    ]
    (tmp_path / "squad.json").write_text(
        json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]})
    )
    squad = str(tmp_path / "squad.json")
    fine_tune(
        tmp_path,
        "squad",
        str(tmp_path / "squad"),
        "squad.py",
        train_file=squad,
        predict_file=squad,
        max_seq_length=24,
        doc_stride=8,
        max_query_length=8,
    )
    data, (start, end) = bertjax_outputs(tmp_path / "squad", "dev")
    _, model = exported(tmp_path / "squad", tmp_path / "squad_hf", "AutoModelForQuestionAnswering")
    theirs = run_hf(model, data.features)
    real = data.features["input_mask"].astype(bool)
    assert np.abs(theirs.start_logits.numpy()[real] - np.asarray(start)[real]).max() <= TOLERANCE
    assert np.abs(theirs.end_logits.numpy()[real] - np.asarray(end)[real]).max() <= TOLERANCE


def test_transformers_fine_tuned_models_give_their_encoder(tmp_path):
    """A token classifier and a QA model saved by transformers (no pooler): as
    init_checkpoint, their encoder's outputs are transformers'; `convert` imports the
    encoder, and its HF export loads in transformers' BertModel with the same outputs."""
    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=3,
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 30, (2, 12))
    features = {
        "input_ids": ids,
        "segment_ids": np.tile([0] * 6 + [1] * 6, (2, 1)),
        "input_mask": np.ones_like(ids),
    }
    for cls in (transformers.BertForTokenClassification, transformers.BertForQuestionAnswering):
        torch.manual_seed(0)
        directory = tmp_path / cls.__name__
        cls(config).eval().save_pretrained(str(directory))
        (directory / "vocab.txt").write_text(
            "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(25)])
            + "\n"
        )
        expected = run_hf(cls.from_pretrained(str(directory)).bert.eval(), features)
        model, params, _ = pretrained_weights.load_encoder(
            pretrained.Source(
                init_checkpoint=str(directory),
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
        sequence, _ = model.apply(
            {"params": params}, ids, features["segment_ids"], features["input_mask"]
        )
        theirs = expected.last_hidden_state.numpy()
        assert np.abs(np.asarray(sequence) - theirs).max() <= TOLERANCE
        assert convert.main([str(directory), str(tmp_path / "imported")]) == 0
        _, bert_model = exported(tmp_path / "imported", tmp_path / "hf", "BertModel")
        assert (
            np.abs(run_hf(bert_model, features).last_hidden_state.numpy() - theirs).max()
            <= TOLERANCE
        )
        for out in ("imported", "hf"):
            shutil.rmtree(tmp_path / out)
