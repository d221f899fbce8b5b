"""Pretraining data: corpus reading, instance creation, masking and resumable loading."""
