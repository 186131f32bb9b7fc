r"""Mixing window of accumulated transports (accumulated_rotations §8.3 future work).

For a trained model (length_extrapolation checkpoints) and each layer and kv head, on
held-out text rows of T bytes. The per-token transport G_t is the encoding's own:
  accumulated rotations  G_t = R(delta_t), block-diagonal 2x2 rotations by the step angles
                         (read back from the encoding: phi_t = angle of the rotated unit
                         pair, delta_t = phi_t - phi_{t-1}); T(j -> i) = R(phi_i - phi_j)
  PaTH                   G_t = H_t = I - beta_t w_t w_t^T; T(j -> i) = H_i ... H_{j+1}
Three statistics, each averaged over layers and kv heads (per layer in results.json): the
first moment of the transport over routes of each length, the attention mass per distance bin
and the cancellation of attended values; experiments/probes/pages.py's
MIXING_WINDOW_STATISTICS defines them (the README shows that text).

  python -m experiments.probes.mixing_window --config=experiments/configs/mixing_window.py \
      --results=experiments/results/mixing_window
"""
from __future__ import annotations

import json
import sys
import time

import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from ml_collections import config_flags

from posenc_jax import encodings as enc_lib



def rotation_phases(layer: dict) -> np.ndarray:
  """phi [B, T, 1 or H, P] of a rotary encoding, read from its rotated unit pairs."""
  q = layer["q"]
  B, T, H, D = q.shape
  unit = jnp.zeros_like(q).at[..., 0::2].set(1.0)
  kw = {k: layer["prep_kwargs"][k] for k in layer["prep_kwargs"]}
  prep = layer["enc"].prepare(layer["params"], q=unit, **kw)
  r = np.asarray(prep.q, np.float64)
  return np.arctan2(r[..., 1::2], r[..., 0::2])


class _Transport:
  """Route transports P_j(r) = T(j -> j + r) for all starts j, advanced one step at a time."""

  def __init__(self, layer: dict):
    prep = layer["prep"]
    if prep.family == "path":
      w = np.asarray(prep.inputs["w"], np.float64)            # [B, T, K, D]
      self.beta = np.asarray(prep.inputs["beta"], np.float64)  # [B, T, K]
      self.w = w
      B, T, K, D = w.shape
      self.kind, self.P = "matrix", np.broadcast_to(np.eye(D), (B, T, K, D, D)).copy()
    elif prep.family == "softmax":
      phi = rotation_phases(layer)[:, :, :1]                  # shared over heads
      self.phi = phi
      self.kind, self.P = "phase", np.ones(phi.shape, np.complex128)
    else:
      raise ValueError(f"mixing_window covers rotary and path encodings, not {prep.family!r}")
    self.r = 0

  def step(self):
    """Advances every route by one token; P_j now is T(j -> j + r); rows j + r >= T are junk."""
    self.r += 1
    r = self.r
    if self.kind == "phase":
      d = np.zeros_like(self.phi)
      d[:, :-r] = self.phi[:, r:] - self.phi[:, :-r]
      self.P = np.exp(1j * d)
    else:
      w = np.zeros_like(self.w)
      b = np.zeros_like(self.beta)
      w[:, :-r], b[:, :-r] = self.w[:, r:], self.beta[:, r:]   # the token at j + r
      wP = np.einsum("btkd,btkde->btke", w, self.P)
      self.P = self.P - b[..., None, None] * w[..., :, None] * wP[..., None, :]

  def first_moment(self) -> tuple[float, float]:
    """(spectral norm, ||.||_F / sqrt(D)) of the mean transport over valid routes, per kv head."""
    r = self.r
    if self.kind == "phase":
      M = self.P[:, :-r].mean(axis=(0, 1)) if r else np.ones(self.P.shape[2:])   # [K, P]
      return np.abs(M).max(-1), np.sqrt((np.abs(M) ** 2).mean(-1))
    M = self.P[:, :-r].mean(axis=(0, 1)) if r else self.P.mean(axis=(0, 1))      # [K, D, D]
    D = M.shape[-1]
    return np.linalg.norm(M, 2, axis=(-2, -1)), np.linalg.norm(M, axis=(-2, -1)) / np.sqrt(D)

  def apply(self, v_BTKD):
    """T(j -> j + r) v_j for every start j: [B, T, K, D] (rows j + r >= T junk)."""
    if self.kind == "phase":
      z = v_BTKD[..., 0::2] + 1j * v_BTKD[..., 1::2]
      z = z * self.P
      out = np.empty_like(v_BTKD)
      out[..., 0::2], out[..., 1::2] = z.real, z.imag
      return out
    return np.einsum("btkde,btke->btkd", self.P, v_BTKD)


