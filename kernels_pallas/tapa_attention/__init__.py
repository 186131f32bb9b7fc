"""Causal TAPA attention (token-aware phase attention, quadratic and linear phase) as Pallas
kernels: a flash-style forward and a two-launch backward whose tiles compute the logit
amp * cos(2 pi |i - j|^alpha phase) in place, never a T x T array."""
from kernels_pallas.tapa_attention.api import tapa_attention

__all__ = ["tapa_attention"]
