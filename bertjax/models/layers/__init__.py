"""What the model families share: losses, activations, remat policies, dtypes, gathers."""
