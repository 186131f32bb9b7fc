"""PaTH's decode step over its key cache as one Pallas pass."""
from kernels_pallas.path_decode.api import path_decode_step

__all__ = ["path_decode_step"]
