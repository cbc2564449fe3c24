"""Drafter training: prompt corpus, self-distillation data, prefix-shared masked training."""
