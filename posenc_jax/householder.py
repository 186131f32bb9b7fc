"""PaTH: causal attention with accumulated Householder transport (docs/encodings/path.md#path).

    H_t = I - beta_t w_t w_t^T          (|w_t| = 1, beta_t in [0, 2]; symmetric, singular at 1)
    l_ij = scale q_i^T (H_i H_{i-1} ... H_{j+1}) k_j  [+ sum_{s=j+1}^{i} log_forget_s, unscaled]

Three implementations of the same function, by cost:

  path_attention_reference  walks j = i-1..0 carrying q~ <- H_{j+1} q~: O(T^2 D), T x T logits.
  path_attention_scan       Householder products inside each chunk by lax.associative_scan
                            (O(T D^3) work, O(T D^2) memory), then the right-to-left chunk scan.
  path_attention_chunked    the paper's UT transform per chunk (§3.2-3.3): O(T^2 D + T C D)
                            work, O(T C) memory, never a T x T array.

H is never inverted (beta = 1 makes it singular): the blocked forms compose chunk products
P_c = H_last ... H_first from the query side, right to left, as the paper does. The argument
checks live in posenc_jax.path_attention; these functions trust their inputs.

Decoding (§3.4): `transport_keys` applies one step's H_t to a key cache in place, and
`prefill_keys` transports a prompt's keys to its last position in O(T) chunk steps.

Shape letters: B batch, T time, H query heads, K kv heads (query head h reads kv head h // G),
G = H // K, D head dim, Dv value dim, n chunks, C chunk length.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from posenc_jax import _checks
from posenc_jax import blockwise
from posenc_jax import masking

_f32 = lambda x: x.astype(jnp.float32)  # noqa: E731


def _householder_matrices(w_BTKD, beta_BTK):
  """H_t = I - beta_t w_t w_t^T as dense [B, T, K, D, D] matrices."""
  D = w_BTKD.shape[-1]
  outer = w_BTKD[..., :, None] * w_BTKD[..., None, :]
  return jnp.eye(D, dtype=outer.dtype) - beta_BTK[..., None, None] * outer


def householder_product(w, beta):
  """Cumulative products P_t = H_t H_{t-1} ... H_0 of H_t = I - beta_t w_t w_t^T.

  w [B, T, K, D], beta [B, T, K] -> [B, T, K, D, D], by lax.associative_scan over time.
  """
  _checks.check_rank("w", w, 4, "BTKD")
  _checks.check_shape("beta", beta, w.shape[:3], "BTK")
  # Later factors multiply on the left: combine(earlier, later) = later @ earlier.
  return jax.lax.associative_scan(lambda a, b: b @ a, _householder_matrices(w, beta), axis=1)


def _walk_logits(q_BNCKGD, k_BNCKD, w_BNCKD, beta_BNCK):
  """l[i, j] = q_i^T H_i ... H_{j+1} k_j inside each of n chunks, for j <= i.

  A lax.scan over j = C-1..0 that moves every query at once: row i is left alone until
  j < i, then gets H_{j+1} applied. Entries j > i are meaningless (callers mask them).
  Returns [B, n, K, G, C_i, C_j].
  """
  C = q_BNCKGD.shape[2]
  # H_{j+1} for j = C-1 is outside the chunk; beta = 0 makes it the identity.
  w_next = jnp.concatenate([w_BNCKD[:, :, 1:], jnp.zeros_like(w_BNCKD[:, :, :1])], axis=2)
  b_next = jnp.concatenate([beta_BNCK[:, :, 1:], jnp.zeros_like(beta_BNCK[:, :, :1])], axis=2)
  rows = jnp.arange(C)[None, None, :, None, None, None]

  def step(s, xs):
    j, w1, b1, kj = xs                                        # w1 [B,n,K,D], b1 [B,n,K]
    proj = jnp.einsum("bnckgd,bnkd->bnckg", s, w1) * b1[:, :, None, :, None]
    s = jnp.where(rows > j, s - proj[..., None] * w1[:, :, None, :, None, :], s)
    return s, jnp.einsum("bnckgd,bnkd->bnkgc", s, kj)

  time_major = lambda x: jnp.moveaxis(x, 2, 0)[::-1]  # noqa: E731
  xs = (jnp.arange(C)[::-1], time_major(w_next), time_major(b_next), time_major(k_BNCKD))
  _, cols = jax.lax.scan(step, q_BNCKGD, xs)                 # [C_j (descending), B,n,K,G,C_i]
  return jnp.moveaxis(cols[::-1], 0, -1)


def path_attention_reference(q, k, v, w, beta, *, log_forget=None, segment_ids=None, scale):
  """Dense O(T^2 D) oracle. q [B,T,H,D]; k, v [B,T,K,D]; w [B,T,K,D]; beta [B,T,K];
  log_forget [B,T,H] or None; segment_ids [B,T] or None -> o [B,T,H,Dv] in v's dtype."""
  B, T, H, D = q.shape
  K = k.shape[2]
  qg = (scale * _f32(q)).reshape(B, 1, T, K, H // K, D)
  logits = _walk_logits(qg, _f32(k)[:, None], _f32(w)[:, None], _f32(beta)[:, None])
  logits = logits.reshape(B, H, T, T)
  if log_forget is not None:
    c = jnp.moveaxis(masking.segment_cumsum(_f32(log_forget), segment_ids), 2, 1)  # [B,H,T]
    logits = logits + c[..., :, None] - c[..., None, :]
  return masking.dense_attention(logits, v, masking.causal_dense_mask(T, segment_ids))


class _Chunks(NamedTuple):
  """Per-chunk operands of the right-to-left scan, chunk axis leading (index n)."""
  q_hat: jax.Array      # [n,B,C,K,G,D] scaled queries transported to their chunk's start
  k_hat: jax.Array      # [n,B,C,K,D] keys transported to their chunk's end
  diag: jax.Array       # [n,B,H,C,C] scaled in-chunk transport logits (no gate)
  transport: object     # pytree, leading n: what `apply` needs to move q~ across chunk b


def _blocked(x, n: int, C: int):
  """[B, n*C, ...] -> [B, n, C, ...]."""
  return x.reshape(x.shape[:1] + (n, C) + x.shape[2:])


def _right_to_left(ch: _Chunks, apply: Callable, v_nBCKD, gate_nBHC, *, T: int, seg_BTp,
                   return_lse: bool = False):
  """Flash-style attention over chunks: for query chunk a, visit key chunks a, a-1, .., 0.

  Across chunks l_ij = q~_i . k^_j where q~ starts at q^ and is moved by q~ <- q~ P_b after
  key chunk b. gate_nBHC holds the in-chunk inclusive cumsum of log_forget (or None): the
  gate sum from key j to query i is carried as (query-side running sum) + (chunk tail).
  return_lse: also the log-sum-exp [B, T, H] of each query's logits (NEG_INF if it sees none).
  """
  n, B, C, K, G, D = ch.q_hat.shape
  H, Dv = K * G, v_nBCKD.shape[-1]

  def query_chunk(a):
    s0 = a * C
    diag = ch.diag[a]
    if gate_nBHC is not None:
      diag = diag + gate_nBHC[a][..., :, None] - gate_nBHC[a][..., None, :]
    state = blockwise.update_state(blockwise.init_state(B, H, C, Dv), diag,
                                   blockwise.tile_mask(s0, s0, C, C, T, seg_BTp), v_nBCKD[a])

    def visit(carry, b):
      state, q_t, g_t = carry
      s = jnp.einsum("bqkgd,bckd->bkgqc", q_t, ch.k_hat[b]).reshape(B, H, C, C)
      if gate_nBHC is not None:
        tail = gate_nBHC[b][..., -1:] - gate_nBHC[b]           # sum over (j, end of chunk b]
        s = s + g_t[..., :, None] + tail[..., None, :]
        g_t = g_t + gate_nBHC[b][..., -1:]
      state = blockwise.update_state(state, s, blockwise.tile_mask(s0, b * C, C, C, T, seg_BTp),
                                     v_nBCKD[b])
      q_t = apply(q_t, jax.tree.map(lambda x: x[b], ch.transport))
      return state, q_t, g_t

    # Rematerialised in the backward pass: only the carry is stored per step. (Checkpointing
    # inside the cond instead makes the cond emit the chunk operands as per-step residuals.)
    @jax.checkpoint
    def step(carry, i):
      b = a - 1 - i
      return jax.lax.cond(b >= 0, visit, lambda c, _: c, carry, b), None

    g0 = jnp.zeros((B, H, C), jnp.float32) if gate_nBHC is None else gate_nBHC[a]
    (state, _, _), _ = jax.lax.scan(step, (state, ch.q_hat[a], g0), jnp.arange(n - 1))
    if not return_lse:
      return blockwise.finalize(state)
    lse = jnp.where(state.l_BHQ > 0,
                    state.m_BHQ + jnp.log(jnp.maximum(state.l_BHQ, 1e-30)), masking.NEG_INF)
    return blockwise.finalize(state), jnp.moveaxis(lse, 1, 2)

  # Checkpointing the whole query chunk keeps gradient memory at one chunk's carries.
  out = jax.lax.map(jax.checkpoint(query_chunk), jnp.arange(n))   # [n, B, C, H, Dv]
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape((B, n * C) + x.shape[3:])[:, :T]  # noqa: E731
  return jax.tree.map(unblock, out)


def _chunk_layout(T: int, C: int):
  """(padded length Tp, chunks n, pad: [B, T, ...] -> float32 [B, n, C, ...] padded with 0)."""
  Tp = blockwise.padded_length(T, C)
  n = Tp // C
  return Tp, n, lambda x: _blocked(blockwise.pad_time(_f32(x), Tp), n, C)


def _blocked_attention(prepare: Callable, apply: Callable, q, k, v, w, beta, *, log_forget,
                       segment_ids, scale, chunk_size: int, return_lse: bool = False):
  """Pads to whole chunks (beta = 0: identity), builds the chunk operands, runs the scan."""
  B, T, H, D = q.shape
  K = k.shape[2]
  C = chunk_size
  Tp, n, pad = _chunk_layout(T, C)
  qg = pad(scale * _f32(q)).reshape(B, n, C, K, H // K, D)
  ch = prepare(qg, pad(k), pad(w), pad(beta))
  v_n = jnp.moveaxis(_blocked(blockwise.pad_time(v, Tp), n, C), 1, 0)
  gate = None
  if log_forget is not None:
    # In-chunk cumsums keep the gate sums local: no long absolute prefix sums in float32.
    gate = jnp.moveaxis(jnp.cumsum(pad(log_forget), axis=2), (1, 3), (0, 2))  # [n,B,H,C]
  seg = None if segment_ids is None else blockwise.pad_time(segment_ids, Tp, value=-1)
  out = _right_to_left(ch, apply, v_n, gate, T=T, seg_BTp=seg, return_lse=return_lse)
  if return_lse:
    return out[0].astype(v.dtype), out[1]
  return out.astype(v.dtype)


def _chunk_major(x):
  return jnp.moveaxis(x, 1, 0)


def _scan_prepare(qg, k, w, beta) -> _Chunks:
  """Chunk operands from dense in-chunk Householder products (associative scans)."""
  B, n, C, K, G, D = qg.shape
  Hm = _householder_matrices(w, beta)                                   # [B,n,C,K,D,D]
  pre = jax.lax.associative_scan(lambda a, b: b @ a, Hm, axis=2)       # H_t ... H_start
  # Suffix products H_end ... H_t, scanned from the chunk end.
  suf = jax.lax.associative_scan(lambda a, b: a @ b, Hm, axis=2, reverse=True)
  eye = jnp.broadcast_to(jnp.eye(D, dtype=suf.dtype), suf[:, :, :1].shape)
  suf_excl = jnp.concatenate([suf[:, :, 1:], eye], axis=2)             # H_end ... H_{t+1}
  q_hat = jnp.einsum("bnckge,bncked->bnckgd", qg, pre)                 # q^T (H_t ... H_start)
  k_hat = jnp.einsum("bnckde,bncke->bnckd", suf_excl, k)
  diag = _walk_logits(qg, k, w, beta).reshape(B, n, K * G, C, C)
  return _Chunks(_chunk_major(q_hat), _chunk_major(k_hat), _chunk_major(diag),
                 _chunk_major(pre[:, :, -1]))                          # P_b [n,B,K,D,D]


def _scan_apply(q_t, P_BKDD):
  return jnp.einsum("bqkge,bked->bqkgd", q_t, P_BKDD)                   # q~^T P_b


def _ut_transform(w_BNCKD, beta_BNCK):
  """X = (I + strictLower(diag(beta) W W^T))^{-1} diag(beta) per chunk: [B,n,K,C,C].

  With it a chunk's product is H_{C-1} ... H_0 = I - W^T X W, and any sub-interval's product
  uses the same X with masked W (paper §3.2).
  """
  C = w_BNCKD.shape[2]
  gram = jnp.einsum("bnckd,bnlkd->bnkcl", w_BNCKD, w_BNCKD)
  b = jnp.moveaxis(beta_BNCK, 2, 3)                                     # [B,n,K,C]
  eye = jnp.eye(C, dtype=gram.dtype)
  lower = eye + jnp.tril(b[..., :, None] * gram, -1)
  return _unit_lower_inverse(lower) * b[..., None, :]


def _unit_lower_inverse(lower_XCC):
  """(I + L)^{-1} for a batch of unit lower-triangular [C, C] matrices (the diagonal is taken
  as ones).

  A triangular solve everywhere but the CPU. There jaxlib 0.10's LAPACK trsm splits its batch
  over XLA:CPU's intra-op thread pool and blocks a pool thread until the pieces finish: when
  as many solves run at once as the pool has threads (the devices of a context ring on a CPU
  mesh each run the layer's solves concurrently), every thread waits on work that no thread
  is left to run, and the program hangs. The CPU branch substitutes row by row in a loop that
  never leaves the thread it runs on.
  """
  def solve(m):
    eye = jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=m.dtype), m.shape)
    return jax.lax.linalg.triangular_solve(m, eye, left_side=True, lower=True,
                                           unit_diagonal=True)

  return jax.lax.platform_dependent(lower_XCC, cpu=_unit_lower_inverse_by_rows, default=solve)


