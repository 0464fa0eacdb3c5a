"""SpikingNeRF model: TP == TCP for an ANN colour net (time order does not matter), the SNN's
packings differ only through time, training lowers the loss, bad input."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.data.scenes import make_scene, render_dataset
from jaxsys.models.nerf import spiking_nerf as M
from jaxsys.nerf import packing
from jaxsys.nerf.grids import Box

CFG = dict(resolution=8, width=16, stepsize=1.0)


@pytest.fixture(scope="module")
def data():
  return render_dataset(make_scene(0), num_views=5, num_test=1, size=8, seed=0)


def _model(neuron, seed=0):
  m = M.SpikingNeRF(M.SpikingNeRFConfig(neuron=neuron, **CFG), rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  m.density.grid[...] = jnp.asarray(rng.normal(0, 3, m.density.grid.shape), jnp.float32)
  m.k0.grid[...] = jnp.asarray(rng.normal(0, 1, m.k0.grid.shape), jnp.float32)
  return m


def _renders(m, o, d, modes):
  valid = np.asarray(M.sample_mask(m, o, d))
  out = {}
  for mode in modes:
    state, _, render_fn = M.renderer(m, mode)   # jitted: one compile, not op by op
    out[mode] = render_fn(state, o, d, *packing.plan(valid, mode))
  return out


def test_tp_equals_tcp_for_ann(data):
  train, _ = data
  o, d = jnp.asarray(train.rays_o[0].reshape(-1, 3)), jnp.asarray(train.rays_d[0].reshape(-1, 3))
  m = _model("relu")
  outs = _renders(m, o, d, ("tp", "tcp"))
  assert 0 < int(outs["tcp"].num_points) == int(outs["tp"].num_points)
  np.testing.assert_allclose(np.asarray(outs["tp"].rgb), np.asarray(outs["tcp"].rgb), atol=1e-6)
  # TCP needs the smaller tensor (exact sizes, before bucketing).
  valid = np.asarray(outs["tcp"].valid)
  (t_tcp, r_tcp), (t_tp, r_tp) = packing.pack_sizes(valid, "tcp"), packing.pack_sizes(valid, "tp")
  assert t_tcp * r_tcp < t_tp * r_tp
  # The SNN's membrane sees the gaps: TP and TCP renders differ, both finite with spikes.
  s = _model("lif")
  s.mlp.hidden[1].linear.kernel[...] *= 6.0   # so that the second LIF layer fires too
  snn = _renders(s, o, d, ("tp", "tcp"))
  assert all(np.isfinite(np.asarray(v.rgb)).all() for v in snn.values())
  assert float(snn["tcp"].spikes[0]) > 0 and float(snn["tcp"].spikes[1]) > 0
  assert not np.allclose(np.asarray(snn["tp"].rgb), np.asarray(snn["tcp"].rgb))


def test_fit_lowers_loss(data):
  train, _ = data
  m = M.SpikingNeRF(M.SpikingNeRFConfig(neuron="plif", **CFG), rngs=nnx.Rngs(0))
  losses = M.fit(m, train, steps=8, batch_rays=64, mode="tcp", log_every=1)
  assert losses[-1] < losses[0]
  stats = M.render_views(m, train, mode="tcp")
  assert stats.images.shape == train.images.shape and len(stats.spikes) == 2


def test_coarse_stage_mask(data):
  train, _ = data
  c = M.CoarseGrids(M.SpikingNeRFConfig(**CFG), resolution=6)
  losses = M.fit(c, train, steps=6, batch_rays=64, log_every=1)
  assert losses[-1] < losses[0]
  mask = M.coarse_mask(c)
  assert mask.shape == (6, 6, 6) and mask.dtype == bool
  fine = M.SpikingNeRF(M.SpikingNeRFConfig(**CFG), mask=mask, rngs=nnx.Rngs(0))
  M.init_from_coarse(fine, c)
  assert np.isfinite(np.asarray(fine.density.grid[...])).all()


def test_bad_input():
  with pytest.raises(ConfigError, match="neuron='tanh' must be one of"):
    M.SpikingNeRFConfig(neuron="tanh")
  with pytest.raises(ConfigError, match="must be < hi"):
    M.SpikingNeRFConfig(box=Box((1, 0, 0), (0, 1, 1)))
  m = M.SpikingNeRF(M.SpikingNeRFConfig(resolution=2, width=2, neuron="relu"), rngs=nnx.Rngs(0))
  with pytest.raises(InputError, match="ray batch sizes differ"):
    M.render(m, jnp.zeros((4, 3)), jnp.ones((3, 3)), mode="dense")
  with pytest.raises(ConfigError, match="needs max_len"):
    M.render(m, jnp.zeros((4, 3)), jnp.ones((4, 3)), mode="tcp")
