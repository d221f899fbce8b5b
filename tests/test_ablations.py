"""The paper's pretraining ablations as switches: the masking mix (Table 8), no NSP and the
left-to-right objective (Table 5). Instances come from the real default corpus with a real
SentencePiece model; steps are real jitted train steps."""

import itertools
import pathlib
import random
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import errors
from bertjax.data import (
    corpus_source,
    default_corpus,
    instances,
    loaders,
    pipeline,
    shard_format,
    tokenization,
    tokenize_corpus,
)
from bertjax.data.settings import DataSettings
from bertjax.models.bert.heads import BertForSequenceClassification, BertForTokenClassification
from bertjax.models.bert.model import BertConfig, BertForPreTraining
from bertjax.tasks import features, squad_predict
from bertjax.training import objectives, optim, sharding, steps, validate
from bertjax.training.phase_schedule import Phase
from bertjax.training.state import create_train_state

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
base_config = runpy.run_path(str(REPO_ROOT / "configs" / "base.py"))["get_config"]
SEQ, PREDS = 64, 10
PHASE = Phase("short", SEQ, PREDS, 8, 0, 100)


@pytest.fixture(scope="module")
def documents():
    return list(itertools.islice(default_corpus.default_corpus(), 120))


@pytest.fixture(scope="module")
def tokenizer(documents, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("sp") / "sp"
    model = tokenization.train_sentencepiece(
        (s for doc in documents for s in doc), str(prefix), 400, do_lower_case=True
    )
    return tokenization.SentencePieceTokenizer(model)


@pytest.fixture(scope="module")
def tokenized(documents, tokenizer):
    return tokenize_corpus.tokenize_documents(documents, tokenizer)[0]


def data_config(corpus_file="", **overrides):
    c = base_config().data
    c.update(
        source="text",
        input_files=corpus_file,
        text_format="lines",
        dupe_factor=2,
        max_seq_length=SEQ,
        max_predictions_per_seq=PREDS,
        eval_fraction=0.1,
        num_workers=1,
        **overrides,
    )
    return DataSettings.of(c)


def shown_tokens(features):
    """(what the model sees at each masked position, the original token there)."""
    weights = features["masked_lm_weights"] > 0
    rows = np.broadcast_to(np.arange(len(weights))[:, None], weights.shape)[weights]
    return features["input_ids"][rows, features["masked_lm_positions"][weights]], features[
        "masked_lm_ids"
    ][weights]


# ----------------------------------------------------------------------------- masking mix


@pytest.mark.parametrize(
    "mix", [(0.8, 0.1), (1.0, 0.0), (0.8, 0.0), (0.8, 0.2), (0.0, 0.2), (0.0, 0.0)]
)
def test_masking_mix_on_real_instances(tokenized, tokenizer, mix):
    """Table 8's mixes: the share of [MASK], random and kept tokens over ~1,500 predictions."""
    cfg = data_config(mask_token_prob=mix[0], random_token_prob=mix[1])
    features = pipeline.make_features(
        tokenized, PHASE, cfg, corpus_source.specials_of(tokenizer, False), 2, mask=True, seed=3
    )
    shown, original = shown_tokens(shard_format.expand(features))
    assert len(shown) > 1200
    as_mask = shown == tokenizer.mask_id
    kept = shown == original
    hit = mix[1] / tokenizer.vocab_size  # a random draw hits [MASK] or the original id
    shares = {
        "mask": (as_mask.mean(), mix[0] + hit),
        "random": ((~as_mask & ~kept).mean(), mix[1] - 2 * hit),
        "kept": (kept.mean(), 1 - mix[0] - mix[1] + hit),
    }
    for name, (share, expected) in shares.items():
        if expected == 0.0:
            assert share == 0.0, name
        else:
            assert abs(share - expected) < 0.035, (name, share, expected)


def test_dynamic_masks_follow_the_mix(tokenized, tokenizer):
    features = pipeline.make_features(
        tokenized,
        PHASE,
        data_config(),
        corpus_source.specials_of(tokenizer, False),
        1,
        mask=False,
        seed=3,
    )
    split = pipeline.PreparedSplit([features], masked=False)
    masking = (corpus_source.specials_of(tokenizer, False), 0.15, PREDS, False)
    loader = loaders.BatchLoader(split, 64, 1, masking=masking, mask_mix=(1.0, 0.0))
    shown, _ = shown_tokens(loader.batch(0))
    assert len(shown) > 200 and (shown == tokenizer.mask_id).all()


@pytest.mark.parametrize("mix", [(0.9, 0.2), (-0.1, 0.5), (0.5, 1.5)])
def test_invalid_mix_is_one_clear_error(mix):
    with pytest.raises(pipeline.DataError, match=r"data.mask_token_prob=.* sum of at most 1"):
        data_config(mask_token_prob=mix[0], random_token_prob=mix[1])


def test_switches_are_part_of_the_cache_key(documents, tokenizer, tmp_path):
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("\n\n".join("\n".join(d) for d in documents[:60]) + "\n")
    cache = tmp_path / "cache"
    for cfg, nsp in (
        (data_config(str(corpus_file)), True),
        (data_config(str(corpus_file), mask_token_prob=1.0, random_token_prob=0.0), True),
        (data_config(str(corpus_file)), False),
    ):
        prepared = pipeline.prepare(cfg, PHASE, tokenizer, str(cache), next_sentence_prediction=nsp)
    prepared_dirs = [p for p in cache.iterdir() if not p.name.startswith((".", "tokens_"))]
    assert len(prepared_dirs) == 3  # (not locks, nor the one tokenization all three read)
    assert len(list(cache.glob("tokens_*"))) == 1
    assert not prepared["train"].features["next_sentence_labels"].any()


# ----------------------------------------------------------------------------- no NSP


def numbered_corpus(seed=0, num_docs=60):
    """Document d's tokens are d * 1000 + 5, + 6, ...: a token names its document and place."""
    rng = random.Random(seed)
    docs = []
    for d in range(num_docs):
        counter = itertools.count(d * 1000 + 5)
        docs.append(
            [[next(counter) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 25))]
        )
    return docs


