"""Instances of the 7.3 MB corpus by a bertjax checkout, as one hash:
    PYTHONPATH=CHECKOUT python benchmarks/data_prep/compare_checkouts.py CHECKOUT CACHE_DIR VOCAB CORPUS
(CORPUS: the 7.3 MB file that make_corpus.py writes with --copies=1.)
"""

import hashlib
import runpy
import sys

import numpy as np

from bertjax.data import pipeline, tokenization
from bertjax.training.phase_schedule import Phase

if __name__ == "__main__":
    config = runpy.run_path(sys.argv[1] + "/configs/base.py")["get_config"]()
    d = config.data
    d.source, d.input_files, d.text_format = "text", sys.argv[4], "lines"
    d.vocab_file, d.dupe_factor, d.eval_fraction, d.num_workers = sys.argv[3], 5, 0.0, 1
    try:  # (a checkout with typed data settings, or one before them)
        from bertjax.data.settings import DataSettings

        d = DataSettings.of(d)
    except ImportError:
        pass
    tok = tokenization.load_tokenizer("wordpiece", d.vocab_file, True, None)
    splits = pipeline.prepare(d, Phase("short", 128, 20, 256, 0, 10), tok, sys.argv[2])
    f = splits["train"].features
    h = hashlib.sha256()
    for name in sorted(f):
        h.update(np.ascontiguousarray(np.asarray(f[name])).tobytes())
    print(len(splits["train"]), h.hexdigest())
