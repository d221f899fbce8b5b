"""ModernBERT (Warner et al., 2024): its config, model, task heads and family entry."""
