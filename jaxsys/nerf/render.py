"""Volume compositing (NeRF quadrature; Max 1995) and image metrics.

For alphas ``a_s`` of a ray's samples (near -> far), transmittance
``T_s = prod_{k < s} (1 - a_k)`` and weights ``w_s = T_s a_s``; the pixel is
``C = sum_s w_s c_s + T_S * background`` (NeRF Eq. 3 with ``a_s = 1 - exp(-sigma_s delta_s)``).
It converges to the integral ``int T(t) sigma(t) c(t) dt + T(far) bg`` as the step shrinks
(tested against direct numerical integration).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxsys.core.errors import ShapeError

__all__ = ["alpha_weights", "composite", "psnr", "ssim"]


def alpha_weights(alpha):
  """``alpha [..., S] -> (weights [..., S], T_last [...])`` (exclusive cumulative product)."""
  one_minus = 1.0 - alpha
  trans = jnp.cumprod(jnp.concatenate([jnp.ones_like(alpha[..., :1]), one_minus[..., :-1]], -1), -1)
  return trans * alpha, trans[..., -1] * one_minus[..., -1]


def composite(weights, rgb, t_last, background):
  """``sum_s w_s rgb_s + T_last * background``: ``[R, S] x [R, S, 3] -> [R, 3]``."""
  if rgb.shape[:-1] != weights.shape:
    raise ShapeError(f"rgb {tuple(rgb.shape)} must be weights' shape {tuple(weights.shape)} + (3,)")
  return jnp.sum(weights[..., None] * rgb, -2) + t_last[..., None] * jnp.asarray(background)


def psnr(a, b):
  """Peak signal-to-noise ratio (dB) of images in [0, 1]."""
  return -10.0 * jnp.log10(jnp.mean((jnp.asarray(a) - jnp.asarray(b)) ** 2))


def ssim(a, b, *, window: int = 11, sigma: float = 1.5):
  """Mean SSIM (Wang et al. 2004) of two ``[H, W, C]`` images in [0, 1], Gaussian window."""
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  if a.shape != b.shape or a.ndim != 3:
    raise ShapeError(f"images must be equal [H, W, C], got {tuple(a.shape)} and {tuple(b.shape)}")
  x = jnp.arange(window) - (window - 1) / 2
  g = jnp.exp(-x**2 / (2 * sigma**2))
  g = g / g.sum()

  def blur(img):  # separable valid-mode filter over H then W, per channel
    img = jnp.apply_along_axis(lambda v: jnp.convolve(v, g, mode="valid"), 0, img)
    return jnp.apply_along_axis(lambda v: jnp.convolve(v, g, mode="valid"), 1, img)

  c1, c2 = 0.01**2, 0.03**2
  mu_a, mu_b = blur(a), blur(b)
  var_a = blur(a * a) - mu_a**2
  var_b = blur(b * b) - mu_b**2
  cov = blur(a * b) - mu_a * mu_b
  s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
  return jnp.mean(s)
