"""Measurement, not training: ahead-of-time compilation for a target mesh, step and input-pipeline benchmarks."""