@jax.custom_jvp
def _unit_lower_inverse_by_rows(lower_XCC):
  """Forward substitution: row i of X = (I + L)^{-1} is e_i - L[i, :i] X[:i], the rows above
  it being final. One loop body (a small program to compile); its derivative is the closed
  form below, not the loop's."""
  C = lower_XCC.shape[-1]
  eye = jnp.eye(C, dtype=lower_XCC.dtype)

  def row(i, x):
    l_i = jax.lax.dynamic_index_in_dim(lower_XCC, i, axis=-2, keepdims=False)
    l_i = jnp.where(jnp.arange(C) < i, l_i, 0.0)                        # strictly left of i
    x_i = eye[i] - jnp.einsum("...j,...jc->...c", l_i, x, precision="highest")
    return jax.lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)

  return jax.lax.fori_loop(1, C, row, jnp.broadcast_to(eye, lower_XCC.shape))


@_unit_lower_inverse_by_rows.defjvp
def _unit_lower_inverse_by_rows_jvp(primals, tangents):
  """d(A^{-1}) = -A^{-1} dA A^{-1}, with dA strictly lower (the diagonal is fixed at one)."""
  (lower,), (dlower,) = primals, tangents
  x = _unit_lower_inverse_by_rows(lower)
  dlower = jnp.tril(dlower, -1)
  return x, -jnp.matmul(x, jnp.matmul(dlower, x, precision="highest"), precision="highest")


