"""The layer library as a user meets it: every layer exported from ``jaxsys.nn`` with a documented
shape and example, and N-D ``[..., features]`` inputs giving the same rows as 2-D ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsys.nn
from jaxsys.graphs.dataset import make_graph

LAYERS = ["A2QConfig", "Attention", "DegreeEncoding", "Embed", "GCNConv", "GraphAttention", "LIF",
          "QuantGATConv", "QuantGCNConv", "QuantGINConv", "QuantLinear", "RMSNorm", "SpikingLinear",
          "SwiGLU"]


@pytest.mark.parametrize("name", LAYERS)
def test_every_layer_is_exported_and_documented(name):
  assert name in jaxsys.nn.__all__
  from jaxsys import nn
  obj = getattr(nn, name)
  if name != "A2QConfig":
    assert issubclass(obj, nnx.Module)
    assert "Example::" in obj.__doc__ and "[" in obj.__doc__, name  # a shape and an example


def test_lora_api_is_exported():
  from jaxsys import nn
  from jaxsys.nn import lora
  for name in ("apply_lora", "LoRAConfig", "LoRAParam", "LoRAWeight", "merge_lora", "lora_state",
               "load_lora_state", "trainable_filter"):
    assert name in nn.__all__ and getattr(nn, name) is getattr(lora, name), name


def _graph(n=6):
  s = np.array([0, 1, 2, 3, 4, 5, 0], np.int32)
  r = np.array([1, 2, 3, 4, 5, 0, 3], np.int32)
  return make_graph(np.zeros((n, 1), np.float32), s, r)


def _rows_match(layer, x, call=None):
  """``layer`` on ``x [2, 3, ..., f]`` equals ``layer`` on each ``x[i, j]`` slice."""
  call = call or layer
  y = call(x)
  assert y.shape[:2] == x.shape[:2]
  for i in range(x.shape[0]):
    np.testing.assert_allclose(y[i, 1], call(x[i, 1]), atol=1e-5, rtol=1e-5)
  return y


def test_layers_take_nd_inputs():
  rngs = nnx.Rngs(0)
  x = jax.random.normal(jax.random.key(0), (2, 3, 5, 16))
  from jaxsys.nn import RMSNorm, SwiGLU, QuantLinear, A2QConfig, Embed
  _rows_match(RMSNorm(16), x)
  _rows_match(SwiGLU(16, 32, rngs=rngs), x)
  _rows_match(QuantLinear(16, 8, A2QConfig(), rngs=rngs), x)  # was 2-D only (einsum 'nf')
  assert QuantLinear(16, 8, rngs=rngs)(x).shape == (2, 3, 5, 8)
  emb = Embed(11, 16, rngs=rngs)
  tok = jnp.arange(2 * 3 * 5).reshape(2, 3, 5) % 11
  assert emb(tok).shape == (2, 3, 5, 16) and emb.attend(emb(tok)).shape == (2, 3, 5, 11)


def test_attention_takes_leading_batch_axes():
  from jaxsys.nn import Attention, RopeConfig
  attn = Attention(16, 4, 2, 4, rope=RopeConfig(), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 3, 5, 16))
  pos = jnp.broadcast_to(jnp.arange(5), (2, 3, 5))
  y = attn(x, pos)                          # no cache passed: no cache returned
  assert y.shape == x.shape
  np.testing.assert_allclose(y[1], attn(x[1], pos[1]), atol=1e-5)


def test_attention_per_call_mask():
  """A per-call mask is AND'ed with the layer's causal mask: lazy, boolean and additive agree."""
  from jaxsys.nn import Attention, RopeConfig
  from jaxsys.ops import masks as M
  attn = Attention(16, 4, 2, 4, rope=RopeConfig(), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 6, 16))
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  lazy = attn(x, pos, mask=M.Local(3))
  dense = jnp.asarray(M.Local(3).dense(6, 6))[None]                 # [1, 1, 6, 6]
  np.testing.assert_allclose(attn(x, pos, mask=dense), lazy, atol=1e-5)
  additive = jnp.where(dense, 0.0, -jnp.inf)                        # [1, 1, 6, 6]
  np.testing.assert_allclose(attn(x, pos, mask=additive), lazy, atol=1e-5)
  assert not np.allclose(lazy, attn(x, pos), atol=1e-3)
  full = jnp.ones((2, 1, 6, 6), bool)                               # causal still applies
  np.testing.assert_allclose(attn(x, pos, mask=full), attn(x, pos), atol=1e-6)


def test_graph_layers_take_leading_axes():
  from jaxsys.nn import GCNConv, GraphAttention, graph_inputs
  inputs = graph_inputs(_graph())
  x = jax.random.normal(jax.random.key(2), (2, 3, 6, 8))
  ga = GraphAttention(8, 2, rngs=nnx.Rngs(0))
  for mode in ("sparse", "dense"):
    _rows_match(ga, x, lambda t: ga(t, inputs, mode=mode))
  _rows_match(GCNConv(8, 4, rngs=nnx.Rngs(0)), x, lambda t: GCNConv(8, 4, rngs=nnx.Rngs(0))(t, inputs))


def test_dtype_and_logical_axes():
  """bf16 compute with f32 parameters, and every parameter named for the rules table."""
  from jaxsys.nn import GraphAttention, QuantLinear, graph_inputs
  ga = GraphAttention(8, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  ql = QuantLinear(8, 4, None, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jnp.ones((6, 8))
  assert ga(x, graph_inputs(_graph())).dtype == jnp.bfloat16
  assert ql(x).dtype == jnp.bfloat16 and ql.kernel[...].dtype == jnp.bfloat16
  for module in (ga, ql):
    for path, var in jax.tree_util.tree_leaves_with_path(
        nnx.state(module, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)):
      assert var.get_metadata().get("logical_axes"), path


def test_bad_inputs_name_the_shape():
  from jaxsys.core.errors import ShapeError
  from jaxsys.nn import QuantLinear, RMSNorm
  with pytest.raises(ShapeError, match=r"\[\.\.\., 8\]"):
    QuantLinear(8, 4, rngs=nnx.Rngs(0))(jnp.ones((2, 5)))
  with pytest.raises(ShapeError, match="end in 8 features"):
    RMSNorm(8)(jnp.ones((2, 5)))
  with pytest.raises(TypeError):
    RMSNorm(8, rngs=nnx.Rngs(0))  # nothing takes arguments it ignores

