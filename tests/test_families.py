"""The model-family interface (`bertjax.models.families`): shared code never branches on the family
(an AST count, 0), and a third family defined in tests/ (`toy_family`: BERT without NSP under
another name) registers through the interface (a subclass of BERT's adapter) and then pretrains, resumes, fine-tunes and
extracts features with no edit to shared code."""

import ast
import dataclasses
import os
import pathlib
import random
import re
import runpy

import jax
import numpy as np
import pytest

import toy_family
from bertjax import convert, extract_features, finetune, train
from bertjax.checkpoints import checkpoint
from bertjax.errors import ConfigError
from bertjax.interop import pretrained, pretrained_weights
from bertjax.models import families
from bertjax.models.bert.model import BertConfig, BertModel
from bertjax.models.modernbert.config import ModernBertConfig
from test_train import cache_dir, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixtures)

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "bertjax"
REPO_ROOT = PACKAGE.parent
# The family modules: the interface, each family's networks and its adapter. Only these may
# name a family (interop/ included: its readers ask the family).
FAMILY_MODULES = ("models/families.py", "models/bert/", "models/modernbert/", "families/")
FAMILY_NAMES = ("bert", "modernbert")


def family_only_fields() -> set[str]:
    """The config fields some registered family has and another lacks (`scan_layers`, ...)."""
    fields = [
        {f.name for f in dataclasses.fields(families.get(name).config_class)}
        for name in families.names()
    ]
    return set.union(*fields) - set.intersection(*fields)


FAMILY_ONLY = family_only_fields()


def duck_typed(node: ast.AST) -> bool:
    """A family told by its config's fields: `getattr`/`hasattr` of a field only some families
    have, or `dataclasses.replace` setting one."""
    if not isinstance(node, ast.Call):
        return False
    name = ast.unparse(node.func)
    if name in ("getattr", "hasattr") and len(node.args) > 1:
        return isinstance(node.args[1], ast.Constant) and node.args[1].value in FAMILY_ONLY
    return name.endswith("replace") and any(k.arg in FAMILY_ONLY for k in node.keywords)


def family_branches(tree: ast.AST) -> list[int]:
    """Lines that choose by family: `isinstance(x, <a Bert class>)`, a comparison with a
    family's name, `is_modernbert`, an `if`/ternary on a `modern` flag, or a duck-typed read
    of a family's own config field (`duck_typed`)."""
    found = set()
    for node in ast.walk(tree):
        if duck_typed(node):
            found.add(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "isinstance"
            and len(node.args) == 2
            and "Bert" in ast.unparse(node.args[1])
        ):
            found.add(node.lineno)
        elif isinstance(node, ast.Compare) and any(
            isinstance(side, ast.Constant) and side.value in FAMILY_NAMES
            for side in [node.left, *node.comparators]
        ):
            found.add(node.lineno)
        elif isinstance(node, (ast.Name, ast.Attribute)) and "is_modernbert" in (
            getattr(node, "id", None),
            getattr(node, "attr", None),
        ):
            found.add(node.lineno)
        elif isinstance(node, (ast.If, ast.IfExp)) and any(
            isinstance(name, ast.Name) and name.id == "modern" for name in ast.walk(node.test)
        ):
            found.add(node.lineno)
    return sorted(found)