def _ut_prepare(qg, k, w, beta) -> _Chunks:
  """Chunk operands from the UT transform (triangular solves, no D x D matrices)."""
  B, n, C, K, G, D = qg.shape
  X = _ut_transform(w, beta)                                            # [B,n,K,C,C]
  incl = jnp.tril(jnp.ones((C, C), bool))
  strict = jnp.tril(incl, -1)
  qw = jnp.where(incl, jnp.einsum("bnikgd,bnckd->bnkgic", qg, w), 0.0)  # lower(Q W^T)
  wk = jnp.where(strict, jnp.einsum("bnlkd,bnjkd->bnklj", w, k), 0.0)    # strictLower(W K^T)
  qwx = jnp.einsum("bnkgic,bnkcl->bnkgil", qw, X)
  xwk = jnp.einsum("bnkcl,bnklj->bnkcj", X, wk)
  q_hat = qg - jnp.einsum("bnkgil,bnlkd->bnikgd", qwx, w)
  k_hat = k - jnp.einsum("bnkcj,bnckd->bnjkd", xwk, w)
  diag = (jnp.einsum("bnikgd,bnjkd->bnkgij", qg, k)
          - jnp.einsum("bnkgil,bnklj->bnkgij", qwx, wk)).reshape(B, n, K * G, C, C)
  return _Chunks(_chunk_major(q_hat), _chunk_major(k_hat), _chunk_major(diag),
                 (_chunk_major(w), _chunk_major(X)))


