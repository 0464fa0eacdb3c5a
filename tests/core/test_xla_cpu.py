"""jaxsys.core.xla_cpu: which flags are added when, and that XLA:CPU accepts them and computes the
same convolution gradients with them."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxsys.core import xla_cpu

_CONV = """
import json, jax, jax.numpy as jnp
x = jax.random.normal(jax.random.key(0), (2, 8, 8, 4))
w = jax.random.normal(jax.random.key(1), (3, 3, 4, 5))
f = lambda x, w: jnp.sum(jnp.sin(jax.lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                                              dimension_numbers=("NHWC", "HWIO", "NHWC"))))
gx, gw = jax.grad(f, argnums=(0, 1))(x, w)
print(json.dumps([gx.ravel().tolist(), gw.ravel().tolist()]))
"""


def test_flags_added_only_on_tested_versions_and_never_over_the_users(monkeypatch):
  monkeypatch.setattr(xla_cpu, "_jaxlib_version", lambda: xla_cpu.TESTED[0])
  assert xla_cpu.flags("") == [xla_cpu.CONVOLUTION_FLAG]
  assert xla_cpu.flags("--xla_force_host_platform_device_count=8") == [xla_cpu.CONVOLUTION_FLAG]
  assert xla_cpu.flags("--xla_cpu_experimental_ynn_fusion_type=dot") == []  # the user's choice stands
  monkeypatch.setattr(xla_cpu, "_jaxlib_version", lambda: (99, 0))  # unknown: XLA may not know the flag
  assert xla_cpu.flags("") == []
  monkeypatch.setattr(xla_cpu, "_jaxlib_version", lambda: None)
  assert xla_cpu.flags("") == []


def test_apply_changes_nothing_once_backends_exist(monkeypatch):
  jax.devices()  # this process's backends exist
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert xla_cpu.apply() is False
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def _conv_grads(xla_flags: str):
  """The convolution gradients of ``_CONV`` computed by a fresh process under ``xla_flags``."""
  env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _CONV], env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  return [np.asarray(g) for g in json.loads(out.stdout.strip().splitlines()[-1])]


@pytest.mark.skipif(not xla_cpu.flags(""), reason="this jaxlib is not one the flag was measured on")
def test_xla_accepts_the_flag_and_convolution_gradients_match():
  for flagged, plain in zip(_conv_grads(" ".join(xla_cpu.flags(""))), _conv_grads("")):
    np.testing.assert_allclose(flagged, plain, rtol=1e-4, atol=1e-4)
