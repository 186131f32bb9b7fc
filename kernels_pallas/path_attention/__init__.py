"""PaTH / FoX attention kernels (Pallas: Triton-lowered and Mosaic GPU on the GPU, Mosaic on the
TPU). DESIGN.md beside this file has the algorithm, the file map and the default plan."""
from kernels_pallas.path_attention.api import (explain, forgetting_attention, path_attention,
                                               phases)
from kernels_pallas.path_attention.options import BlockSizes
from kernels_pallas.path_attention.plan import Plan

__all__ = ["BlockSizes", "Plan", "explain", "forgetting_attention", "path_attention", "phases"]
