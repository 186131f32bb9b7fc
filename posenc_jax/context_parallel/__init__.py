"""Context parallelism: one sequence's attention with T sharded over the mesh axis "context".

mesh        how many devices share T, the shard_map around a per-shard function, ring passes
layout      contiguous or zig-zag (load-balanced) chunks per device
merge       (o, lse) + (o, lse) -> (o, lse): partial attentions over disjoint keys
tiles       blockwise attention of local queries against one block of keys, with its lse
path_ring   PaTH / PaTH-FoX: the ring of Householder-transported keys
gated_ring  softmax, FoX, ALiBi: the ring of keys with their gate tails
api         the entry points posenc_jax.attention dispatches to
"""
from posenc_jax.context_parallel.api import forgetting_attention  # noqa: F401
from posenc_jax.context_parallel.api import path_attention  # noqa: F401
from posenc_jax.context_parallel.api import softmax_attention  # noqa: F401
from posenc_jax.context_parallel.merge import merge  # noqa: F401
from posenc_jax.context_parallel.mesh import context_size  # noqa: F401
