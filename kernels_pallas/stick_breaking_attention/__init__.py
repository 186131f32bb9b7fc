"""Causal stick-breaking attention (SBA) as Pallas kernels: a forward that walks each query
tile's key tiles from the nearest to the farthest, carrying the log of the stick left, and a
two-launch backward; never a T x T array."""
from kernels_pallas.stick_breaking_attention.api import stick_breaking_attention

__all__ = ["stick_breaking_attention"]
