"""Analyses of trained checkpoints and of encodings as pure functions (experiments 5 and 6)."""