def _ut_apply(q_t, wx):
  """q~ <- q~ (I - W^T X W) as a rank-C update: O(C^2 D), no D x D matrix."""
  w_BCKD, X_BKCC = wx
  u = jnp.einsum("bqkgd,bckd->bqkgc", q_t, w_BCKD)
  return q_t - jnp.einsum("bqkgc,bkcl,blkd->bqkgd", u, X_BKCC, w_BCKD)


def path_attention_scan(q, k, v, w, beta, *, log_forget=None, segment_ids=None, scale,
                        chunk_size: int = 64):
  """PaTH attention from associative-scan Householder products inside chunks.

  Queries are moved to their chunk's start by prefix products, keys to their chunk's end by
  suffix products, in-chunk logits come from the dense walk, and the chunk products P_b carry
  queries right to left. Same arguments and result as `path_attention_reference`.
  """
  return _blocked_attention(_scan_prepare, _scan_apply, q, k, v, w, beta, log_forget=log_forget,
                            segment_ids=segment_ids, scale=scale, chunk_size=chunk_size)


def path_attention_chunked(q, k, v, w, beta, *, log_forget=None, segment_ids=None, scale,
                           chunk_size: int = 64):
  """PaTH attention by the paper's blockwise UT algorithm; never holds a T x T array.

  Any T (padded to whole chunks with beta = 0). Float32 accumulation for any input dtype.
  Same arguments and result as `path_attention_reference`.
  """
  return _blocked_attention(_ut_prepare, _ut_apply, q, k, v, w, beta, log_forget=log_forget,
                            segment_ids=segment_ids, scale=scale, chunk_size=chunk_size)


