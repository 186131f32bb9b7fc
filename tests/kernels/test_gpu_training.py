"""What a researcher runs, on the GPU: a real-size bf16 model trained through the project's train
step with the PaTH kernels (.ci/gpu runs it first: the longest start first)."""
from __future__ import annotations

import jax
import pytest


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
class TestGPUTraining:
  """What a researcher runs: the 12-layer llama-style bf16 model (d_model 768, 12 heads x 64, or
  6 x 128 where the span forward runs; its far keys asked onto the Mosaic launch, the far dq and
  far dk/dv walks there by default, packed documents included) on the packed code corpus at
  T = 2048 through the project's train step, 20 steps."""

  steps = 20

  @pytest.mark.parametrize("encoding,head_dim,implementation", [
      ("path", 64, None), ("path_fox", 64, None), ("path", 128, "pallas:fwd_far=mosaic")])
  def test_bf16_model_trains(self, encoding, head_dim, implementation):
    import numpy as np
    from experiments import data, sharding, train
    from experiments.configs import base
    from posenc_jax import model as model_lib
    c = base.get_config()
    c.data.task, c.data.seq_len = "text", 2048
    c.train.update(steps=200, batch_size=8, learning_rate=1e-3, warmup_steps=5)
    mcfg = model_lib.ModelConfig(vocab_size=data.vocab_size(c.data), encoding=encoding,
                                 num_layers=12, d_model=768, num_heads=768 // head_dim,
                                 head_dim=head_dim, implementation=implementation,
                                 dtype="bfloat16")
    mesh = sharding.make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
    trainer = train.Trainer(mcfg, c.train, mesh)
    batches = data.make_train_iter(c.data, batch_size=8, seed=0)
    losses = []
    with jax.set_mesh(mesh):
      state = trainer.init_state(0)
      for _ in range(self.steps):
        state, metrics = trainer.train_step(state, trainer.put(next(batches)))
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"])), f"grad norm not finite: {metrics}"
    assert np.all(np.isfinite(losses)), losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
