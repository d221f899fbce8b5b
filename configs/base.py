"""BERT-base pretraining, the paper's recipe (Devlin et al., 2018, section A.2).

    python -m bertjax.train --config=configs/base.py --workdir=gs://BUCKET/bert_base \
        --config.data.source=tfds --config.data.tfds_name=wikipedia/20230601.en \
        --config.data.tokenizer=wordpiece --config.data.vocab_file=vocab.txt

12 layers, hidden 768, 12 heads; 1M steps of 256 sequences, peak lr 1e-4, 10k warmup steps,
linear decay to 0; 90% of the steps at length 128 (20 predictions), the last 10% at 512 (80).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:  # noqa: PLR0915 (one statement per setting)
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 30522  # tokens; must be at least the tokenizer's vocabulary size
    c.model.hidden_size = 768  # units per token
    c.model.num_hidden_layers = 12  # transformer layers
    c.model.num_attention_heads = 12  # heads per layer
    c.model.intermediate_size = 3072  # FFN units (4 x hidden)
    # "gelu": exact erf (released checkpoints); "gelu_tanh" (modeling.py since Feb 2019); "relu"
    c.model.hidden_act = "gelu"
    c.model.hidden_dropout_prob = 0.1  # probability
    c.model.attention_probs_dropout_prob = 0.1  # probability
    c.model.max_position_embeddings = 512  # positions
    c.model.type_vocab_size = 2  # segment ids
    c.model.initializer_range = 0.02  # stddev of the truncated normal init
    c.model.layer_norm_eps = 1e-12  # LayerNorm epsilon (the original's, not flax's 1e-6)
    c.model.dtype = "bfloat16"  # compute dtype; use "float32" on CPU
    c.model.param_dtype = "float32"  # parameter and optimizer-state dtype
    c.model.scan_layers = False  # nn.scan over layers (faster compile; stacked params)
    c.model.remat_policy = "none"  # "none" | "full" | "dots" | "dots_no_batch"
    # "einsum": the reference, attention dropout from the JAX RNG (bit-exact on resume);
    # "cudnn": cuDNN flash attention, attention dropout from cuDNN's own generator;
    # "xla": jax.nn.dot_product_attention, needs attention_probs_dropout_prob=0 to train;
    # "pallas": the Pallas kernels (TPU: Mosaic, GPU: Triton), attention dropout from a hash
    # of the JAX RNG (bit-exact on resume; docs/deviations.md section 7).
    c.model.attention_impl = "auto"  # "auto": the fused kernel that fits the platform and dropout
    c.model.vocab_pad_multiple = 1  # MLM projection on the vocab padded to this multiple; 1 = off

    c.data = ml_collections.ConfigDict()
    c.data.source = "text"  # "default" (embedded stdlib corpus) | "text" | "tfds"
    c.data.input_files = ""  # comma-separated paths or globs (source=text)
    c.data.text_format = "auto"  # "lines" (original: sentence per line) | "paragraphs" | "auto"
    c.data.tfds_name = ""  # e.g. "wikipedia/20230601.en" (source=tfds, array_record format)
    c.data.tfds_split = "train"  # tfds split name
    c.data.tfds_data_dir = ""  # tfds data_dir; empty = tfds default
    c.data.tfds_text_key = "text"  # feature holding the text
    c.data.tokenizer = "wordpiece"  # "wordpiece" (Google vocab.txt) | "sentencepiece" | "bpe"
    c.data.vocab_file = ""  # vocab.txt, .model or tokenizer.json (bpe); empty: train SentencePiece
    c.data.sentencepiece_vocab_size = 30522  # tokens, when training a SentencePiece model
    c.data.do_lower_case = True  # lower-case input (uncased models)
    c.data.strip_accents = "auto"  # "auto" (= do_lower_case, the original) | "true" | "false"
    c.data.max_seq_length = 128  # tokens per sequence in the first phase
    c.data.max_predictions_per_seq = 20  # masked positions per sequence in the first phase
    c.data.masked_lm_prob = 0.15  # fraction of tokens masked (chosen for prediction)
    # Of the chosen tokens: the fraction replaced by [MASK] and by a random token; the rest
    # (1 - both) keep the original. Paper: 0.8 / 0.1 (/ 0.1 kept); Table 8 ablates the mix.
    c.data.mask_token_prob = 0.8  # probability
    c.data.random_token_prob = 0.1  # probability; mask_token_prob + this must be <= 1
    c.data.short_seq_prob = 0.1  # probability of a shorter target length
    c.data.dupe_factor = 10  # copies of the corpus with different masks (static masking)
    c.data.masking = "static"  # "static" (original: masked once when prepared) | "dynamic"
    c.data.whole_word_mask = False  # mask all pieces of a word together
    # Deviation, off = the original (every instance padded to its own row): pack whole
    # instances into rows of max_seq_length, each with its own positions (from 0), segment
    # ids, [CLS] and NSP prediction; attention is block-diagonal, so an instance computes
    # exactly what it does alone, and the loss is the same mean over real predictions.
    c.data.packing = False
    c.data.packing_max_instances = 4  # instances per packed row at most (NSP slots per row)
    c.data.eval_fraction = 0.01  # fraction of documents held out for evaluation
    c.data.shard_bytes = 16 << 20  # bytes of text prepared at a time by one worker (memory
    # bound); documents never span shards, NSP partners come from the same shard, as the
    # original's come from the same input file (docs/data-preparation.md)
    c.data.num_workers = 0  # processes preparing shards; 0 = one per CPU core
    c.data.prepared_dir = ""  # read data made by `python -m bertjax.prepare --output=DIR`
    # prepared data (local disk); empty = WORKDIR/data (gs://: /tmp/bertjax_data)
    c.data.cache_dir = ""
    c.data.seed = 12345  # data seed (instances, masks, order); the original's default

    c.long_phase = ml_collections.ConfigDict()
    c.long_phase.fraction = 0.1  # fraction of total_steps at the long length; 0 disables
    c.long_phase.max_seq_length = 512  # tokens per sequence
    c.long_phase.max_predictions_per_seq = 80  # masked positions per sequence
    c.long_phase.global_batch_size = 0  # sequences per step; 0 = train.global_batch_size
    # Deviation, off = one optimizer and schedule over both phases (the paper's wording). The
    # original code ran the long phase as a second run_pretraining from the first's weights:
    # True starts it like that (fresh Adam moments, a new warmup and linear decay over the long
    # phase, the short phase's decay ending at the switch); docs/deviations.md.
    c.long_phase.restart_optimizer = False
    c.long_phase.restart_warmup_steps = -1  # warmup after the restart; -1 = optimizer.warmup_steps
    c.long_phase.restart_peak_learning_rate = 0.0  # peak after it; 0 = optimizer.peak_learning_rate

    c.train = ml_collections.ConfigDict()
    c.train.global_batch_size = 256  # sequences per optimizer step, summed over all hosts
    # Micro-batches per step (the global batch stays the same); 0 = auto: per phase, the
    # fewest that fit the devices' memory (bertjax.training.autofit; 1 on CPU).
    c.train.grad_accum_steps = 0
    c.train.total_steps = 1_000_000  # optimizer steps, both phases
    c.train.log_every = 100  # steps between progress lines / TensorBoard scalars
    c.train.eval_every = 10_000  # steps between evaluations; 0 = only at the end
    c.train.eval_batches = 50  # batches per evaluation
    c.train.checkpoint_every = 10_000  # steps between checkpoints (one is also saved at the end)
    c.train.keep_checkpoints = 3  # latest checkpoints kept
    c.train.keep_every = 100_000  # also keep every checkpoint at a multiple of this; 0 = none
    c.train.init_checkpoint = ""  # params to start from: Google TF, Hugging Face or bertjax dir
    c.train.stop_after_steps = 0  # stop this run after N steps (time-limited jobs); 0 = no limit
    c.train.max_nonfinite_steps = 10  # consecutive non-finite steps before the run stops
    # Trace N steps with jax.profiler (those after this run's first, compiled, step) into
    # WORKDIR/profile, for TensorBoard's profile plugin or Perfetto; 0 = no trace.
    c.train.profile_steps = 0
    # Resume in the middle of a phase with changed data settings or corpus (refused by
    # default: the batches would differ from an uninterrupted run's); True accepts the change.
    c.train.allow_changed_data = False
    # Rerun a workdir with another schedule (a larger total_steps, another peak learning rate,
    # warmup or restart setting: run_schedule.SCHEDULE_FIELDS; refused by default). True
    # continues the run past the end of its recorded schedule: its steps keep their phases and
    # learning rates; the added steps train in its last phase at the learning rate this
    # config's schedule gives them (docs/pretraining.md, "Extending a run").
    c.train.extend = False
    c.train.seed = 42  # parameter init and dropout seed
    # Ablations (paper Table 5). False: no NSP loss, and instances whose B always really
    # follows A (a one-sentence chunk becomes [CLS] A [SEP]); the NSP head stays in the params.
    c.train.next_sentence_prediction = True
    # "mlm" (masked LM) | "ltr": left-to-right LM, causal attention, next-token loss over every
    # real token, no NSP (instances as next_sentence_prediction=False), einsum attention only.
    c.train.objective = "mlm"

    c.optimizer = ml_collections.ConfigDict()
    # "bert_adam" (original) | "adamw" (bias-corrected) | "lamb" | "stable_adamw" (AdamW with
    # per-tensor update clipping: Wortsman et al. 2023; ModernBERT's)
    c.optimizer.name = "bert_adam"
    c.optimizer.peak_learning_rate = 1e-4  # learning rate after warmup
    c.optimizer.warmup_steps = 10_000  # steps of linear warmup
    # "linear" (the paper's: decays from the peak to 0 at the last step) | "wsd"
    # (warmup-stable-decay: the peak until the last decay_fraction of the steps; ModernBERT's)
    c.optimizer.schedule = "linear"
    c.optimizer.decay_fraction = 0.1  # "wsd": the last fraction of the steps, decaying to 0
    c.optimizer.decay_shape = "1-sqrt"  # "wsd": "linear" | "1-sqrt" (Hägele et al. 2024)
    c.optimizer.weight_decay_rate = 0.01  # decoupled decay (x lr); not on LayerNorm or biases
    c.optimizer.b1 = 0.9  # Adam beta1
    c.optimizer.b2 = 0.999  # Adam beta2
    c.optimizer.eps = 1e-6  # Adam epsilon
    c.optimizer.clip_global_norm = 1.0  # gradient global-norm clip; 0 disables

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # data-parallel replicas; -1 = all remaining devices
    c.mesh.fsdp = 1  # parameter/optimizer-sharded data parallelism
    c.mesh.tensor = 1  # tensor parallelism over heads and FFN
    return c
