"""End-to-end smoke test of every paper-reproduction experiment at its runlocal size.

Each experiment's config is run through the same code path as its committed command
(experiments.sweeps.run_sweep + results_pages.write_results, the probes' run + write), with one
or two encodings to keep it short; the probes read a length_extrapolation checkpoint
trained here. Besides "it runs", it checks the results files' contracts and two facts the
probes must get right: attention mass sums to 1 and RoPE's route transport is
route-independent (first moment exactly 1). Not marked slow: issue 5 asks that CI runs every
experiment's local switch.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from experiments import results_pages
from experiments import sweeps

PROV = {"command": "pytest", "machine": "test", "jax": "-", "date": "-", "wall_time_s": 0,
        "train_time_s": 0}


def _sweep(name: str, arg: str, workdir: str, out: str, *, seeds=None) -> dict:
  mod = __import__(f"experiments.configs.{name}", fromlist=["get_config"])
  config = mod.get_config(arg)
  if seeds is not None:   # runlocal trains one seed
    config.sweep.seeds = tuple(range(seeds))
  summaries = sweeps.run_sweep(config, workdir, log=lambda *_: None)
  results_pages.write_results(config.sweep.experiment, summaries, config, out, PROV)
  for f in ("results.json", "README.md"):
    assert os.path.getsize(os.path.join(out, f)) > 0
  assert any(f.endswith(".png") for f in os.listdir(out))
  with open(os.path.join(out, "results.json")) as f:
    return json.load(f)


def test_synthetic_experiments(tmp_path):
  r = _sweep("flipflop", "runlocal,encodings=rope+path", str(tmp_path / "ff"),
             str(tmp_path / "ffr"))
  assert set(r) == {"rope", "path"}
  assert all(0 <= r[n][f"{s}_error"] <= 1 for n in r for s in ("id", "sparse", "dense"))
  r = _sweep("word_problem", "runlocal,encodings=path", str(tmp_path / "wp"), str(tmp_path / "wpr"))
  assert 0 <= r["A5"]["accuracy"]["path"]["1"] <= 1
  r = _sweep("mqrar", "runlocal,encodings=fox", str(tmp_path / "mq"), str(tmp_path / "mqr"))
  assert 0 <= r["accuracy"]["fox"]["2"] <= 1


def test_length_extrapolation_and_probes(tmp_path):
  from experiments.configs import distance_bias as db_config
  from experiments.configs import mixing_window as mw_config
  from experiments.probes import distance_bias
  from experiments.probes import mixing_window

  wd = str(tmp_path / "le")
  r = _sweep("length_extrapolation", "runlocal,encodings=rope+path", wd, str(tmp_path / "ler"),
             seeds=2)
  assert r["train_len"] == 16 and set(r["encodings"]["rope"]) == {"16", "32", "64"}
  assert all(np.isfinite(v) and v > 1 for e in r["encodings"].values() for v in e.values())

  c = db_config.get_config(
      f"runlocal,encodings=rope,seeds=2,source_workdir={wd},source_arg=runlocal")
  res = distance_bias.run(c)
  distance_bias.write(c, res, str(tmp_path / "db"), PROV)
  paper = res["paper [0,100] vs [10000,10100]"]
  assert set(paper) == {"random_rho0.0", "random_rho0.5", "trained_layer0", "trained_layer1"}
  # Matching random content at short range scores higher than at 10^4 (RoPE's decay).
  assert paper["random_rho0.5"]["rope"]["mean"] > 0.3
  # Two seeds' trained runs: pooled pairs, and each seed's own mean (different models).
  seed_means = paper["trained_layer0"]["rope"]["seed_means"]
  assert len(seed_means) == 2 and seed_means[0] != seed_means[1]
  np.testing.assert_allclose(np.mean(seed_means), paper["trained_layer0"]["rope"]["mean"],
                             rtol=1e-5)
  # The histograms are binned into results.json, and the README's plot is drawn from them.
  h = paper["random_rho0.5"]["rope"]["histogram"]
  assert len(h["edges"]) == distance_bias.HISTOGRAM_BINS + 1
  np.testing.assert_allclose(np.sum(np.diff(h["edges"]) * np.asarray(h["density"])), 1.0,
                             rtol=1e-4)
  assert (tmp_path / "db" / "histograms.png").stat().st_size > 10_000
  assert "![histograms](histograms.png)" in (tmp_path / "db" / "README.md").read_text()

  c = mw_config.get_config(
      f"runlocal,encodings=rope+path,seeds=2,source_workdir={wd},source_arg=runlocal")
  res = mixing_window.run(c)
  # the seed average of each statistic, each seed's own kept
  per_seed = res["path"]["per_seed"]
  assert len(per_seed) == 2
  np.testing.assert_allclose(
      res["path"]["cancellation_plain"],
      np.mean([p["cancellation_plain"] for p in per_seed]), rtol=1e-12)
  mixing_window.write(c, res, str(tmp_path / "mw"), PROV)
  for name in ("rope", "path"):
    assert abs(sum(res[name]["attention_mass"].values()) - 1) < 1e-4
    assert 0 < res[name]["cancellation_plain"] <= 1 + 1e-6
  # RoPE transports every route of length r by the same rotation: ||E[T]|| = 1.
  np.testing.assert_allclose(list(res["rope"]["first_moment_spectral"].values()), 1.0, atol=1e-6)
  assert all(0 < v <= 1 + 1e-6 for v in res["path"]["first_moment_spectral"].values())


@pytest.mark.parametrize("name", ["rope", "tapa"])
def test_pair_logits_match_the_attention_logits(name, key):
  """distance_bias.pair_logits(q_i, k_0, d=i) equals the logit the encoding attends with."""
  import jax
  import jax.numpy as jnp

  from experiments.probes import distance_bias
  from posenc_jax import encodings
  from posenc_jax import tapa

  T, D = 37, 16
  kq, kk = jax.random.split(key)
  q, k = jax.random.normal(kq, (1, T, 1, D)), jax.random.normal(kk, (1, T, 1, D))
  enc = encodings.get(name)
  params = enc.init(jax.random.key(0), encodings.Dims(D, 1, 1, D))
  pos = jnp.arange(T)[None]
  prep = enc.prepare(params, x=jnp.zeros((1, T, 1)), q=q, k=k, v=k, positions=pos,
                     segment_ids=None, tokens=jnp.zeros((1, T), jnp.int32), rng=None, train=False)
  if name == "rope":
    full = jnp.einsum("bqhd,bkhd->bhqk", prep.q, prep.k)[0, 0] / np.sqrt(D)
  else:
    i = prep.inputs
    parts = tapa._parts(q, k, i["theta"])
    dpow = tapa.distance_power(tapa._dist(jnp.arange(T), jnp.arange(T)), i["alpha"])
    full = tapa._logits(*parts, dpow, i["linear_phase"])[0, 0]
  d = jnp.arange(T)
  got = distance_bias.pair_logits(enc, params, q[0], jnp.broadcast_to(k[0, 0], (T, 1, D)), d)
  np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(full[:, 0]), rtol=1e-4, atol=1e-5)


def test_path_route_transport_is_the_householder_product():
  """mixing_window's P_j(r) = H_{j+r} ... H_{j+1}, from an explicit product."""
  from experiments.probes import mixing_window
  from posenc_jax import encodings

  r_ = np.random.default_rng(0)
  B, T, K, D = 1, 9, 2, 4
  w = r_.standard_normal((B, T, K, D))
  w /= np.linalg.norm(w, axis=-1, keepdims=True)
  beta = 2 * r_.random((B, T, K))
  z = np.zeros((B, T, K, D))
  prep = encodings.Prepared("path", z, z, z, {"w": w, "beta": beta})
  tr = mixing_window._Transport({"prep": prep})
  for _ in range(4):
    tr.step()
  j, k = 2, 1
  want = np.eye(D)
  for t in range(j + 1, j + 5):
    want = (np.eye(D) - beta[0, t, k] * np.outer(w[0, t, k], w[0, t, k])) @ want
  np.testing.assert_allclose(tr.P[0, j, k], want, atol=1e-12)
  v = r_.standard_normal((B, T, K, D))
  np.testing.assert_allclose(tr.apply(v)[0, j, k], want @ v[0, j, k], atol=1e-12)


