"""ModernBERT parity with Hugging Face transformers (PyTorch, CPU, float32) on the same random
weights: a `ModernBertForMaskedLM` saved by transformers reads into bertjax
(bertjax.families.modernbert_hf) with MLM logits within 1e-5, and bertjax's export of it loads
back through `AutoModelForMaskedLM` with the same logits and no missing or unexpected weights.

Needs the `parity` extra; deselected by default, run with `python -m pytest -q -m parity tests`.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import convert
from bertjax.families import modernbert_hf
from bertjax.interop import pretrained_weights, tree
from bertjax.models.modernbert import model as modernbert

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_parity import randomized  # noqa: E402 (after the skips)

pytestmark = pytest.mark.parity
TOLERANCE = 1e-5
LENGTH = 16
# (layers, hidden, heads, intermediate, vocab, local_attention, global every n, switches)
CONFIGS = {
    "odd-layers-window-smaller": (3, 32, 2, 40, 97, 4, 3, {}),
    "window-larger-all-biases": (
        5,
        48,
        4,
        64,
        130,
        64,
        2,
        dict(
            attention_bias=True,
            mlp_bias=True,
            norm_bias=True,
            classifier_bias=True,
            decoder_bias=False,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    "odd-window-own-thetas": (
        4,
        32,
        4,
        24,
        61,
        7,
        4,
        dict(
            norm_bias=True,
            classifier_activation="gelu_new",
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
        ),
    ),
    "one-layer": (1, 16, 1, 16, 50, 4, 3, dict(mlp_bias=True)),
}


def random_hf_model(name):
    """A ModernBertForMaskedLM with every weight random (norms and biases too, which
    transformers initialises to constants, so a swapped or dropped one would show)."""
    layers, hidden, heads, intermediate, vocab, window, every, switches = CONFIGS[name]
    torch.manual_seed(layers * 100 + hidden)
    config = transformers.ModernBertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        local_attention=window,
        global_attn_every_n_layers=every,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        **switches,
    )
    return randomized(transformers.ModernBertForMaskedLM(config).eval(), "norm", 0.1)


def padded_batch(vocab):
    """Three rows: full, and padded after 11 and 5 tokens."""
    rng = np.random.default_rng(vocab)
    ids = rng.integers(3, vocab, (3, LENGTH))
    mask = np.ones((3, LENGTH), np.int64)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    return np.where(mask > 0, ids, 0), mask


def hf_logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


def bertjax_logits(config, params, ids, mask):
    return np.asarray(
        modernbert.ModernBertForMaskedLM(config).apply(
            {"params": params}, jnp.asarray(ids), jnp.asarray(mask)
        )
    )


def assert_close_at_real_tokens(ours, theirs, mask):
    real = mask.astype(bool)
    assert not np.isnan(theirs[real]).any()
    np.testing.assert_allclose(ours[real], theirs[real], rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("name", CONFIGS)
def test_mlm_logits_equal_transformers(name, tmp_path):
    model = random_hf_model(name)
    model.save_pretrained(tmp_path)
    report = tree.LoadReport()
    config, params = modernbert_hf.load_hf(str(tmp_path), report)
    assert config.num_hidden_layers == CONFIGS[name][0] and report.mapped == len(
        tree.flatten(params)
    )
    ids, mask = padded_batch(config.vocab_size)
    assert_close_at_real_tokens(
        bertjax_logits(config, params, ids, mask), hf_logits(model, ids, mask), mask
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_export_loads_in_transformers_with_the_same_logits(name, tmp_path):
    model = random_hf_model(name)
    model.save_pretrained(tmp_path / "hf")
    config, params = modernbert_hf.load_hf(str(tmp_path / "hf"))
    modernbert_hf.save_hf(config, params, str(tmp_path / "export"))
    loaded, info = transformers.AutoModelForMaskedLM.from_pretrained(
        tmp_path / "export", output_loading_info=True
    )
    assert type(loaded).__name__ == "ModernBertForMaskedLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, mask = padded_batch(config.vocab_size)
    assert_close_at_real_tokens(
        hf_logits(loaded.eval(), ids, mask), hf_logits(model, ids, mask), mask
    )
    again, params_again = modernbert_hf.load_hf(str(tmp_path / "export"))
    assert again == config
    for path, value in tree.flatten(params).items():
        np.testing.assert_array_equal(tree.flatten(params_again)[path], value, err_msg=path)


def test_an_encoder_without_its_head_gives_its_encoder_and_pretraining_refuses_it(tmp_path):
    """transformers' ModernBertModel (no MLM head): its encoder is read (what fine-tuning
    takes; test_modernbert_finetune_parity compares its hidden states), and pretraining from
    it, which needs the MLM head, is refused in one line."""
    model = random_hf_model("one-layer")
    model.model.save_pretrained(tmp_path)  # ModernBertModel: no MLM head
    config, params = modernbert_hf.load_hf(str(tmp_path))
    assert set(params) == {"model"}
    abstract = pretrained_weights.abstract_params_on_one_device(
        modernbert.ModernBertForMaskedLM(config)
    )
    with pytest.raises(tree.ConversionError, match="has no decoder, head parameters") as error:
        pretrained_weights.load_pretrained(str(tmp_path), abstract, config)
    assert "\n" not in str(error.value)


def test_a_converted_bertjax_checkpoint_gives_transformers_the_same_logits(tmp_path):
    """`python -m bertjax.convert` of a bertjax ModernBERT checkpoint: transformers' logits
    equal bertjax's on the same weights."""
    from test_modernbert import TINY
    from test_modernbert_train import modernbert_checkpoint

    params = modernbert_checkpoint(tmp_path / "run")
    assert convert.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    ids, mask = padded_batch(TINY.vocab_size)
    assert_close_at_real_tokens(
        bertjax_logits(TINY, params, ids, mask), hf_logits(model, ids, mask), mask
    )
