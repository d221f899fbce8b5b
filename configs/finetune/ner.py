"""CoNLL-2003 NER: first sub-token of each word labelled, entity-level F1 (conlleval).

    python -m bertjax.finetune --config=configs/finetune/ner.py \
        --config.init_checkpoint=PRETRAIN_WORKDIR --config.data_dir=conll2003 --workdir=DIR

Data: CoNLL text files (train.txt/valid.txt/test.txt or eng.train/eng.testa/eng.testb) in
data_dir, or tfds `conll2003` when empty. `--config.feature_based=True` is the paper's
feature-based variant: the last four layers concatenated, the encoder frozen, a two-layer
BiLSTM tagger trained.
"""

import pathlib
import runpy

from bertjax.runtime import schema
from bertjax.training.finetune_schema import NerFields

common = runpy.run_path(str(pathlib.Path(__file__).with_name("common.py")))["get_config"]


def get_config():
    c = common()
    c.kind = "ner"
    c.task = "conll2003"
    c.do_lower_case = False  # the paper used cased models for NER; set True for uncased vocabs
    c.update(schema.defaults(NerFields))  # (the paper's; the schema's docs)
    return c
