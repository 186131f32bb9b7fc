r"""Distance bias (TAPA App. 15): score differences between short- and long-range pairs.

For a query/key content pair (q, k) and an encoding, the attention logit at relative
distance d is s(q, k; d) = the logit the encoding gives key k at position 0 and query q at
position d (RoPE: q R^d k / sqrt(D); TAPA: amp(q, k) cos(2 pi d^alpha phase(q, k))).
TAPA's statistic is

    Delta = s(q, k; lambda) - s(q, k; Lambda),  lambda ~ U[0, 100], Lambda ~ U[10000, 10100]

over many sampled pairs: a distribution shifted to positive values means the encoding
favours short range regardless of content (RoPE in the paper: mean 4.1, std 0.85; TAPA:
mean 0.03, std 3.3, from a trained 8K model on PG19).

Two sources of (q, k):
  random   i.i.d. Gaussian content (a pure function of the encoding, no training): k =
           rho q + sqrt(1 - rho^2) eps, rho = 0 (unrelated) and rho = 0.5 (matching
           content, the case RoPE's long-range decay is about)
  trained  the raw (pre-encoding) q_i, k_j of a trained model's layer on held-out text,
           pairs (i >= j) sampled uniformly per head, re-encoded at the sampled distances

  python -m experiments.probes.distance_bias --config=experiments/configs/distance_bias.py \
      --results=experiments/results/distance_bias
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from ml_collections import config_flags

from posenc_jax import encodings as enc_lib
from posenc_jax import tapa as tapa_lib

HISTOGRAM_BINS = 80   # per panel (interval x source), shared by its encodings


def pair_logits(enc: enc_lib.Encoding, params, q_NHD, k_NHD, dist_N):
  """Logit of key k at position 0 seen by query q at position dist: [N, H]."""
  N, H, D = q_NHD.shape
  dummy = dict(x=jnp.zeros((N, 2, 1)), v=jnp.zeros((N, 2, k_NHD.shape[1], D)),
               segment_ids=None, tokens=jnp.zeros((N, 2), jnp.int32), rng=None, train=False)
  pos = jnp.stack([jnp.zeros_like(dist_N), dist_N], axis=1).astype(jnp.int32)
  qq = jnp.stack([q_NHD, q_NHD], axis=1)
  kk = jnp.stack([k_NHD, k_NHD], axis=1)
  prep = enc.prepare(params, q=qq, k=kk, positions=pos, **dummy)
  if prep.family == "softmax":
    return jnp.einsum("nhd,nhd->nh", prep.q[:, 1], prep.k[:, 0]) / math.sqrt(D)
  if prep.family == "tapa":
    i = prep.inputs
    A, P = tapa_lib.split_sizes(i["theta"], D)
    amp = jnp.einsum("nhd,nhd->nh", q_NHD[..., :A], k_NHD[..., :A]) / math.sqrt(A)
    if i["linear_phase"]:
      phase = q_NHD[..., A:].sum(-1) + k_NHD[..., A:].sum(-1)
    else:
      phase = jnp.einsum("nhd,nhd->nh", q_NHD[..., A:], k_NHD[..., A:])
    dpow = tapa_lib.distance_power(dist_N, i["alpha"])[:, None]
    return amp * jnp.cos(2 * math.pi * dpow * phase / math.sqrt(P))
  raise ValueError(f"distance_bias covers softmax (rotary) and tapa encodings, not {enc.name!r}")


def deltas(enc, params, q_NHD, k_NHD, *, short, long, seed: int) -> np.ndarray:
  """Delta per pair and head, flattened."""
  r = np.random.default_rng(seed)
  N = q_NHD.shape[0]
  lam = jnp.asarray(r.integers(short[0], short[1] + 1, N))
  big = jnp.asarray(r.integers(long[0], long[1] + 1, N))
  d = pair_logits(enc, params, q_NHD, k_NHD, lam) - pair_logits(enc, params, q_NHD, k_NHD, big)
  # float64 for the statistics: a bfloat16 array's mean is summed in bfloat16
  return np.asarray(d, np.float64).ravel()


def random_pairs(n: int, head_dim: int, rho: float, seed: int):
  r = np.random.default_rng(seed)
  q = r.standard_normal((n, 1, head_dim)).astype(np.float32)
  k = rho * q + math.sqrt(1 - rho**2) * r.standard_normal((n, 1, head_dim)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(k)


def trained_pairs(layer: dict, n: int, seed: int):
  """n (q_i, k_j) pairs, i >= j, from every head of a layer: [n, H, D] each, in float32 (a
  bfloat16 model's raw q and k, exactly; re-encoded in float32)."""
  q, k = np.asarray(layer["q"], np.float32), np.asarray(layer["k"], np.float32)
  B, T, H, D = q.shape
  k = np.repeat(k, H // k.shape[2], axis=2)
  r = np.random.default_rng(seed)
  b, i = r.integers(0, B, n), r.integers(0, T, n)
  j = (r.random(n) * (i + 1)).astype(int)
  return jnp.asarray(q[b, i]), jnp.asarray(k[b, j])


def stats(d: np.ndarray) -> dict:
  return {"mean": float(d.mean()), "std": float(d.std()), "frac_positive": float((d > 0).mean()),
          "n": int(d.size)}


def run(c) -> dict:
  """results[interval][source][encoding] = stats over every pair (of every seed), with
  "seed_means" (one mean per seed) where trained runs of several seeds were read, and the
  pairs' histogram (density over bins shared by the panel's encodings)."""
  from experiments.probes import load

  pairs = {}   # source -> encoding -> [(enc, params, q, k), one per seed]
  for rho in c.rhos:
    for name in c.encodings:
      enc = enc_lib.get(name)
      params = enc.init(jax.random.key(0), enc_lib.Dims(c.head_dim, 1, 1, c.head_dim))
      pairs.setdefault(f"random_rho{rho}", {})[name] = [
          (enc, params, *random_pairs(c.num_pairs, c.head_dim, rho, c.seed))]
  if c.source_workdir:
    for name in c.encodings:
      for seed in c.seeds:
        for li, layer in enumerate(load.trained_layers(c, name, seed)[1]):
          per_head = max(1, c.num_pairs // (layer["q"].shape[2] * len(c.seeds)))
          pairs.setdefault(f"trained_layer{li}", {}).setdefault(name, []).append(
              (layer["enc"], layer["params"], *trained_pairs(layer, per_head, c.seed + li)))
  results = {}
  for label, short, long in c.intervals:
    iv = f"{label} [{short[0]},{short[1]}] vs [{long[0]},{long[1]}]"
    results[iv] = {}
    for source, by_name in pairs.items():
      panel, pooled = {}, {}
      for name, per_seed in by_name.items():
        ds = [deltas(enc, params, q, k, short=tuple(short), long=tuple(long), seed=c.seed + 1)
              for enc, params, q, k in per_seed]
        pooled[name] = np.concatenate(ds)
        panel[name] = stats(pooled[name])
        if len(ds) > 1:
          panel[name]["seed_means"] = [float(x.mean()) for x in ds]
      # one set of bins per panel, shared by its encodings: the README's plot is drawn from
      # results.json alone (experiments/probes/pages.py)
      edges = np.histogram_bin_edges(np.concatenate(list(pooled.values())), bins=HISTOGRAM_BINS)
      for name, d in pooled.items():
        density, _ = np.histogram(d, edges, density=True)
        panel[name]["histogram"] = {"edges": [round(float(x), 6) for x in edges],
                                    "density": [round(float(x), 6) for x in density]}
      results[iv][source] = panel
  return results


def write(c, results, out_dir: str, prov: dict) -> None:
  """results.json (its histograms binned) and provenance.json, then the README and its plot
  (results_pages, from those files)."""
  from experiments import results_pages
  from experiments import results_writers

  os.makedirs(out_dir, exist_ok=True)
  results_writers.save_results(out_dir, "distance_bias", results, c, prov)
  results_pages.write_page(out_dir)


def main(argv) -> None:
  del argv
  from experiments import results_writers

  started = time.time()
  c = _CONFIG.value
  results = run(c)
  print(json.dumps({iv: {source: {name: {k: v for k, v in s.items() if k != "histogram"}
                                  for name, s in by_name.items()}
                         for source, by_name in panel.items()}
                    for iv, panel in results.items()}, indent=1))
  if _RESULTS.value:
    write(c, results, _RESULTS.value, results_writers.provenance(
        sys.argv, time.time() - started, module="experiments.probes.distance_bias"))


if __name__ == "__main__":
  # Flags are defined only when run as a program, so the modules import side-effect free.
  _CONFIG = config_flags.DEFINE_config_file("config", None, "Probe config file[:arg].")
  _RESULTS = flags.DEFINE_string("results", None, "Write results.json/README.md/plots here.")
  flags.mark_flags_as_required(["config"])
  app.run(main)
