"""GLUE fine-tuning (run_classifier defaults: length 128, batch 32, lr 5e-5, 3 epochs).

    python -m bertjax.finetune --config=configs/finetune/glue.py --config.task=mrpc \
        --config.init_checkpoint=PRETRAIN_WORKDIR --config.data_dir=glue_data --workdir=DIR

Tasks: cola sst2 mrpc stsb qqp mnli (also predicts AX) qnli rte wnli. Data: the GLUE
download layout (`data_dir/MRPC/train.tsv`, ...), or tfds `glue/<task>` when data_dir is empty.
"""

import pathlib
import runpy

common = runpy.run_path(str(pathlib.Path(__file__).with_name("common.py")))["get_config"]


def get_config():
    c = common()
    c.kind = "glue"
    c.task = "mrpc"
    return c