@pytest.mark.parametrize("name", ["acc_rot_random", "acc_rot_learned"])
def test_rotary_transported_sums_in_closed_form_match_the_route_walk(name, key):
  """mixing_window's closed form for a rotary transport (R(phi_i) sum_j a_ij R(-phi_j) v_j, and
  each radius' mean route) equals walking every route token by token, on an accumulated
  rotation's own phases, random causal attention weights and GQA values."""
  import jax
  import jax.numpy as jnp

  from experiments.probes import mixing_window
  from posenc_jax import encodings

  B, T, H, K, D = 2, 23, 4, 2, 8
  ks = jax.random.split(key, 4)
  q = jax.random.normal(ks[0], (B, T, H, D))
  k, v = jax.random.normal(ks[1], (B, T, K, D)), jax.random.normal(ks[2], (B, T, K, D))
  enc = encodings.get(name)
  params = enc.init(ks[3], encodings.Dims(H * D, H, K, D))
  tokens = jax.random.randint(ks[3], (B, T), 0, 256)   # learned angles are per token
  kw = dict(k=k, v=v, x=jnp.zeros((B, T, 1)), tokens=tokens,
            positions=jnp.broadcast_to(jnp.arange(T), (B, T)), segment_ids=None, rng=None,
            train=False)
  layer = {"prep": enc.prepare(params, q=q, **kw), "q": q, "enc": enc, "params": params,
           "prep_kwargs": kw}
  logits = np.random.default_rng(0).standard_normal((B, H, T, T))
  a = np.where(np.tril(np.ones((T, T), bool)), np.exp(logits), 0.0)
  a /= a.sum(-1, keepdims=True)
  v64, radii = np.asarray(v, np.float64), [1, 2, 4, 8, 16]
  walked, m_walked = mixing_window.transported_sums_by_routes(layer, a, v64, radii)
  closed, m_closed = mixing_window.transported_sums_by_phases(
      mixing_window.rotation_phases(layer)[:, :, :1], a, v64, radii)
  np.testing.assert_allclose(closed, walked, rtol=1e-10, atol=1e-12)
  assert m_closed.keys() == m_walked.keys() == set(radii)
  for r in radii:
    np.testing.assert_allclose(m_closed[r], m_walked[r], rtol=1e-10)
  assert min(m[1] for m in m_walked.values()) < 0.99   # the routes do differ: not RoPE


