"""Non-causal block attention with its log-sum-exp, forward and backward, as Pallas kernels:
queries against one block of keys (a ring step of context-parallel attention), additive query
and key biases, a segment mask, GQA, (o, lse) differentiable in both.

GPU only (Triton lowering: `pl.pallas_call` with Triton compiler parameters); interpret=True
runs the same kernels in the Pallas interpreter anywhere else (the CPU tests). No TPU form.
Files: kernels.py (the kernel bodies), api.py (the function, its custom VJP, the launches).
"""
from kernels_pallas.block_attention.api import block_attention

__all__ = ["block_attention"]
