"""Sequence-parallel attention over the fast blockwise backend (impl="xla") inside shard_map.

The blockwise op's custom_vjp must not close over traced per-call inputs (segment ids,
kv_lengths): under shard_map, remat and nested vjps such closures leak tracers.
"""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _sp_helpers import inputs, out_and_grads, packed_segments  # noqa: E402

from jaxsys.core.mesh import make_mesh  # noqa: E402
from jaxsys.ops import attention, masks  # noqa: E402
from jaxsys.parallel import sequence_parallel_attention  # noqa: E402


@pytest.mark.parametrize("strategy,shape", [("hybrid", {"ring": 2, "ulysses": 4}),
                                            ("zigzag", {"ring": 4})])
def test_sp_with_xla_backend_matches_reference(strategy, shape):
  q, k, v, do = inputs(s=64)
  seg = packed_segments(1, 64)
  mesh = make_mesh(shape)
  sp = lambda q, k, v: sequence_parallel_attention(q, k, v, mesh=mesh, strategy=strategy,
                                                   mask=masks.Causal(), segment_ids=seg, impl="xla")
  ref = lambda q, k, v: attention(q, k, v, mask=masks.Causal(), segment_ids=seg, impl="reference")
  (o, g), (o_ref, g_ref) = out_and_grads(sp, q, k, v, do), out_and_grads(ref, q, k, v, do)
  assert float(jnp.abs(o - o_ref).max()) < 1e-5
  for a, b in zip(g, g_ref):
    assert float(jnp.abs(a - b).max()) < 1e-5


def test_xla_backend_under_remat_with_traced_lengths():
  q, k, v, _ = inputs(s=64)
  lens = jnp.array([50])
  f = lambda q, k, v: attention(q, k, v, mask=masks.Causal(), kv_lengths=lens, impl="xla").sum()
  g_remat = jax.grad(lambda q, k, v: jax.checkpoint(f)(q, k, v), argnums=(0, 1, 2))(q, k, v)
  r = lambda q, k, v: attention(q, k, v, mask=masks.Causal(), kv_lengths=lens, impl="reference").sum()
  g_ref = jax.grad(r, argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_remat, g_ref):
    assert float(jnp.abs(a - b).max()) < 1e-5
