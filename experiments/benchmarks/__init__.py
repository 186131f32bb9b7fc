"""Benchmarks: scripts a researcher runs by hand from a checkout (not tests, not installed with
the package). docs/benchmarks/README.md lists them, and each one's current table."""
