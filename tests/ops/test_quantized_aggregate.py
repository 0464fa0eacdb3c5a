"""quantized_aggregate (XLA path) equals dequantize-then-aggregate; plan reuse; errors."""

import jax
import jax.numpy as jnp
import jraph
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.ops import quantized_aggregate
from jaxsys.ops.quantized_agg import aggregate, plan_aggregation
from jaxsys.quant.packing import dequantize, pack_features


def make_case(n=40, f=19, e=150, signed=True, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, f)).astype(np.float32)
  x = x if signed else np.abs(x)
  bits = rng.integers(1, 9, n)
  qmax = np.maximum(2.0 ** (bits - 1) - 1, 1) if signed else 2.0 ** bits - 1
  pk = pack_features(x, bits, np.abs(x).max(1) / qmax, signed=signed)
  return pk, rng.integers(0, n, e).astype(np.int32), rng.integers(0, n, e).astype(np.int32)


@pytest.mark.parametrize("aggregation", ["sum", "mean", "gcn"])
def test_xla_equals_dequantize_then_aggregate(aggregation):
  pk, s, r = make_case(signed=aggregation != "mean")
  ref = aggregate(dequantize(pk), jnp.asarray(s), jnp.asarray(r), pk.num_nodes, aggregation)
  out = quantized_aggregate(pk, (s, r), aggregation=aggregation, impl="xla")
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  # Dense check of the weights: gcn = D^-1/2 (A + I) D^-1/2.
  if aggregation == "gcn":
    a = np.zeros((pk.num_nodes, pk.num_nodes))
    np.add.at(a, (r, s), 1.0)
    a += np.eye(pk.num_nodes)
    d = a.sum(1)
    dense = (a / np.sqrt(d)[:, None] / np.sqrt(d)[None, :]) @ np.asarray(dequantize(pk))
    np.testing.assert_allclose(out, dense, rtol=1e-4, atol=1e-4)


def test_graphs_tuple_and_jit_with_plan():
  pk, s, r = make_case(signed=False)
  g = jraph.GraphsTuple(nodes=np.zeros((pk.num_nodes, 1)), edges=None, senders=s, receivers=r,
                        n_node=np.array([pk.num_nodes]), n_edge=np.array([s.size]),
                        globals=None)
  plan = plan_aggregation(pk, g, "gcn")
  assert plan.num_edges == s.size + pk.num_nodes
  f = jax.jit(lambda p: quantized_aggregate(p, aggregation="gcn", plan=plan))
  np.testing.assert_allclose(f(pk), quantized_aggregate(pk, g, aggregation="gcn"), rtol=1e-6)


def test_errors():
  pk, s, r = make_case()
  with pytest.raises(ConfigError, match="aggregation"):
    quantized_aggregate(pk, (s, r), aggregation="max")
  with pytest.raises(ConfigError, match="impl"):
    quantized_aggregate(pk, (s, r), impl="cuda")
  with pytest.raises(InputError, match="receivers"):
    quantized_aggregate(pk, (s, np.full_like(r, 99)))
  with pytest.raises(InputError, match="plan"):
    jax.jit(lambda ss: quantized_aggregate(pk, (ss, r)))(s)
  plan = plan_aggregation(pk, (s, r), "sum")
  with pytest.raises(ConfigError, match="plan was built"):
    quantized_aggregate(pk, aggregation="gcn", plan=plan)
  if jax.default_backend() == "cpu":
    with pytest.raises(NotImplementedError, match="pallas_interpret"):
      quantized_aggregate(pk, (s, r), impl="pallas")


def test_ids_are_validated_before_the_cast():
  """Float ids are rejected (they were truncated), traced ids are checked via checkify."""
  pk, s, r = make_case(n=8, f=3, e=6)
  with pytest.raises(ShapeError, match=r"senders must be an integer array.*senders\[0\]=0.5"):
    quantized_aggregate(pk, (np.full(6, 0.5), r))
  with pytest.raises(InputError, match=r"receivers must lie in \[0, num_nodes=8\), got receivers\[0\]=4294967297"):
    plan_aggregation(pk, (s, np.full(6, 2**32 + 1)), "sum")
  from jaxsys.ops import checked
  x = jnp.ones((8, 3))
  f = jax.jit(lambda ss, rr: aggregate(x, ss, rr, 8))
  with pytest.raises(InputError, match=r"senders must lie in \[0, num_nodes=8\), got senders\[2\]=-1"):
    checked(f)(jnp.asarray(s).at[2].set(-1), jnp.asarray(r))
