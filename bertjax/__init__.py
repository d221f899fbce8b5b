"""bertjax: BERT (Devlin et al., 2018) in JAX/Flax, faithful by default, fast by design."""
