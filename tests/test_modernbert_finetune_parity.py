"""ModernBERT's fine-tuning heads and Hugging Face input against transformers (PyTorch, CPU,
float32) on the same random weights: `ModernBertForSequenceClassification` (cls and mean
pooling), `...ForTokenClassification` and `...ForQuestionAnswering` give bertjax's logits
within 1e-5; a bertjax sequence classifier exports to a directory transformers loads with the
same logits; a transformers ModernBERT saved with its BPE tokenizer.json, read as
`init_checkpoint`, tokenizes as AutoTokenizer and gives the same MLM logits; a bare
`ModernBertModel` gives its encoder's last hidden state.

Needs the `parity` extra; run with `python -m pytest -q -m parity tests`."""

import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import convert
from bertjax.families import modernbert_hf
from bertjax.interop import finetuned, hf, pretrained, pretrained_weights, tree
from bertjax.models import families
from bertjax.models.modernbert import heads as modernbert_heads, model as modernbert
from test_modernbert_io import bpe_tokenizer
from test_modernbert_parity import (
    TOLERANCE,
    assert_close_at_real_tokens,
    padded_batch,
    random_hf_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_parity import randomized  # noqa: E402 (after the skips)

pytestmark = pytest.mark.parity
HEADS = {  # name: (transformers class, bertjax class, config switches)
    "sequence-cls": (
        "ModernBertForSequenceClassification",
        modernbert_heads.ModernBertForSequenceClassification,
        dict(classifier_pooling="cls", num_labels=3),
    ),
    "sequence-mean": (
        "ModernBertForSequenceClassification",
        modernbert_heads.ModernBertForSequenceClassification,
        dict(classifier_pooling="mean", num_labels=1, classifier_bias=True, norm_bias=True),
    ),
    "token": (
        "ModernBertForTokenClassification",
        modernbert_heads.ModernBertForTokenClassification,
        dict(num_labels=9),
    ),
    "question-answering": (
        "ModernBertForQuestionAnswering",
        modernbert_heads.ModernBertForQuestionAnswering,
        dict(num_labels=2),
    ),
}


def random_hf_head(name):
    class_name, _, switches = HEADS[name]
    torch.manual_seed(len(name))
    config = transformers.ModernBertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=40,
        local_attention=4,
        global_attn_every_n_layers=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        **switches,
    )
    return randomized(getattr(transformers, class_name)(config).eval(), "norm", 0.1)


def bertjax_head(name, directory):
    """The bertjax model of HEADS[name] and its parameters from transformers' `directory`
    (named by `modernbert_hf.path_to_hf`, as the export writes them)."""
    _, cls, switches = HEADS[name]
    config = modernbert_hf.hf_config(
        tree.read_json_config(f"{directory}/config.json", "hf"), directory
    )
    model = cls(config) if name == "question-answering" else cls(config, switches["num_labels"])
    tensors = hf.read_tensors(directory)
    shapes = tree.flatten(families.abstract_params(model))
    params = {}
    for path, shape in shapes.items():
        hf_name, kind = modernbert_hf.path_to_hf(path)
        params[path] = modernbert_hf.from_hf(tensors.pop(hf_name), kind, shape.shape)
    assert not tensors, sorted(tensors)  # every transformers weight has its bertjax place
    return model, tree.unflatten(params)


def logits(model, params, ids, mask):
    out = model.apply({"params": params}, jnp.asarray(ids), jnp.zeros_like(ids), jnp.asarray(mask))
    return np.stack([np.asarray(x) for x in out], -1) if isinstance(out, tuple) else np.asarray(out)


def hf_head_logits(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    if hasattr(out, "start_logits"):
        return np.stack([out.start_logits.numpy(), out.end_logits.numpy()], -1)
    return out.logits.numpy()


@pytest.mark.parametrize("name", HEADS)
def test_head_logits_equal_transformers(name, tmp_path):
    model = random_hf_head(name)
    model.save_pretrained(tmp_path)
    ours_model, params = bertjax_head(name, str(tmp_path))
    ids, mask = padded_batch(97)
    ours, theirs = logits(ours_model, params, ids, mask), hf_head_logits(model, ids, mask)
    if name.startswith("sequence"):
        np.testing.assert_allclose(ours, theirs, rtol=TOLERANCE, atol=TOLERANCE)
    else:
        assert_close_at_real_tokens(ours, theirs, mask)


def test_a_fine_tuned_classifier_exports_to_transformers_with_the_same_logits(tmp_path):
    model = random_hf_head("sequence-mean")
    model.save_pretrained(tmp_path / "hf")
    ours_model, params = bertjax_head("sequence-mean", str(tmp_path / "hf"))
    head = finetuned.hf_head(
        {"kind": "glue", "task": "stsb"}, params, families.get("modernbert").hf
    )
    modernbert_hf.save_hf(ours_model.config, params, str(tmp_path / "export"), head)
    loaded, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "export", output_loading_info=True
    )
    assert type(loaded).__name__ == "ModernBertForSequenceClassification"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.config.classifier_pooling == "mean" and loaded.config.num_labels == 1
    ids, mask = padded_batch(97)
    np.testing.assert_allclose(
        hf_head_logits(loaded.eval(), ids, mask),
        logits(ours_model, params, ids, mask),
        rtol=TOLERANCE,
        atol=TOLERANCE,
    )


