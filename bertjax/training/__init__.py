"""Training: typed settings, state, steps and optimizer, the loop skeleton and the two loops that
run on it (pretraining, fine-tuning), resume and what a run reports."""
