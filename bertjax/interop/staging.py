"""Google TF and Hugging Face checkpoints on an object store (`gs://`, any fsspec URL) on
local disk: their readers (safetensors, torch, the TF bundle reader) need local files, so the
files a checkpoint is read from, with its config and tokenizer, are copied through
`bertjax.runtime.files` once per process. bertjax's own checkpoints are read in place (Orbax)."""

from __future__ import annotations

import os

from bertjax.interop import hf, hf_tokenizer, native, tf_bundle
from bertjax.models import families
from bertjax.runtime import files

TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    *hf_tokenizer.SENTENCEPIECE_FILES,
    native.TOKENIZER_FILE,
)


def local_checkpoint(path: str, source_format: str) -> str:
    """`path` if local or a bertjax checkpoint, else the local copy of what the reader of a TF
    checkpoint (`source_format` 'tf': its prefix) or a HF directory ('hf') needs."""
    if not files.is_remote(path) or source_format == "bertjax":
        return path
    if source_format == "hf":
        names = set(files.listdir(path))
        return files.local_copy(
            path, ["config.json", *hf.weight_files(path), *names.intersection(TOKENIZER_FILES)]
        )
    prefix = tf_bundle.resolve_prefix(path)
    directory, stem = prefix.rsplit("/", 1)
    names = set(files.listdir(directory))
    bundle = [n for n in names if n == f"{stem}.index" or n.startswith(f"{stem}.data-")]
    config_file = families.tf_form().config_file  # ("bert_config.json")
    needed = [*bundle, *names.intersection({config_file, *TOKENIZER_FILES})]
    return os.path.join(files.local_copy(directory, needed), stem)
