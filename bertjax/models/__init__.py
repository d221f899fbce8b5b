"""The encoders: each family's package (bert/, modernbert/) behind `families.Family`, and the
layers they share (attention kernels, dropout, FLOPs)."""