def test_a_transformers_modernbert_with_its_bpe_tokenizer_reads_as_init_checkpoint(tmp_path):
    """Saved by transformers beside a BPE tokenizer.json: bertjax's tokenizer gives
    AutoTokenizer's ids, and the weights read through `pretrained_weights.load_pretrained` (the
    init_checkpoint path) give transformers' MLM logits."""
    directory = tmp_path / "hf"
    bpe_tokenizer(str(directory / "tokenizer.json"), vocab_size=300)
    model = random_hf_model("window-larger-all-biases")
    config_values = model.config.to_dict()
    hf_config = transformers.ModernBertConfig(**{**config_values, "vocab_size": 300})
    model = randomized(transformers.ModernBertForMaskedLM(hf_config).eval(), "norm", 0.1)
    model.save_pretrained(directory)
    source = pretrained.Source(init_checkpoint=str(directory))
    run = pretrained.pretraining_run(source)
    config = pretrained.model_config_of(source, run)
    tokenizer = pretrained.tokenizer_of(source, run)
    auto = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    texts = ["the movie was good .", "café naïve – déjà vu", "john went to paris"]
    for text in texts:
        assert [tokenizer.cls_id, *tokenizer.encode(text), tokenizer.sep_id] == auto(text)[
            "input_ids"
        ]
    abstract = pretrained_weights.abstract_params_on_one_device(
        modernbert.ModernBertForMaskedLM(config)
    )
    params = pretrained_weights.load_pretrained(str(directory), abstract, config)
    rows = [[tokenizer.cls_id, *tokenizer.encode(t), tokenizer.sep_id] for t in texts]
    length = max(map(len, rows))
    ids = np.array([r + [tokenizer.pad_id] * (length - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    ours = np.asarray(
        modernbert.ModernBertForMaskedLM(config).apply(
            {"params": params}, jnp.asarray(ids), jnp.asarray(mask)
        )
    )
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    assert_close_at_real_tokens(ours, theirs.numpy(), mask)
    # Converted to bertjax and exported again: AutoTokenizer and AutoModelForMaskedLM load it.
    assert convert.main([str(directory), str(tmp_path / "bertjax")]) == 0
    assert convert.main([str(tmp_path / "bertjax"), str(tmp_path / "export")]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert [exported(t)["input_ids"] for t in texts] == [auto(t)["input_ids"] for t in texts]
    again = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        again_logits = again(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    assert_close_at_real_tokens(again_logits.numpy(), theirs.numpy(), mask)


def test_a_transformers_modernbertmodel_gives_its_encoder(tmp_path):
    """A bare `ModernBertModel` saved by transformers (no prediction head): read as a
    fine-tuning init_checkpoint, its encoder gives transformers' last hidden state."""
    masked_lm = random_hf_model("window-larger-all-biases")
    bare = transformers.ModernBertModel(masked_lm.config).eval()
    bare.load_state_dict(masked_lm.model.state_dict())
    bare.save_pretrained(tmp_path / "bare")
    source = pretrained.Source(init_checkpoint=str(tmp_path / "bare"))
    config = pretrained.model_config_of(source, pretrained.pretraining_run(source))
    model = modernbert_heads.ModernBertForSequenceClassification(config, 2)
    abstract = pretrained_weights.abstract_params_on_one_device(model)
    params = pretrained_weights.load_pretrained(
        str(tmp_path / "bare"),
        {"model": abstract["model"], "head": abstract["head"]},
        config,
        optional=("head",),
    )
    assert set(params) == {"model"}
    ids, mask = padded_batch(config.vocab_size)
    ours = modernbert.ModernBertModel(config).apply(
        {"params": params["model"]}, jnp.asarray(ids), jnp.asarray(mask)
    )
    with torch.no_grad():
        theirs = bare(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)
        ).last_hidden_state.numpy()
    assert_close_at_real_tokens(np.asarray(ours, np.float32), theirs, mask)
