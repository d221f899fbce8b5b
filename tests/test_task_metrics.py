"""Official task metrics against scipy and hand-computed references."""

import numpy as np
import pytest
from scipy import stats

from bertjax.tasks import metrics


def test_correlations_match_scipy_including_ties():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, 200).astype(float)  # many ties, like STS-B's 0-5 scores
    y = x + rng.normal(0, 1.5, 200)
    assert metrics.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    assert metrics.spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
    assert metrics.spearman([1, 2, 2, 3], [4, 3, 3, 1]) == pytest.approx(
        stats.spearmanr([1, 2, 2, 3], [4, 3, 3, 1])[0]
    )
    assert metrics.pearson([1, 1, 1], [1, 2, 3]) == 0.0  # constant input: defined as 0


def test_matthews_f1_accuracy_by_hand():
    labels = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    preds = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0, 0])
    tp, tn, fp, fn = 3, 5, 1, 1
    mcc = (tp * tn - fp * fn) / np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert metrics.matthews_corrcoef(preds, labels) == pytest.approx(mcc)
    assert metrics.binary_f1(preds, labels) == pytest.approx(2 * 0.75 * 0.75 / 1.5)
    assert metrics.accuracy(preds, labels) == pytest.approx(0.8)
    assert metrics.matthews_corrcoef(np.zeros(4), np.array([0, 1, 0, 1])) == 0.0  # as sklearn
    assert metrics.binary_f1(np.zeros(4), np.array([0, 1, 0, 1])) == 0.0


def test_entities_iob2_and_iob1_read_alike():
    iob2 = ["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-LOC", "O", "I-ORG"]
    iob1 = ["I-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-LOC", "O", "I-ORG"]
    expected = {(0, 1, "PER"), (3, 3, "LOC"), (4, 5, "LOC"), (7, 7, "ORG")}
    assert metrics.entities(iob2) == expected
    assert metrics.entities(iob1) == expected
    # A type change inside a run of I- tags starts a new chunk (conlleval).
    assert metrics.entities(["I-PER", "I-LOC", "I-LOC"]) == {(0, 0, "PER"), (1, 2, "LOC")}


def test_entity_scores_by_hand():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "B-MISC"]]
    # gold chunks 3, predicted 4, correct 2 (PER, ORG); a partial or mistyped chunk is wrong.
    scores = metrics.entity_scores(gold, pred)
    assert scores["precision"] == pytest.approx(2 / 4)
    assert scores["recall"] == pytest.approx(2 / 3)
    assert scores["f1"] == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    partial = metrics.entity_scores([["B-PER", "I-PER"]], [["B-PER", "O"]])
    assert partial == {"precision": 0.0, "recall": 0.0, "f1": 0.0}


def test_every_task_provides_what_the_adapter_interface_declares():
    """`features.Finetune` states its contract (abstract methods, issue 35): each task
    implements every one and sets the metric and splits; a task that omits one cannot be made."""
    from bertjax.tasks import features, glue, ner, squad_predict

    tasks = features.Finetune.__subclasses__()
    assert set(tasks) == {glue.GlueFinetune, ner.NerFinetune, squad_predict.SquadFinetune}
    for task in tasks:
        assert not task.__abstractmethods__, task
        adapter = task(features.TaskOptions(task="sst2"), None)
        assert adapter.main_metric and adapter.eval_splits, task
        assert isinstance(adapter.test_splits, list), task

    class NoPredictions(features.Finetune):
        model = load = loss = evaluate = lambda *args: None

    with pytest.raises(TypeError, match=r"abstract method.*write_predictions"):
        NoPredictions()
