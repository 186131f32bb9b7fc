"""PaTH / FoX attention kernels (Pallas: Triton-lowered on GPU, Mosaic on TPU)."""
from kernels_pallas.path_attention.api import BlockSizes, forgetting_attention, path_attention

__all__ = ["BlockSizes", "forgetting_attention", "path_attention"]