@pytest.mark.parametrize("nsp", [True, False])
def test_no_nsp_pairs_continue_their_document(nsp):
    specials = instances.SpecialTokens(cls_id=1, sep_id=2, mask_id=3, pad_id=0, vocab_size=10**5)
    created = instances.create_instances(
        numbered_corpus(), SEQ, 0.1, 3, random.Random(1), specials, next_sentence_prediction=nsp
    )
    from_other_document, single = 0, 0
    for instance in created:
        seps = np.flatnonzero(instance.tokens == 2)
        a, b = instance.tokens[1 : seps[0]], instance.tokens[seps[0] + 1 : -1]
        if not len(b):
            single += 1
            assert len(seps) == 1 and not instance.segment_ids.any()
            continue
        if len(np.unique(np.concatenate([a, b]) // 1000)) > 1:
            from_other_document += 1
            assert instance.is_random_next
        elif not instance.is_random_next:
            assert (np.diff(a) == 1).all() and (np.diff(b) == 1).all() and b[0] > a[-1]
    if nsp:
        assert from_other_document > 0.3 * len(created) and single == 0
    else:
        assert from_other_document == 0 and single > 0
        assert not any(i.is_random_next for i in created)


# ----------------------------------------------------------------------------- train steps

MODEL = BertConfig(
    vocab_size=60,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
BATCH, LENGTH = 4, 12


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((BATCH, LENGTH), np.int32)
    mask[0, 9:] = 0
    return {
        "input_ids": (rng.integers(5, 60, (BATCH, LENGTH)) * mask).astype(np.int32),
        "input_mask": mask,
        "segment_ids": (np.arange(LENGTH) >= 6).astype(np.int32)[None].repeat(BATCH, 0),
        "masked_lm_positions": np.tile(np.array([2, 5, 0], np.int32), (BATCH, 1)),
        "masked_lm_ids": np.tile(np.array([7, 8, 0], np.int32), (BATCH, 1)),
        "masked_lm_weights": np.tile(np.array([1, 1, 0], np.float32), (BATCH, 1)),
        "next_sentence_labels": rng.integers(0, 2, (BATCH,)).astype(np.int32),
    }


def _train_step(objective):
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    model = BertForPreTraining(MODEL)
    tx = optim.make_optimizer(
        optim.OptimizerConfig(peak_learning_rate=1e-2, warmup_steps=0, total_steps=10)
    )
    state, _, shardings = create_train_state(
        model,
        tx,
        jax.random.PRNGKey(0),
        (jnp.zeros((1, 8), jnp.int32),) * 3 + (jnp.zeros((1, 2), jnp.int32),),
        mesh,
    )
    step = steps.jit_train_step(steps.make_train_step(model, tx, 1, objective), shardings, mesh)

    def run_on(batch):
        with sharding.activate(mesh):
            new_state, metrics = step(
                jax.tree.map(jnp.copy, state), sharding.global_batch_from_host(batch, mesh)
            )
        return jax.device_get(new_state.params), jax.device_get(metrics)

    return run_on


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_no_nsp_has_no_nsp_loss():
    """NSP labels change the loss and the update with NSP on, nothing with NSP off."""
    batch = _batch()
    flipped = dict(batch, next_sentence_labels=1 - batch["next_sentence_labels"])
    for nsp in (True, False):
        step = _train_step(objectives.PretrainingObjective("mlm", nsp))
        (params, metrics), (flipped_params, flipped_metrics) = step(batch), step(flipped)
        bias, flipped_bias = (
            p["seq_relationship"]["output_bias"] for p in (params, flipped_params)
        )
        if nsp:
            assert metrics["nsp_count"] == BATCH and metrics["nsp_loss_sum"] > 0
            assert metrics["nsp_loss_sum"] != flipped_metrics["nsp_loss_sum"]
            assert not np.allclose(bias, flipped_bias)
            assert "nsp_accuracy" in objectives.summarize(metrics)
        else:
            assert metrics["nsp_count"] == 0 and metrics["nsp_loss_sum"] == 0
            means = objectives.summarize(metrics)  # what the progress line and eval print
            assert "nsp_accuracy" not in means and means["loss"] == means["mlm_loss"]
            jax.tree.map(np.testing.assert_array_equal, params, flipped_params)
            # The unused NSP head gets no gradient; its bias (not decayed) stays at 0.
            np.testing.assert_array_equal(bias, 0.0)


def test_next_token_batch_restores_masks_and_shifts():
    batch = _batch()
    original = batch["input_ids"].copy()
    batch["input_ids"][:, 2], batch["input_ids"][:, 5] = 4, 4  # [MASK] shown at 2 and 5
    batch["masked_lm_ids"][:, :2] = original[:, [2, 5]]
    lm = jax.device_get(objectives.next_token_batch(jax.tree.map(jnp.asarray, batch)))
    np.testing.assert_array_equal(lm["input_ids"], original)
    np.testing.assert_array_equal(lm["masked_lm_ids"], original[:, 1:])
    np.testing.assert_array_equal(lm["masked_lm_positions"][1], np.arange(LENGTH - 1))
    np.testing.assert_array_equal(lm["masked_lm_weights"], batch["input_mask"][:, 1:])


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_left_to_right_logits_ignore_later_tokens():
    model = BertForPreTraining(MODEL)
    params = model.init(
        jax.random.PRNGKey(0), *(jnp.zeros((1, 8), jnp.int32),) * 3, jnp.zeros((1, 2), jnp.int32)
    )["params"]
    lm = objectives.next_token_batch(jax.tree.map(jnp.asarray, _batch()))
    later = dict(lm, input_ids=lm["input_ids"].at[:, 7:].set(11))
    forward = jax.jit(
        lambda batch, causal: steps.forward(model, params, batch, True, causal=causal)[0],
        static_argnums=1,
    )
    for causal in (True, False):  # bidirectional attention (MLM) as the control
        logits, changed = (forward(b, causal) for b in (lm, later))
        assert np.allclose(logits[:, :7], changed[:, :7], atol=1e-6) == causal
        assert not np.allclose(logits[1:, 7:], changed[1:, 7:])


def test_left_to_right_train_step_predicts_every_next_token():
    step = _train_step(objectives.PretrainingObjective("ltr", True))
    batch = _batch()
    _, metrics = step(batch)
    assert metrics["mlm_weight_sum"] == batch["input_mask"][:, 1:].sum()
    assert metrics["nsp_count"] == 0 and np.isfinite(metrics["mlm_loss_sum"])


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_left_to_right_fine_tuning_keeps_the_left_only_constraint():
    """causal_attention (Table 5's LTR row): a tag at i ignores later tokens; a sentence
    label reads the last real token, so it sees the whole sentence but not the padding."""
    batch = _batch()
    inputs = [jnp.asarray(batch[k]) for k in ("input_ids", "segment_ids", "input_mask")]
    later = [inputs[0].at[:, 7:].set(11), *inputs[1:]]
    padding = [jnp.where(inputs[2] == 1, inputs[0], 13), *inputs[1:]]
    for causal in (True, False):  # bidirectional fine-tuning as the control
        tagger = BertForTokenClassification(MODEL, 3, causal=causal)
        params = tagger.init(jax.random.PRNGKey(0), *inputs)["params"]
        tags, tags_later = (tagger.apply({"params": params}, *x) for x in (inputs, later))
        assert np.allclose(tags[:, :7], tags_later[:, :7], atol=1e-6) == causal
        classifier = BertForSequenceClassification(MODEL, 2, causal=causal)
        params = classifier.init(jax.random.PRNGKey(0), *inputs)["params"]
        labels, labels_later, labels_padding = (
            classifier.apply({"params": params}, *x) for x in (inputs, later, padding)
        )
        assert not np.allclose(labels, labels_later)  # the last token sees the changed ones
        np.testing.assert_allclose(labels, labels_padding, atol=1e-6)
    with pytest.raises(ValueError, match="causal_attention=True: SQuAD"):
        squad_predict.SquadFinetune(features.TaskOptions(causal_attention=True), None)


def test_unknown_objective_is_a_config_error():
    config = base_config()
    config.train.objective = "gpt"
    with pytest.raises(
        errors.ConfigError, match=r"train\.objective='gpt' is not one of 'mlm', 'ltr'"
    ):
        validate.pretraining(config)


def test_the_ablation_study_without_its_data_says_what_to_set(tmp_path):
    """Without $DATA (no ./data here) the study stops in one line naming DATA, before any
    training run, not with a CalledProcessError's traceback after one."""
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "ablation_study.py"), f"--out={tmp_path / 's'}"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "DATA": str(tmp_path / "data")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"error: {tmp_path}/data/glue is missing or empty: set DATA to the directory that holds "
        f"gutenberg/, glue/ and conll2003/ (now DATA={tmp_path}/data; "
        "docs/probing-and-ablations.md)"
    ]
    assert not (tmp_path / "s").exists()
