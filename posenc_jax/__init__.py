"""posenc_jax: position encodings beyond RoPE as pure JAX functions.

Public API (a contract: tests, notebooks and users rely on these names and argument orders;
what each computes is in docs/encodings.md):
  path_attention, forgetting_attention, path_integral_attention, tapa_attention,
  stick_breaking_attention, softmax_attention, rope, rotate, householder_product, encodings.
"""
from posenc_jax.attention import forgetting_attention
from posenc_jax.attention import path_attention
from posenc_jax.attention import path_integral_attention
from posenc_jax.attention import softmax_attention
from posenc_jax.attention import stick_breaking_attention
from posenc_jax.attention import tapa_attention

from posenc_jax.householder import householder_product
from posenc_jax.rotations import rope
from posenc_jax.rotations import rotate

from posenc_jax import encodings

__version__ = "0.1.0"
