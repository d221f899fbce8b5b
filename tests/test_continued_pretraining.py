"""Issue 52: continued pretraining from what a user has, and one tokenizer rule for every
entry point. A run from a checkpoint takes the tokenizer beside it unless another is named;
a named one must have the checkpoint's ids (the recorded fingerprint of a bertjax run, the
same token at each id as the tokenizer beside a Google or Hugging Face checkpoint, no more
ids than the embedding rows), on train, finetune, extract_features and probe alike, before
any data work. A bare encoder (a Hub BertModel, a fine-tuned export) pretrains further with
fresh heads; an architecture override is checked against the checkpoint, not the config."""

import dataclasses
import os
import runpy

import numpy as np
import pytest

from bertjax import train
from bertjax.interop import hf, pretrained
from bertjax.models.bert.model import BertConfig
from test_convert import random_params
from test_shipped_tokenizers import TEXTS, sentence_transformers_dir, text_words
from test_train import REPO_ROOT, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixture)

TINY_PY = runpy.run_path(os.path.join(REPO_ROOT, "configs", "tiny.py"))["get_config"]


@pytest.fixture(scope="module")
def bare_encoder(tmp_path_factory, corpus_file) -> str:  # noqa: F811 (fixture)
    """A sentence-transformers directory as shipped (a BertModel: no pretraining heads, a
    tokenizer.json and no vocab.txt) whose WordPiece knows the corpus's words."""
    with open(corpus_file, encoding="utf-8") as f:
        words = text_words(TEXTS + f.read().split("\n")[:400])
    return sentence_transformers_dir(tmp_path_factory.mktemp("hub") / "all-MiniLM-like", words)


def test_a_bare_encoder_continues_pretraining_with_fresh_heads(
    bare_encoder, corpus_file, tmp_path, capsys  # noqa: F811 (fixture)
):
    """A Hub BertModel (no heads, no vocab.txt) as init_checkpoint of configs/base.py's
    shape: no tokenizer flag (the tokenizer.json beside it is taken), the encoder's weights
    loaded, the MLM and NSP heads fresh and said so in one line."""
    config = tiny_config(
        corpus_file,
        str(tmp_path / "cache"),
        **{
            "train.total_steps": 2,
            "train.checkpoint_every": 2,
            "long_phase.fraction": 0.0,
            "optimizer.peak_learning_rate": 0.0,
            "optimizer.warmup_steps": 0,
            "train.eval_batches": 1,
            "train.init_checkpoint": bare_encoder,
            "data.tokenizer": "wordpiece",
        },
    )
    train.train_and_evaluate(config, str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "has no predictions, seq_relationship parameters (a bare encoder" in out, out
    encoder = hf.load_hf(bare_encoder)[1]["bert"]
    params = pretrained.read(str(tmp_path / "run"))[1]
    np.testing.assert_array_equal(  # learning rate 0: the encoder as loaded
        params["bert"]["embeddings"]["word_embeddings"],
        encoder["embeddings"]["word_embeddings"],
    )
    assert not np.any(params["predictions"]["output_bias"])  # zeros, as the original's
    kernel = params["predictions"]["transform"]["dense"]["kernel"]
    assert 0.01 < kernel.std() < 0.03  # initializer_range 0.02
    assert read_metrics(tmp_path / "run")
