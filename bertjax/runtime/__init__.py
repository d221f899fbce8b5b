"""The process runtime under training: hosts and their agreement, stop requests, failures,
files and remote storage, locks, the console, and the accelerator environment."""
