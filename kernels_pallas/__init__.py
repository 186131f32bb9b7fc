"""Pallas kernels for posenc_jax. Imports nothing from posenc_jax."""
from kernels_pallas.block_attention import block_attention
from kernels_pallas.grape_a_attention import grape_a_attention
from kernels_pallas.grape_ap_attention import grape_ap_attention
from kernels_pallas.path_attention import (BlockSizes, Plan, explain, forgetting_attention,
                                           path_attention, phases)
from kernels_pallas.plane_rotations import plane_rotations
from kernels_pallas.stick_breaking_attention import stick_breaking_attention
from kernels_pallas.tapa_attention import tapa_attention

__all__ = ["BlockSizes", "Plan", "block_attention", "explain", "forgetting_attention",
           "grape_a_attention", "grape_ap_attention", "path_attention", "phases",
           "plane_rotations", "stick_breaking_attention", "tapa_attention"]
