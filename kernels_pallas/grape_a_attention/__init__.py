"""Causal GRAPE-A attention as Pallas kernels: the bias -(i - j) (rate_q_i + rate_k_j) computed
in each tile from per-token rates, never a T x T array or extra head channels."""
from kernels_pallas.grape_a_attention.api import grape_a_attention

__all__ = ["grape_a_attention"]
