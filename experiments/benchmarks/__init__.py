"""Benchmarks: scripts a researcher runs by hand (not tests)."""