def path_attention_chunked_lse(q, k, v, w, beta, *, log_forget=None, segment_ids=None, scale,
                               chunk_size: int = 64):
  """`path_attention_chunked` that also returns each query's log-sum-exp: (o, lse [B, T, H]
  float32, the natural log of the softmax denominator of the scaled, gated logits), the
  partial result that merges with attention over other keys (context parallelism)."""
  return _blocked_attention(_ut_prepare, _ut_apply, q, k, v, w, beta, log_forget=log_forget,
                            segment_ids=segment_ids, scale=scale, chunk_size=chunk_size,
                            return_lse=True)


def _chunk_products(transport):
  """Dense chunk products P_c = H_last ... H_first = I - W^T X W from the UT operands
  (w [n, B, C, K, D], X [n, B, K, C, C]) -> [n, B, K, D, D]."""
  w_n, X_n = transport
  eye = jnp.eye(w_n.shape[-1], dtype=jnp.float32)
  return eye - jnp.einsum("nbckd,nbkcl,nblke->nbkde", w_n, X_n, w_n)


def boundary_transport(q, k, w, beta, *, chunk_size: int = 64):
  """What one contiguous block of tokens hands to its neighbours (context parallelism):

    q_start_i = (H_i ... H_0)^T q_i      queries moved to the block's start
    k_end_j   = H_{T-1} ... H_{j+1} k_j   keys moved to the block's end
    P         = H_{T-1} ... H_0           the block's product

  so that for a query i of a later block and a key j of this one, q_i^T (H_i ... H_{j+1}) k_j
  = q_start_i^T (products of the blocks in between) k_end_j.
  q [B, T, H, D]; k, w [B, T, K, D]; beta [B, T, K] -> q_start [B, T, H, D], k_end [B, T, K, D],
  P [B, K, D, D], float32. Linear in T: the UT form inside chunks, D x D products across them.
  """
  # Recomputed in the gradient rather than kept: the UT form and the running products hold
  # dozens of [T / 64, K, 64, 64] float32 stacks, gigabytes a layer at T / N = 32,768, and the
  # ring's memory has to stay that of its T / N tokens; recomputing costs this function's
  # forward again, which is linear in T / N.
  return jax.checkpoint(functools.partial(_boundary_transport, chunk_size=chunk_size))(
      q, k, w, beta)


