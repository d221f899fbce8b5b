"""Fields shared by every fine-tuning config (glue.py, ner.py, squad.py load this by path).

Defaults are the original run_classifier / run_squad ones: batch 32, lr 5e-5, 3 epochs, 10%
linear warmup then linear decay, BERT's AdamWeightDecay, dropout 0.1.
"""

import pathlib
import runpy

import ml_collections

# Loaded by path so the config works from any working directory.
base_config = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "base.py"))["get_config"]


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.kind = ""  # "glue" | "ner" | "squad" (set by each task config)
    c.task = ""  # task name (GLUE: cola sst2 mrpc stsb qqp mnli qnli rte wnli)
    c.data_dir = ""  # task data on disk (GLUE download layout / CoNLL files); empty = tfds
    c.tfds_data_dir = ""  # tfds data_dir; empty = tfds default
    c.init_checkpoint = ""  # bertjax pretraining workdir, Google TF or Hugging Face directory
    c.random_init = False  # use init_checkpoint's architecture and tokenizer, not its weights
    c.model_config = ""  # bert_config.json: architecture without (or overriding) a checkpoint
    c.vocab_file = ""  # vocab.txt / .model / BPE tokenizer.json; empty = the pretraining run's
    c.tokenizer = ""  # "wordpiece" | "sentencepiece" | "bpe" for vocab_file; empty = by file name
    c.do_lower_case = True  # for vocab_file (WordPiece) and SQuAD answer mapping
    c.max_seq_length = 128  # tokens per sequence
    c.train_batch_size = 32  # sequences per optimizer step (all hosts)
    c.eval_batch_size = 32  # sequences per prediction step (all hosts)
    c.num_train_epochs = 3.0  # passes over the training set (fractions allowed)
    c.learning_rate = 5e-5  # peak learning rate
    c.warmup_proportion = 0.1  # fraction of steps of linear warmup, then linear decay to 0
    c.hidden_dropout_prob = 0.1  # dropout in the encoder and on the classifier input
    c.attention_probs_dropout_prob = 0.1  # dropout on attention probabilities
    # A ModernBERT init_checkpoint keeps its own dropout rates (its config's, as transformers
    # fine-tunes it); the two above are BERT's. Sentence tasks pool its output with
    # classifier_pooling: "cls" (the [CLS] vector) or "mean" (the mean over the real tokens);
    # empty = the checkpoint's (config.json's classifier_pooling, else "cls").
    c.classifier_pooling = ""
    # Left-to-right attention, for a model pretrained with train.objective=ltr: the paper's
    # "LTR & No NSP" row keeps the left-only constraint at fine-tuning (section 5.1).
    # Sentence tasks then pool the last real token ([SEP]); not for SQuAD.
    c.causal_attention = False
    c.dtype = "float32"  # compute dtype; "bfloat16" on TPU/GPU
    c.seeds = "1"  # comma-separated seeds: one full run each, summarised (mean/std/median)
    c.max_train_examples = 0  # random subset of the training set (0 = all); for quick studies
    c.log_every = 50  # steps between training-loss lines
    # Trace N steps of each seed with jax.profiler (those after its first, compiled, step) into
    # WORKDIR/seed_S/profile, for TensorBoard's profile plugin or Perfetto; 0 = no trace.
    c.profile_steps = 0

    pretraining = base_config()  # the same optimizer and mesh fields as pretraining
    c.optimizer = pretraining.optimizer
    for field in ("peak_learning_rate", "warmup_steps"):  # from learning_rate/warmup_proportion
        del c.optimizer[field]
    c.mesh = pretraining.mesh
    return c
