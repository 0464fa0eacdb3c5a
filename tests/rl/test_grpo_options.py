"""GRPO objective options (asymmetric clip, dual-clip, token-mean) against hand-computed losses."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.rl import grpo


def _obj(logp, old, mask, adv, **kw):
  kw = {"clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0, **kw}
  loss, aux = grpo.policy_objective(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(logp),
                                    jnp.asarray(mask), jnp.asarray(adv), **kw)
  return float(loss), aux


# Two responses: row 0 has 2 valid tokens, row 1 has 1 (its 2nd token is padding).
MASK = np.array([[1.0, 1.0], [1.0, 0.0]], np.float32)
ADV = np.array([1.0, -1.0], np.float32)


def test_asymmetric_clip_high_side():
  # ratio 1.25 on every token: clipped to 1.2 with clip_high=0.2, unclipped with clip_high=0.3.
  old = np.zeros((2, 2), np.float32)
  logp = np.full((2, 2), np.log(1.25), np.float32)
  adv = np.array([1.0, 1.0], np.float32)
  lo, _ = _obj(logp, old, MASK, adv, clip_high=0.2)
  hi, aux = _obj(logp, old, MASK, adv, clip_high=0.3)
  np.testing.assert_allclose(lo, -1.2, rtol=1e-6)
  np.testing.assert_allclose(hi, -1.25, rtol=1e-6)
  assert float(aux["clip_frac"]) == 0.0


def test_dual_clip_bounds_negative_advantages():
  # ratio e^2 ~ 7.39 with A = -1: plain min gives -7.39; dual-clip 3 bounds it at -3.
  old = np.zeros((2, 2), np.float32)
  logp = np.full((2, 2), 2.0, np.float32)
  adv = np.array([-1.0, -1.0], np.float32)
  plain, _ = _obj(logp, old, MASK, adv)
  dual, _ = _obj(logp, old, MASK, adv, dual_clip=3.0)
  np.testing.assert_allclose(plain, np.exp(2.0), rtol=1e-6)
  np.testing.assert_allclose(dual, 3.0, rtol=1e-6)
  # positive advantages are untouched by the dual clip
  pos, _ = _obj(logp, old, MASK, -adv, dual_clip=3.0)
  np.testing.assert_allclose(pos, -1.2, rtol=1e-6)


def test_token_mean_vs_seq_mean():
  # ratio 1: per-token objective = A. seq-mean: mean(1, -1) = 0; token-mean: (1 + 1 - 1) / 3.
  z = np.zeros((2, 2), np.float32)
  seq, _ = _obj(z, z, MASK, ADV)
  tok, _ = _obj(z, z, MASK, ADV, loss_agg="token-mean")
  np.testing.assert_allclose(seq, 0.0, atol=1e-7)
  np.testing.assert_allclose(tok, -1.0 / 3.0, rtol=1e-6)


def test_k3_kl_term():
  z = np.zeros((2, 2), np.float32)
  ref = np.full((2, 2), 0.5, np.float32)  # log pi_ref - log pi = 0.5
  loss, aux = grpo.policy_objective(jnp.asarray(z), jnp.asarray(z), jnp.asarray(ref), jnp.asarray(MASK),
                                    jnp.asarray(ADV), clip_low=0.2, clip_high=0.3, kl_coef=1e-2,
                                    loss_agg="token-mean")
  k3 = np.exp(0.5) - 0.5 - 1
  np.testing.assert_allclose(float(aux["kl"]), k3, rtol=1e-5)
  np.testing.assert_allclose(float(loss), -(1.0 / 3.0 - 1e-2 * k3), rtol=1e-5)


def test_defaults_unchanged_and_config_checks():
  c = grpo.GRPOConfig()
  assert c.objective_kwargs() == dict(clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=0.02,
                                      loss_agg="seq-mean", norm_length=None)
  assert grpo.GRPOConfig(clip_low=0.2, clip_high=0.3).clip_range == (0.2, 0.3)
  with pytest.raises(ConfigError, match="dual_clip"):
    grpo.GRPOConfig(dual_clip=0.5)
  with pytest.raises(ConfigError, match="loss_agg"):
    grpo.GRPOConfig(loss_agg="sum")
  with pytest.raises(ConfigError, match="clip_high"):
    grpo.GRPOConfig(clip_high=1.5)
