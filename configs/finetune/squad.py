"""SQuAD v1.1 / v2.0 with run_squad.py's flag defaults (length 384, stride 128, query 64,
batch 32, lr 5e-5, 3 epochs; n-best 20, max answer length 30) and its step count,
int(questions / batch * epochs): questions, not their document windows. (Google's README
fine-tunes BERT-Base on v1.1 with batch 12, lr 3e-5, 2 epochs: --config.train_batch_size=12
--config.learning_rate=3e-5 --config.num_train_epochs=2.)

    python -m bertjax.finetune --config=configs/finetune/squad.py \
        --config.init_checkpoint=PRETRAIN_WORKDIR --config.train_file=train-v1.1.json \
        --config.predict_file=dev-v1.1.json --workdir=DIR

Files are the official JSON, or `tfds:squad/v1.1:train`-style names. v2.0: set
`--config.version_2_with_negative=True`; the best null-score threshold is searched on dev.
"""

import pathlib
import runpy

from bertjax.runtime import schema
from bertjax.training.finetune_schema import SquadFields

common = runpy.run_path(str(pathlib.Path(__file__).with_name("common.py")))["get_config"]


def get_config():
    c = common()
    c.kind = "squad"
    c.task = "squad"
    c.max_seq_length = 384  # tokens per window
    c.update(schema.defaults(SquadFields))  # (run_squad's defaults; the schema's docs)
    return c
