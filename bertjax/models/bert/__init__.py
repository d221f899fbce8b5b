"""BERT (Devlin et al., 2018): its config, model, task heads and family entry."""
