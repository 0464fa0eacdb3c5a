"""Compositing against a direct numerical integral; grids, rays, energy counts, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.nerf import energy, grids, packing, rays, render

BOX = grids.Box((-1, -1, -1), (1, 1, 1))


def test_composite_matches_numerical_integral():
  """One ray through a Gaussian density blob with a colour ramp, white background:
  C = int_0^L T(t) sigma(t) c(t) dt + T(L) bg with T(t) = exp(-int_0^t sigma)."""
  L = 2.0
  sigma = lambda t: 3.0 * np.exp(-((t - 0.9) / 0.25) ** 2)  # noqa: E731
  color = lambda t: np.stack([t / L, 1 - t / L, 0.5 + 0 * t], -1)  # noqa: E731
  # Reference: fine trapezoid integration (independent of the quadrature under test).
  tt = np.linspace(0, L, 200_001)
  tau = np.concatenate([[0], np.cumsum(0.5 * (sigma(tt[1:]) + sigma(tt[:-1])) * np.diff(tt))])
  integrand = (np.exp(-tau) * sigma(tt))[:, None] * color(tt)
  want = np.trapezoid(integrand, tt, axis=0) + np.exp(-tau[-1])
  # Renderer: S samples at midpoints, alpha = 1 - exp(-sigma delta).
  S = 2048
  delta = L / S
  ts = (np.arange(S) + 0.5) * delta
  alpha = jnp.asarray(1 - np.exp(-sigma(ts) * delta))[None]
  w, t_last = render.alpha_weights(alpha)
  got = render.composite(w, jnp.asarray(color(ts))[None], t_last, 1.0)
  np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-4)
  assert float(w.sum() + t_last[0]) == pytest.approx(1.0, abs=1e-5)


def test_trilinear_is_exact_on_linear_fields():
  res = (5, 6, 7)
  pts_grid = grids.lattice_points(BOX, res)
  field = lambda p: 1 + 2 * p[..., 0] - p[..., 1] + 0.5 * p[..., 2]  # noqa: E731
  g = field(pts_grid)[..., None]
  pts = jnp.asarray(np.random.default_rng(0).uniform(-0.99, 0.99, (50, 3)), jnp.float32)
  interp = jax.jit(grids.trilinear, static_argnums=2)
  np.testing.assert_allclose(np.asarray(interp(g, pts, BOX))[:, 0], np.asarray(field(pts)), atol=1e-5)
  assert float(interp(g, jnp.array([[2.0, 0, 0]]), BOX)[0, 0]) == 0.0


def test_rays_sampling_and_box():
  o = jnp.array([[0.0, 0.0, 3.0], [5.0, 5.0, 5.0]])
  d = jnp.array([[0.0, 0.0, -1.0], [1.0, 0.0, 0.0]])
  t0, t1, hit = jax.jit(lambda a, b: rays.ray_box(a, b, BOX))(o, d)
  np.testing.assert_allclose(np.asarray(t0[0]), 2.0)
  np.testing.assert_allclose(np.asarray(t1[0]), 4.0)
  assert bool(hit[0]) and not bool(hit[1])
  s = jax.jit(lambda a, b: rays.sample_rays(a, b, BOX, step=0.5, num_samples=6))(o, d)
  np.testing.assert_array_equal(np.asarray(s.valid[0]), [1, 1, 1, 1, 0, 0])
  assert not np.asarray(s.valid[1]).any()
  assert rays.view_encoding(d).shape == (2, 27)


def test_occupancy_mask_dilates():
  a = jnp.zeros((5, 5, 5)).at[2, 2, 2].set(0.5)
  m = grids.occupancy_mask(a, 1e-3)
  assert int(m.sum()) == 27 and bool(m[1, 1, 1]) and not bool(m[0, 0, 0])


def test_energy_counts():
  dims = (39, 128, 128, 3)
  ann = energy.ann_ops(10, dims)
  assert ann.macs == 10 * (39 * 128 + 128 * 128 + 128 * 3) and ann.acs == 0
  snn = energy.snn_ops(10, dims, spikes=(500, 200))
  assert snn.macs == 10 * 39 * 128 and snn.acs == 500 * 128 + 200 * 3
  assert energy.energy_pj(snn) == pytest.approx(4.6 * snn.macs + 0.9 * snn.acs)
  with pytest.raises(InputError, match="spikes has 1 layers"):
    energy.snn_ops(10, dims, spikes=(1,))


def test_buckets():
  assert [packing.bucket(n) for n in (0, 1, 5, 8, 9)] == [1, 1, 8, 8, 16]
  valid = np.zeros((20, 40), bool)
  valid[3, 2:13] = True
  assert packing.plan(valid, "tcp") == (16, 8)
  assert packing.plan(valid, "tp") == (16, 20)


def test_bad_input_errors():
  with pytest.raises(ConfigError, match="must be < hi"):
    grids.Box((0, 0, 0), (1, -1, 1))
  o, d = jnp.zeros((4, 3)), jnp.ones((5, 3))
  with pytest.raises(InputError, match="ray batch sizes differ"):
    rays.sample_rays(o, d, BOX, step=0.1, num_samples=4)
  with pytest.raises(ShapeError, match=r"rays_o must be \[rays, 3\]"):
    rays.sample_rays(jnp.zeros((4, 2)), d[:4], BOX, step=0.1, num_samples=4)
  with pytest.raises(ShapeError, match="points must be"):
    grids.VoxelGrid(BOX, (4, 4, 4), 2)(jnp.zeros((3, 2)))
  with pytest.raises(ConfigError, match="resolution="):
    grids.VoxelGrid(BOX, (4, 1, 4), 2, rngs=nnx.Rngs(0))
