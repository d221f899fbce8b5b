"""Writes tests/data/tf_tiny_bert/: a tiny Google-BERT-layout checkpoint saved by TensorFlow's
own tf.compat.v1 Saver (as Google's were), with bert_config.json, and values.json holding every
variable's values as written. Run once with TensorFlow installed (`pip install -e '.[tf]'`):

    python tests/data/make_tf_fixture.py

tests/test_interop_tf.py reads the result with bertjax's reader (no TensorFlow needed)."""

import json
import os

import numpy as np
import tensorflow as tf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_tiny_bert")
CONFIG = {
    "vocab_size": 12,
    "hidden_size": 4,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 8,
    "max_position_embeddings": 8,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "initializer_range": 0.02,
}


def variables() -> dict[str, np.ndarray]:
    """Google's names and shapes for CONFIG, seeded random float32 values."""
    rng = np.random.default_rng(2018)
    h, f, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    shapes = {
        "bert/embeddings/word_embeddings": (v, h),
        "bert/embeddings/position_embeddings": (CONFIG["max_position_embeddings"], h),
        "bert/embeddings/token_type_embeddings": (CONFIG["type_vocab_size"], h),
        "bert/embeddings/LayerNorm/gamma": (h,),
        "bert/embeddings/LayerNorm/beta": (h,),
    }
    layer = "bert/encoder/layer_0/"
    for name in ("query", "key", "value"):
        shapes.update(
            {
                f"{layer}attention/self/{name}/kernel": (h, h),
                f"{layer}attention/self/{name}/bias": (h,),
            }
        )
    shapes.update(
        {
            f"{layer}attention/output/dense/kernel": (h, h),
            f"{layer}attention/output/dense/bias": (h,),
            f"{layer}attention/output/LayerNorm/gamma": (h,),
            f"{layer}attention/output/LayerNorm/beta": (h,),
            f"{layer}intermediate/dense/kernel": (h, f),
            f"{layer}intermediate/dense/bias": (f,),
            f"{layer}output/dense/kernel": (f, h),
            f"{layer}output/dense/bias": (h,),
            f"{layer}output/LayerNorm/gamma": (h,),
            f"{layer}output/LayerNorm/beta": (h,),
            "bert/pooler/dense/kernel": (h, h),
            "bert/pooler/dense/bias": (h,),
            "cls/predictions/transform/dense/kernel": (h, h),
            "cls/predictions/transform/dense/bias": (h,),
            "cls/predictions/transform/LayerNorm/gamma": (h,),
            "cls/predictions/transform/LayerNorm/beta": (h,),
            "cls/predictions/output_bias": (v,),
            "cls/seq_relationship/output_weights": (2, h),
            "cls/seq_relationship/output_bias": (2,),
        }
    )
    values = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    # The optimizer slots of one variable, as in Google's checkpoints (the reader skips them).
    values["bert/pooler/dense/bias/adam_m"] = rng.normal(size=(h,)).astype(np.float32)
    values["bert/pooler/dense/bias/adam_v"] = rng.random(size=(h,)).astype(np.float32)
    return values


def main() -> None:
    values = variables()
    os.makedirs(OUT, exist_ok=True)
    with tf.Graph().as_default():
        for name, value in values.items():
            tf.compat.v1.get_variable(name, initializer=tf.constant(value))
        tf.compat.v1.train.get_or_create_global_step()
        assign = tf.compat.v1.assign(tf.compat.v1.train.get_global_step(), 7)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(assign)
            saver.save(
                session,
                os.path.join(OUT, "bert_model.ckpt"),
                write_meta_graph=False,
                write_state=False,
            )  # (no `checkpoint` file, as in Google's downloads)
    with open(os.path.join(OUT, "bert_config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    with open(os.path.join(OUT, "values.json"), "w") as f:
        json.dump(
            {
                "tensorflow": tf.__version__,
                "global_step": 7,
                "variables": {name: value.tolist() for name, value in values.items()},
            },
            f,
        )
    print(f"wrote {OUT}: {sorted(os.listdir(OUT))}")


if __name__ == "__main__":
    main()
