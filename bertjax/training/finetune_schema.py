"""The schema of a fine-tuning config's own fields (configs/finetune/common.py builds them from
it) and of the fields some tasks add (SQuAD's, NER's): each field's default (the original
run_classifier / run_squad ones), unit, range and doc in one place (bertjax.runtime.schema).
`FinetuneSettings`, `pretrained.Source` and `tasks.features.TaskOptions` read the values."""

from __future__ import annotations

import dataclasses

from bertjax.runtime.schema import (
    AT_LEAST_0,
    AT_LEAST_1,
    BELOW_1,
    POSITIVE,
    PROBABILITY,
    SEQ_LENGTH,
    setting,
)


@dataclasses.dataclass(frozen=True)
class FinetuneFields:
    """The fields every fine-tuning config has (but its optimizer and mesh sections)."""

    kind: str = setting("", "`glue`, `ner` or `squad` (set by each task config)")
    task: str = setting("", "the task's name (GLUE: cola sst2 mrpc stsb qqp mnli qnli rte wnli)")
    data_dir: str = setting(
        "", "the task's data on disk (GLUE's download layout, CoNLL files); empty = tfds"
    )
    tfds_data_dir: str = setting("", "tfds data_dir; empty = tfds's default")
    init_checkpoint: str = setting(
        "", "a bertjax pretraining workdir, a Google TF or a Hugging Face directory"
    )
    random_init: bool = setting(
        False, "use init_checkpoint's architecture and tokenizer, not its weights"
    )
    model_config: str = setting(
        "", "bert_config.json: an architecture without (or overriding) a checkpoint's"
    )
    vocab_file: str = setting(
        "", "vocab.txt, a SentencePiece .model or a BPE tokenizer.json; empty = the checkpoint's"
    )
    tokenizer: str = setting(
        "", "`wordpiece`, `sentencepiece` or `bpe` for vocab_file; empty = told by its name"
    )
    do_lower_case: bool = setting(
        True, "lower-case the input (vocab_file's WordPiece, SQuAD's answer mapping)"
    )
    max_seq_length: int = setting(128, "tokens per sequence", "tokens", SEQ_LENGTH)
    train_batch_size: int = setting(
        32, "sequences per optimizer step (all hosts)", "sequences", AT_LEAST_1
    )
    eval_batch_size: int = setting(
        32, "sequences per prediction step (all hosts)", "sequences", AT_LEAST_1
    )
    num_train_epochs: float = setting(
        3.0, "passes over the training set (fractions allowed)", "epochs", POSITIVE
    )
    learning_rate: float = setting(5e-5, "the peak learning rate", "learning rate", AT_LEAST_0)
    warmup_proportion: float = setting(
        0.1,
        "the fraction of the steps of linear warmup, then linear decay to 0",
        "fraction",
        PROBABILITY,
    )
    hidden_dropout_prob: float = setting(
        0.1, "dropout in the encoder and on the classifier's input", "probability", BELOW_1
    )
    attention_probs_dropout_prob: float = setting(
        0.1, "dropout on the attention probabilities", "probability", BELOW_1
    )
    classifier_pooling: str = setting(
        "",
        "a ModernBERT init_checkpoint keeps its own dropout rates (the two above are BERT's), "
        "and sentence tasks pool its output with `cls` (the [CLS] vector) or `mean` (the mean "
        "over the real tokens); empty = the checkpoint's (config.json's, else `cls`)",
    )
    causal_attention: bool = setting(
        False,
        "left-to-right attention, for a model pretrained with train.objective=ltr (the paper's "
        "LTR & No NSP row, section 5.1); sentence tasks then pool the last real token ([SEP]); "
        "not for SQuAD",
    )
    dtype: str = setting("float32", "the compute dtype; `bfloat16` on TPU/GPU")
    seeds: str = setting(
        "1", "comma-separated seeds: one full run each, summarised (mean, std, median)"
    )
    max_train_examples: int = setting(
        0,
        "a random subset of the training set (0 = all); for quick studies",
        "examples",
        AT_LEAST_0,
    )
    log_every: int = setting(50, "steps between training-loss lines", "steps", AT_LEAST_1)
    profile_steps: int = setting(
        0,
        "trace N steps of each seed with jax.profiler (those after its first, compiled, step) "
        "into WORKDIR/seed_S/profile, for TensorBoard's profile plugin or Perfetto; 0 = no "
        "trace (a rerun may change it)",
        "steps",
        AT_LEAST_0,
    )


@dataclasses.dataclass(frozen=True)
class SquadFields:
    """The fields configs/finetune/squad.py adds."""

    train_file: str = setting(
        "tfds:squad/v1.1:train", "the official JSON's path, or tfds:NAME:SPLIT"
    )
    predict_file: str = setting(
        "tfds:squad/v1.1:validation", "the official JSON's path, or tfds:NAME:SPLIT"
    )
    version_2_with_negative: bool = setting(False, "SQuAD 2.0: unanswerable questions")
    doc_stride: int = setting(
        128, "tokens between the starts of a document's windows", "tokens", AT_LEAST_1
    )
    max_query_length: int = setting(64, "question tokens kept", "tokens", AT_LEAST_1)
    n_best_size: int = setting(20, "candidate spans per question", "spans", AT_LEAST_1)
    max_answer_length: int = setting(30, "tokens in an answer", "tokens", AT_LEAST_1)
    null_score_diff_threshold: float = setting(
        0.0, 'v2: predict "" when the null score minus the best is above this', "logit"
    )


@dataclasses.dataclass(frozen=True)
class NerFields:
    """The fields configs/finetune/ner.py adds."""

    feature_based: bool = setting(
        False,
        "the paper's feature-based approach (section 5.3): a frozen encoder, a BiLSTM tagger on "
        "its last four layers",
    )
    lstm_size: int = setting(768, "the BiLSTM's units per direction", "units", AT_LEAST_1)
