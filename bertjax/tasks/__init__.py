"""Fine-tuning tasks: GLUE, SQuAD, CoNLL-2003 NER; their readers and official metrics."""
