"""Checkpoints on disk, below training and interop: the Orbax checkpoint (state, data position,
meta), whether one fits the run restoring it, and the run record it keeps."""
