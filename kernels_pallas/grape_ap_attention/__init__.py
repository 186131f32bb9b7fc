"""Causal GRAPE-AP attention (path-sum bias of learned edge potentials) as Pallas kernels."""
from kernels_pallas.grape_ap_attention.api import grape_ap_attention

__all__ = ["grape_ap_attention"]
