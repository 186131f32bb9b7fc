"""The same comparisons as test_reference_formulas.py, against transformers itself (CPU, seconds).

Skipped unless torch and transformers are installed (`pip install -e ".[parity]"`): CI's
`.[test]` does not install them. Compared: BLOOM's build_alibi_tensor (ALiBi slopes for any
head count); LlamaRotaryEmbedding + apply_rotary_pos_emb for every rope_type from_hf_rope
maps (default, linear, dynamic, yarn with its options, llama3), through the config's own
to_dict(), in transformers' layout and, after permuting q/k channels, in ours.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:  # v5 configs carry rope_parameters
  pytest.skip(f"needs transformers >= 5, found {transformers.__version__}", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from posenc_jax import encodings  # noqa: E402
from posenc_jax import unipotent  # noqa: E402
from tests.test_reference_formulas import HF_CONFIGS  # noqa: E402
from tests.util import assert_rel_rms  # noqa: E402

B, T, H, D = 2, 13, 4, 32


def test_alibi_slopes_match_bloom():
  from transformers.models.bloom.modeling_bloom import build_alibi_tensor
  for h in range(1, 41):
    alibi = build_alibi_tensor(torch.ones(1, 2), h, torch.float32)      # [H, 1, 2]: slope * j
    np.testing.assert_allclose(unipotent.alibi_slopes(h), alibi[:, 0, 1].numpy(), rtol=1e-6,
                               err_msg=f"num_heads={h}")


def _transformers_rotation(config, q, k):
  from transformers.models.llama import modeling_llama
  rotary = modeling_llama.LlamaRotaryEmbedding(config)
  pos = torch.arange(T)[None].expand(B, T)
  cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
  # transformers' attention layout is [B, H, T, D].
  qt, kt = (torch.from_numpy(np.ascontiguousarray(np.swapaxes(a, 1, 2))) for a in (q, k))
  q2, k2 = modeling_llama.apply_rotary_pos_emb(qt, kt, cos, sin)
  return np.swapaxes(q2.numpy(), 1, 2), np.swapaxes(k2.numpy(), 1, 2)


@pytest.mark.parametrize("which", sorted(HF_CONFIGS))
def test_rope_scaling_matches_transformers(key, which):
  import jax
  fields = dict(HF_CONFIGS[which])
  fields.setdefault("hidden_size", H * D)
  fields.setdefault("num_attention_heads", H)
  fields.setdefault("head_dim", D)
  config = transformers.LlamaConfig(**fields)
  kq, kk = jax.random.split(key)
  q = np.asarray(jax.random.normal(kq, (B, T, H, D)), np.float32)
  k = np.asarray(jax.random.normal(kk, (B, T, H, D)), np.float32)
  want_q, want_k = _transformers_rotation(config, q, k)
  layer = dict(x=None, v=jnp.asarray(k), positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
               segment_ids=None, tokens=None, rng=None, train=False)
  for source in (config.to_dict(), HF_CONFIGS[which]):
    name, kwargs = encodings.from_hf_rope(source)
    prep = encodings.get(name, **kwargs).prepare({}, q=jnp.asarray(q), k=jnp.asarray(k), **layer)
    assert_rel_rms(prep.q, want_q, 2e-6, f"{which} q")
    assert_rel_rms(prep.k, want_k, 2e-6, f"{which} k")
  # Adjacent pairs after permuting the q/k channels as half_to_interleaved permutes weights.
  name, kwargs = encodings.from_hf_rope(config.to_dict(), layout="interleaved")
  def perm(a):  # q/k channels in our layout, as the permuted projection weights produce them
    return encodings.half_to_interleaved(a.reshape(B, T, H * D), head_dim=D).reshape(a.shape)
  prep = encodings.get(name, **kwargs).prepare({}, q=jnp.asarray(perm(q)), k=jnp.asarray(perm(k)),
                                               **layer)
  assert_rel_rms(prep.q, perm(want_q), 2e-6, f"{which} interleaved q")
