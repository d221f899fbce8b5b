"""Fine-tuning step counts are the original's: `int(num_train_examples / train_batch_size *
num_train_epochs)` (run_classifier.py, run_squad.py), SQuAD counting questions rather than
their document windows; the loop takes exactly that many steps over a repeated, shuffled
training set and evaluates where each pass over it ends."""

import json
import os
import runpy

import numpy as np
import pytest

from bertjax.checkpoints import checkpoint, checkpoint_checks
from bertjax.data import tokenization
from bertjax.tasks import features, glue, ner, squad_predict
from bertjax.training import finetune_loop, finetune_trainer, resume
from bertjax.training.finetune_settings import FinetuneSettings

WORDS = ["a", "b", "c", "d", "john", "paris", "was", "good", "who", "?", "."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("\n".join([*tokenization.SPECIAL_TOKENS, *WORDS]) + "\n")
    return tokenization.WordPieceTokenizer(str(vocab))


def steps(num_examples: int, batch: int = 32, epochs: float = 3.0) -> int:
    config = runpy.run_path(
        os.path.join(os.path.dirname(__file__), "..", "configs", "finetune", "glue.py")
    )["get_config"]().to_dict()
    return FinetuneSettings.of(
        {**config, "train_batch_size": batch, "num_train_epochs": epochs}
    ).train_steps(num_examples)


@pytest.mark.parametrize(
    "task, examples, original, dropped_remainder",
    [("mrpc", 3668, 343, 342), ("mnli", 392702, 36815, 36813), ("sst2", 67349, 6313, 6312)],
)
def test_glue_step_counts_are_run_classifiers(task, examples, original, dropped_remainder):
    """The GLUE training-set sizes: run_classifier's count, not (n // batch) * epochs."""
    assert steps(examples) == original == int(examples / 32 * 3.0)
    assert (examples // 32) * 3 == dropped_remainder
    assert steps(examples, epochs=2.5) == int(examples / 32 * 2.5)


def test_each_task_counts_its_examples(tokenizer, tmp_path):
    """GLUE and CoNLL count rows (one per example or sentence); SQuAD counts questions,
    which here span 6 document windows each."""
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    os.makedirs(tmp_path / "MRPC")
    (tmp_path / "MRPC" / "train.tsv").write_text(
        "\n".join([header] + [f"{i % 2}\t1\t2\ta b\tc d" for i in range(110)]) + "\n"
    )
    (tmp_path / "train.txt").write_text(
        "".join("john NNP B-NP B-PER\nwas VBD B-VP O\n. . O O\n\n" for _ in range(50))
    )
    context = " ".join(["a b c d"] * 12) + " john was good ."
    qas = [
        {
            "id": f"q{i}",
            "question": "who ?",
            "answers": [{"text": "john", "answer_start": context.index("john")}],
        }
        for i in range(40)
    ]
    (tmp_path / "squad.json").write_text(
        json.dumps(
            {
                "version": "1.1",
                "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}],
            }
        )
    )
    options = dict(data_dir=str(tmp_path), max_seq_length=24)
    tasks = {
        "glue": (glue.GlueFinetune(features.TaskOptions(task="mrpc", **options), tokenizer), 110),
        "ner": (ner.NerFinetune(features.TaskOptions(**options), tokenizer), 50),
        "squad": (
            squad_predict.SquadFinetune(
                features.TaskOptions(
                    train_file=str(tmp_path / "squad.json"),
                    doc_stride=8,
                    max_query_length=8,
                    **options,
                ),
                tokenizer,
            ),
            40,
        ),
    }
    for kind, (task, examples) in tasks.items():
        train = task.load("train")
        assert task.num_train_examples(train) == examples, kind
        assert steps(task.num_train_examples(train)) == int(examples / 32 * 3.0), kind
    squad_rows = len(tasks["squad"][0].load("train"))
    assert squad_rows == 6 * 40 and steps(squad_rows) != steps(40)


def test_the_loop_takes_every_step_and_evaluates_at_each_pass_end():
    """110 rows, batch 32, 3 epochs: 10 steps (3 whole passes hold 10.3 batches), evaluated
    after steps 3 (110 // 32), 6 and 10; each pass is one permutation of the rows, and a batch
    spans the boundary between two passes."""
    assert finetune_trainer.epoch_ends(110, 32, steps(110)) == [3, 6, 10]
    assert finetune_trainer.epoch_ends(96, 32, steps(96, epochs=10)) == list(range(3, 31, 3))
    assert finetune_trainer.epoch_ends(10, 32, 2) == [1, 2]  # fewer rows than a batch
    batches = finetune_trainer.shuffled_batches(np.random.default_rng(0), 110, 32)
    stream = np.concatenate([next(batches) for _ in range(10)])
    for start in (0, 110):
        assert sorted(stream[start : start + 110]) == list(range(110))
    assert len(set(stream[220:])) == 100  # the third pass, 100 of its 110 rows


def test_a_resume_keeps_the_rows_up_to_its_step_and_drops_damaged_ones(tmp_path, caplog):
    """metrics.jsonl with a row cut short (before: a JSONDecodeError traceback at the resume)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 0.5}\n'
        '{"step": 4, "loss": 0.4}\n'
    )
    finetune_loop._keep_rows_up_to(str(path), 3)
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 3, "loss": 0.5}\n'
    assert "dropped 1 damaged row(s)" in caplog.text


@pytest.mark.parametrize("text", ['{"seed": 1, "best_ep', '{"seed": 1}', "[1]"])
def test_a_damaged_seed_summary_is_not_a_finished_seed(text, tmp_path):
    """A truncated summary.json or one without its fields (before: a KeyError traceback at
    the rerun) marks no finished seed: the rerun resumes from the seed's checkpoint."""
    (tmp_path / "summary.json").write_text(text)
    assert finetune_loop._finished(str(tmp_path)) is None
    (tmp_path / "summary.json").write_text('{"best_epoch": 1, "best_step": 3, "dev": {}}')
    assert finetune_loop._finished(str(tmp_path))["best_step"] == 3


def test_a_missing_checkpoint_is_named_with_the_way_on(tmp_path):
    """A finished seed's best checkpoint deleted (before: "cannot be restored ... move it out
    ... and rerun to resume from the checkpoint before it", of which there is none)."""
    checkpointer = checkpoint.Checkpointer(str(tmp_path), save_every=1, keep_latest=1)
    with pytest.raises(
        checkpoint_checks.DamagedCheckpoint,
        match=rf"checkpoint {tmp_path}/3 is damaged: "
        r"it is missing; start this fine-tuning again with --overwrite$",
    ):
        resume.restore_exactly(checkpointer, 3, None, {})
    checkpointer.close()