def _boundary_transport(q, k, w, beta, *, chunk_size: int):
  B, T, H, D = q.shape
  K = k.shape[2]
  C = chunk_size
  Tp, n, pad = _chunk_layout(T, C)
  ch = _ut_prepare(pad(q).reshape(B, n, C, K, H // K, D), pad(k), pad(w), pad(beta))
  P_n = _chunk_products(ch.transport)                                    # [n,B,K,D,D]
  eye = jnp.broadcast_to(jnp.eye(D, dtype=jnp.float32), P_n[:1].shape)
  incl = _running_products(P_n)                                          # P_c ... P_0
  before = jnp.concatenate([eye, incl[:-1]], axis=0)                     # P_{c-1} ... P_0
  suffix = _running_products(P_n, reverse=True)                          # P_{n-1} ... P_c
  after = jnp.concatenate([suffix[1:], eye], axis=0)                     # P_{n-1} ... P_{c+1}
  q_start = jnp.einsum("nbckge,nbked->nbckgd", ch.q_hat, before)
  k_end = jnp.einsum("nbkde,nbcke->nbckd", after, ch.k_hat)
  q_start = jnp.moveaxis(q_start, 0, 1).reshape(B, Tp, H, D)[:, :T]
  k_end = jnp.moveaxis(k_end, 0, 1).reshape(B, Tp, K, D)[:, :T]
  return q_start, k_end, incl[-1]


def _running_products(P_nXDD, *, reverse: bool = False):
  """out[c] = P_c ... P_0 (reverse: P_{n-1} ... P_c) of matrices stacked on axis 0.

  Recursive doubling: log2(n) matmuls of the whole stack, the missing factors padded with
  the identity. Not lax.associative_scan: its recursion makes zero-size arrays, and in a
  gradient under shard_map XLA:GPU's compiler crashes on them (the context-parallel ring).
  """
  n = P_nXDD.shape[0]
  eye = jnp.broadcast_to(jnp.eye(P_nXDD.shape[-1], dtype=P_nXDD.dtype), P_nXDD.shape[1:])
  out, span = P_nXDD, 1
  while span < n:   # out[c] holds the `span` factors ending (reverse: starting) at c
    pad = jnp.broadcast_to(eye, (span,) + eye.shape)
    if reverse:
      out = jnp.concatenate([out[span:], pad], axis=0) @ out
    else:
      out = out @ jnp.concatenate([pad, out[:-span]], axis=0)
    span *= 2
  return out


def transport_keys(k_cache, w_t, beta_t):
  """One decoding step (paper §3.4): k_j <- H_t k_j for every cached key, in place.

  k_cache [B, S, K, D]; w_t [B, K, D]; beta_t [B, K]. Apply before appending k_t, then
  attend with plain softmax attention: q_t . k_j then equals q_t^T H_t ... H_{j+1} k_j.
  """
  proj = jnp.einsum("bskd,bkd->bsk", k_cache, w_t) * beta_t[:, None]
  return k_cache - proj[..., None] * w_t[:, None]


def prefill_keys(k, w, beta, *, chunk_size: int = 64):
  """A prompt's keys transported to its last position: k_j <- H_{T-1} ... H_{j+1} k_j.

  k, w [B, T, K, D]; beta [B, T, K] -> [B, T, K, D] (float32), the decoding cache after
  the prompt. Linear in T: keys are moved to their chunk's end by the UT form, then a
  right-to-left scan carries the accumulated product of later chunks (D x D).
  """
  B, T, K, D = k.shape
  C = chunk_size
  Tp, n, pad = _chunk_layout(T, C)
  kb, wb = pad(k), pad(w)
  ch = _ut_prepare(kb[:, :, :, :, None], kb, wb, pad(beta))   # q unused: only k_hat, transport
  eye = jnp.eye(D, dtype=jnp.float32)

  def step(M_BKDD, xs):
    k_hat, P = xs
    out = jnp.einsum("bkde,bcke->bckd", M_BKDD, k_hat)
    return M_BKDD @ P, out

  M0 = jnp.broadcast_to(eye, (B, K, D, D))
  _, out = jax.lax.scan(step, M0, (ch.k_hat, _chunk_products(ch.transport)), reverse=True)
  return jnp.moveaxis(out, 0, 1).reshape(B, Tp, K, D)[:, :T]