def branches_outside_the_family_modules() -> dict[str, list[int]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if not name.startswith(FAMILY_MODULES):
            lines = family_branches(ast.parse(path.read_text(encoding="utf-8")))
            if lines:
                found[name] = lines
    return found


def test_shared_code_never_branches_on_the_family():
    assert branches_outside_the_family_modules() == {}


@pytest.mark.parametrize(
    "source",
    [
        "if isinstance(config, ModernBertConfig):\n    pass",
        "x = a if isinstance(model, (BertModel, y)) else b",
        "if families.family(model) == 'modernbert':\n    pass",
        "ok = 'bert' != name",
        "modern = families.is_modernbert(config)",
        "save = one if modern else other",
        "if getattr(config, 'scan_layers', False):\n    pass",
        "ok = hasattr(config, 'pad_token_id')",
        "config = dataclasses.replace(config, scan_layers=False)",
    ],
)
def test_the_branch_count_catches_planted_branches(source):
    assert family_branches(ast.parse(source)) == [1]


def test_families_are_found_by_name_config_and_transformers_type():
    assert families.names()[:2] == ("bert", "modernbert")
    assert families.of(BertConfig()).name == "bert"
    assert families.of(BertModel(BertConfig())).name == "bert"  # (a model: by its config)
    assert families.of(ModernBertConfig()) is families.get("modernbert")
    assert families.by_hf_type("modernbert").name == "modernbert"
    assert families.by_hf_type("roberta").name == "bert"  # (its reader names the problem)
    with pytest.raises(TypeError, match="no registered family"):
        families.of(object())
    with pytest.raises(
        ConfigError,
        match="model family 'toy' is not one of 'bert', 'modernbert': a family must be registered",
    ):
        families.from_record({**dataclasses.asdict(BertConfig()), "family": "toy"})
    assert families.as_record(ModernBertConfig())["family"] == "modernbert"
    assert "family" not in families.as_record(BertConfig())  # (BERT's records as before)


def test_each_family_owns_its_pretraining_loss():
    """BERT's is the masked LM's plus the next sentence's (the whole batch's denominators
    from `loss_denominators`); ModernBERT's the masked LM's alone, its NSP sums 0."""
    rng = np.random.default_rng(0)
    batch = {
        "masked_lm_ids": rng.integers(0, 7, (4, 3)).astype(np.int32),
        "masked_lm_weights": np.array([[1, 1, 0]] * 4, np.float32),
        "next_sentence_labels": rng.integers(0, 2, (4,)).astype(np.int32),
    }
    mlm, nsp = rng.normal(size=(4, 3, 7)), rng.normal(size=(4, 2))
    mlm_nll = -np.take_along_axis(jax.nn.log_softmax(mlm), batch["masked_lm_ids"][..., None], -1)
    nsp_nll = -np.take_along_axis(
        jax.nn.log_softmax(nsp), batch["next_sentence_labels"][:, None], -1
    )
    mlm_mean = (mlm_nll[..., 0] * batch["masked_lm_weights"]).sum() / (8 + 1e-5)
    bert, modernbert = families.get("bert"), families.get("modernbert")
    loss, sums = bert.pretraining_loss((mlm, nsp), batch)
    assert bert.loss_denominators(batch)["sequences"] == 4 and sums["nsp_count"] == 4
    np.testing.assert_allclose(loss, mlm_mean + nsp_nll.mean(), rtol=1e-5)
    loss, sums = modernbert.pretraining_loss((mlm, None), batch)
    np.testing.assert_allclose(loss, mlm_mean, rtol=1e-5)
    assert sums["nsp_loss_sum"] == sums["nsp_count"] == 0 and sums["mlm_weight_sum"] == 8


@pytest.fixture
def toy(monkeypatch):
    """The toy family registered for one test (the registry restored after it)."""
    families.names()  # (the built-in families first)
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    monkeypatch.setattr(families, "_BY_CLASS", dict(families._BY_CLASS))
    return families.register(toy_family.FAMILY)


def test_a_registered_family_is_known_to_the_config_checks(toy):
    assert families.names() == ("bert", "modernbert", "toy")
    assert families.of(toy_family.ToyConfig()) is toy  # (not BERT's, its base class)
    config = families.model_config({**dataclasses.asdict(BertConfig()), "family": "toy"})
    assert isinstance(config, toy_family.ToyConfig)
    with pytest.raises(
        ValueError, match=r"model\.family='gpt' is not one of 'bert', 'modernbert', 'toy'"
    ):
        families.check({"family": "gpt"})


def sst2(root: pathlib.Path) -> None:
    """SST-2 TSVs in GLUE's layout: the sentiment word decides the label."""
    rng, words = random.Random(0), ["the", "film", "was", "a", "story", "and", "very"]
    sentiment = (["bad", "dull", "awful"], ["good", "great", "fun"])
    os.makedirs(root / "SST-2")
    for split, count in (("train", 64), ("dev", 16)):
        rows = [
            f"{' '.join(rng.sample(words, 3))} {rng.choice(sentiment[i % 2])} .\t{i % 2}"
            for i in range(count)
        ]
        (root / "SST-2" / f"{split}.tsv").write_text("\n".join(["sentence\tlabel", *rows]) + "\n")


@pytest.mark.slow  # (about a minute on 2 cores)
def test_a_family_defined_in_tests_pretrains_resumes_fine_tunes_and_extracts_features(
    toy, corpus_file, cache_dir, tmp_path, capsys
):
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{
            "train.total_steps": 4,
            "train.checkpoint_every": 2,
            "long_phase.fraction": 0.0,
            "train.next_sentence_prediction": False,
            "train.stop_after_steps": 2,
        },
    )
    config.model.family = "toy"
    workdir = tmp_path / "pretrain"
    one_device = jax.devices()[:1]
    # Pretrains 2 steps and stops; the same command resumes to the end.
    train.train_and_evaluate(config, str(workdir), devices=one_device)
    assert "Stopped after 2 steps" in capsys.readouterr().out
    config.train.stop_after_steps = 0
    final = train.train_and_evaluate(config, str(workdir), devices=one_device)
    assert "nsp_loss" not in final and np.isfinite(final["mlm_loss"])
    assert [m["step"] for m in read_metrics(workdir)] == [1, 2, 3, 4]
    meta = checkpoint.read_meta(str(workdir / "checkpoints"))
    assert meta["model"]["family"] == "toy" and "seq_relationship" not in checkpoint.stored_params(
        str(workdir / "checkpoints")
    )
    # Its own checks run: no NSP head.
    config.train.next_sentence_prediction = True
    with pytest.raises(ConfigError, match=r"model\.family='toy' has no next-sentence head"):
        train.train_and_evaluate(config, str(tmp_path / "nsp"), devices=one_device)

    # Fine-tunes on SST-2 from the toy checkpoint (its encoder, a new BERT output layer).
    sst2(tmp_path)
    tune = runpy.run_path(str(REPO_ROOT / "configs" / "finetune" / "glue.py"))["get_config"]()
    tune.update(
        task="sst2",
        init_checkpoint=str(workdir),
        data_dir=str(tmp_path),
        max_seq_length=16,
        train_batch_size=16,
        eval_batch_size=8,
        num_train_epochs=1.0,
        learning_rate=1e-3,
    )
    summary = finetune.run(tune, str(tmp_path / "sst2"), devices=one_device)
    assert summary["seeds"][0]["dev"]["dev"]["accuracy"] >= 0.0
    seed_meta = checkpoint.read_meta(
        str(next((tmp_path / "sst2" / "seed_1").glob("**/checkpoints")))
    )
    assert seed_meta["bert_config"]["family"] == "toy"

    # Extracts features: its encoder with the checkpoint's parameters.
    source = pretrained.Source(
        init_checkpoint=str(workdir), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    model, params, tokenizer = pretrained_weights.load_encoder(source)
    assert isinstance(model.config, toy_family.ToyConfig)
    records = list(
        extract_features.extract(
            model, params, tokenizer, [("the film was good .", None)], [-1], 16, 2
        )
    )
    ids = np.array([tokenizer.convert_tokens_to_ids([f["token"] for f in records[0]["features"]])])
    sequence, _ = model.apply({"params": params}, ids, ids * 0, ids * 0 + 1)
    np.testing.assert_allclose(
        records[0]["features"][0]["layers"][0]["values"], sequence[0, 0], atol=2e-6
    )

    # No transformers class: an export to Hugging Face is refused in one line.
    assert convert.main([str(workdir), str(tmp_path / "hf"), "--to=hf"]) == 1
    assert re.search(r"holds a Toy model, which has no transformers class", capsys.readouterr().err)
