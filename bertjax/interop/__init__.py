"""Checkpoint formats: Google TF and Hugging Face BERT checkpoints, and bertjax's own, as parameter trees."""