def attention_weights(layer: dict) -> np.ndarray:
  """The layer's attention weights a [B, H, T(query), T(key)], via one-hot values."""
  prep = layer["prep"]
  B, T, K, _ = prep.k.shape
  eye = jnp.broadcast_to(jnp.eye(T, dtype=prep.q.dtype)[None, :, None, :], (B, T, K, T))
  o = enc_lib.attend(prep._replace(v=eye, out_angles=None), implementation="reference")
  return np.asarray(o, np.float64).transpose(0, 2, 1, 3)


def transported_sums_by_routes(layer: dict, a, v, radii: list[int]):
  """(sum_j a_ij T(j -> i) v_j [B, T, H, D], {r: (spectral, bulk) first moment}) by advancing
  every route one token at a time: O(T) steps, any transport (PaTH's matrices too)."""
  B, H, T, _ = a.shape
  group = H // v.shape[2]
  tr = _Transport(layer)
  moments = {}
  # r = 0: the diagonal term, no transport.
  num_t = np.einsum("bhii->bih", a)[..., None] * np.repeat(v, group, axis=2)
  for r in range(1, T):
    tr.step()
    if r in radii:
      s, f = tr.first_moment()
      moments[r] = (float(np.mean(s)), float(np.mean(f)))
    moved = np.repeat(tr.apply(v), group, axis=2)[:, :T - r]      # T(j -> j+r) v_j, j < T - r
    a_r = np.stack([np.diagonal(a[:, h], offset=-r, axis1=1, axis2=2) for h in range(H)], -1)
    num_t[:, r:] += a_r[..., None] * moved                         # a_{j+r, j}
  return num_t, moments


def transported_sums_by_phases(phi, a, v, radii: list[int]):
  """transported_sums_by_routes for a rotary transport, T(j -> i) = R(phi_i - phi_j), in closed
  form: sum_j a_ij R(phi_i - phi_j) v_j = R(phi_i) sum_j a_ij R(-phi_j) v_j, one attention
  product per head, and each radius' mean route e^{i(phi_{j+r} - phi_j)} directly.

  phi [B, T, 1, P] (shared over kv heads), a [B, H, T, T], v [B, T, K, D = 2P]."""
  B, H, T, _ = a.shape
  kv = np.arange(H) // (H // v.shape[2])                          # each query head's kv head
  z = v[..., 0::2] + 1j * v[..., 1::2]                            # [B, T, K, P]
  back = (np.exp(-1j * phi) * z)[:, :, kv]                        # R(-phi_j) v_j per query head
  zt = np.exp(1j * phi) * np.einsum("bhij,bjhp->bihp", a, back)   # [B, T, H, P]
  num_t = np.empty(zt.shape[:-1] + (v.shape[-1],))
  num_t[..., 0::2], num_t[..., 1::2] = zt.real, zt.imag
  moments = {}
  for r in radii:
    M = np.exp(1j * (phi[:, r:] - phi[:, :-r])).mean(axis=(0, 1))  # [1, P]
    moments[r] = (float(np.mean(np.abs(M).max(-1))),
                  float(np.mean(np.sqrt((np.abs(M) ** 2).mean(-1)))))
  return num_t, moments


