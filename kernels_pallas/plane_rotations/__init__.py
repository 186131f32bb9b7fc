"""A token's head vector through a sequence of plane rotations (GRAPE-M's rank-2 planes) in one
Pallas pass: each tile is read once and written once however many planes there are, and the
backward rebuilds each plane's input by the inverse rotation instead of storing it."""
from kernels_pallas.plane_rotations.api import plane_rotations

__all__ = ["plane_rotations"]