def test_distance_bias_statistics_of_a_bfloat16_model_are_float():
  """A bfloat16 model's q and k give the statistics of the same values held in float32: the
  pairs are re-encoded in float32 and the deltas summed in float64. (The GPU models' first
  probe run summed bfloat16 deltas: its pooled means were off by half.)"""
  import jax.numpy as jnp

  from experiments.probes import distance_bias
  from posenc_jax import encodings

  rng = np.random.default_rng(0)
  shared = rng.standard_normal((1, 1, 2, 16))     # content every q and k share: a real bias
  q = (shared + 0.5 * rng.standard_normal((4, 256, 2, 16))).astype(jnp.bfloat16)
  k = (shared + 0.5 * rng.standard_normal((4, 256, 2, 16))).astype(jnp.bfloat16)
  enc = encodings.get("rope")
  params = enc.init(None, encodings.Dims(16, 2, 2, 16))
  got, want = [
      distance_bias.stats(distance_bias.deltas(
          enc, params, *distance_bias.trained_pairs({"q": q.astype(dt), "k": k.astype(dt)},
                                                    200_000, seed=0),
          short=(0, 100), long=(10000, 10100), seed=1))
      for dt in (jnp.bfloat16, np.float32)]
  assert got["n"] == want["n"] == 400_000
  assert want["mean"] > 0.3
  np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-9)
  np.testing.assert_allclose(got["std"], want["std"], rtol=1e-9)