def layer_stats(layer: dict, radii: list[int]) -> dict:
  a = attention_weights(layer)                                    # [B, H, T, T]
  B, H, T, _ = a.shape
  v = np.asarray(layer["v"], np.float64)                          # raw values [B, T, K, D]
  K = v.shape[2]
  group = H // K
  if layer["prep"].family == "softmax":                           # a rotary transport
    num_t, moments = transported_sums_by_phases(rotation_phases(layer)[:, :, :1], a, v, radii)
  else:
    num_t, moments = transported_sums_by_routes(layer, a, v, radii)
  spec = {r: m[0] for r, m in moments.items()}
  frob = {r: m[1] for r, m in moments.items()}
  kv = np.arange(H) // group                                      # each query head's kv head
  num_p = np.einsum("bhij,bjhd->bihd", a, v[:, :, kv])            # each head with its own kv
  vnorm = np.linalg.norm(v, axis=-1)                              # [B, T, K]
  den = np.einsum("bhij,bjh->bih", a, vnorm[:, :, kv])
  q_lo = T // 2
  c_t = np.linalg.norm(num_t, axis=-1)[:, q_lo:] / den[:, q_lo:]
  c_p = np.linalg.norm(num_p, axis=-1)[:, q_lo:] / den[:, q_lo:]
  # Attention mass per distance bin, queries i >= T/2.
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  dist = np.where(j <= i, i - j, -1)
  edges = [0, 1] + [2**k for k in range(1, int(np.log2(T)) + 1)]
  mass = {}
  for lo, hi in zip(edges[:-1], edges[1:]):
    sel = (dist >= lo) & (dist < hi)
    mass[f"[{lo},{hi})"] = float((a[:, :, q_lo:] * sel[q_lo:]).sum(-1).mean())
  return {"first_moment_spectral": spec, "first_moment_frobenius": frob, "attention_mass": mass,
          "cancellation_transported": float(c_t.mean()), "cancellation_plain": float(c_p.mean())}


def run(c) -> dict:
  """results[encoding]: the statistics averaged over layers (and over seeds, when several
  seeds' runs are read: "per_seed" then holds each seed's own)."""
  radii = sorted({r for r in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] if r < c.text_len})
  results = {}
  for name in c.encodings:
    per_seed = [_one_run(c, name, seed, radii) for seed in c.seeds]
    if len(per_seed) == 1:
      results[name] = per_seed[0]
      continue
    mean = lambda xs: float(np.mean(xs))  # noqa: E731
    results[name] = {key: ({k: mean([p[key][k] for p in per_seed]) for k in per_seed[0][key]}
                           if isinstance(per_seed[0][key], dict)
                           else mean([p[key] for p in per_seed]))
                     for key in per_seed[0] if key != "per_layer"}
    results[name]["per_seed"] = per_seed
  return results


def _one_run(c, name: str, seed: int, radii: list[int]) -> dict:
  """The statistics of the trained run WORKDIR/<name>/seed<seed>, averaged over its layers."""
  from experiments.probes import load

  tokens, layers = load.trained_layers(c, name, seed)
  per_layer = []
  for layer in layers:
    T = tokens.shape[1]
    layer["prep_kwargs"] = dict(
        k=layer["k"], v=layer["v"], x=jnp.zeros(tokens.shape + (1,)), tokens=tokens,
        positions=jnp.broadcast_to(jnp.arange(T), tokens.shape), segment_ids=None, rng=None,
        train=False)
    per_layer.append(layer_stats(layer, radii))
  avg = lambda key: {k: float(np.mean([p[key][k] for p in per_layer]))  # noqa: E731
                     for k in per_layer[0][key]}
  return {
      "first_moment_spectral": {str(k): v for k, v in avg("first_moment_spectral").items()},
      "first_moment_frobenius": {str(k): v for k, v in avg("first_moment_frobenius").items()},
      "attention_mass": avg("attention_mass"),
      "cancellation_transported": float(np.mean([p["cancellation_transported"]
                                                 for p in per_layer])),
      "cancellation_plain": float(np.mean([p["cancellation_plain"] for p in per_layer])),
      "per_layer": [{k: ({str(a): b for a, b in v.items()} if isinstance(v, dict) else v)
                     for k, v in p.items()} for p in per_layer]}


def write(c, results: dict, out_dir: str, prov: dict) -> None:
  """results.json and provenance.json, then the README and plot (results_pages)."""
  from experiments import results_pages
  from experiments import results_writers

  results_writers.save_results(out_dir, "mixing_window", results, c, prov)
  results_pages.write_page(out_dir)


def main(argv) -> None:
  del argv
  from experiments import results_writers

  started = time.time()
  c = _CONFIG.value
  results = run(c)
  print(json.dumps({n: {k: v for k, v in r.items() if k != "per_layer"}
                    for n, r in results.items()}, indent=1))
  if _RESULTS.value:
    write(c, results, _RESULTS.value, results_writers.provenance(
        sys.argv, time.time() - started, module="experiments.probes.mixing_window"))


if __name__ == "__main__":
  # Flags are defined only when run as a program, so the modules import side-effect free.
  _CONFIG = config_flags.DEFINE_config_file("config", None, "Probe config file[:arg].")
  _RESULTS = flags.DEFINE_string("results", None, "Write results.json/README.md/plots here.")
  flags.mark_flags_as_required(["config"])
  app.run(main)
