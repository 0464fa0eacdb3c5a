"""The decoder on JAX's default (Explicit) meshes and on Auto meshes, with and without
``jax.set_mesh``: forward, backward and a cached decode step equal one device's, for the TP and
FSDP rules (``jaxsys.nn.explicit``: the forward runs on the mesh's Auto twin inside)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import jaxsys.models as M
from jaxsys.core.mesh import make_mesh
from jaxsys.decoding.cache import KVCache
from jaxsys.nn.layers import shard_params

CFG = M.DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=8, num_kv_heads=4, max_position_embeddings=64)
TOKENS = np.random.default_rng(0).integers(0, 128, (4, 12)).astype(np.int32)


def _loss(model, tokens):
  return jnp.mean(model(tokens) ** 2)


@pytest.fixture(scope="module")
def reference():
  model = M.random_model(CFG, seed=3)
  out = model(jnp.asarray(TOKENS))
  grads = nnx.to_pure_dict(nnx.grad(_loss)(model, jnp.asarray(TOKENS)))
  first = model(jnp.asarray(TOKENS), cache=KVCache.init(CFG, 4, 32))
  step = model(jnp.asarray(TOKENS[:, :1]), cache=first.cache).logits
  return out, grads, step


@pytest.mark.parametrize("kind,rules,with_set_mesh", [
    ("explicit", "tp", False), ("explicit", "tp", True), ("explicit", "fsdp", False),
    ("explicit", "fsdp", True), ("auto", "fsdp", False)])
def test_decoder_on_a_mesh_equals_one_device(reference, kind, rules, with_set_mesh):
  ref_out, ref_grads, ref_step = reference
  mesh = jax.make_mesh((4, 2), ("data", "model")) if kind == "explicit" else make_mesh({"data": 4, "model": 2})
  assert (set(mesh.axis_types) == {AxisType.Explicit}) == (kind == "explicit")
  model = M.random_model(CFG, seed=3)
  shard_params(model, mesh, rules)
  tokens = jax.device_put(TOKENS, jax.sharding.NamedSharding(mesh, jax.P("data")))
  ctx = jax.set_mesh(mesh) if with_set_mesh else contextlib.nullcontext()
  with ctx:
    out = model(tokens)
    first = model(tokens, cache=KVCache.init(CFG, 4, 32))
    step = model(tokens[:, :1], cache=first.cache).logits
    # JAX itself asks for jax.set_mesh around a traced function of Explicit arrays
    grads = nnx.grad(_loss)(model, tokens) if with_set_mesh or kind == "auto" else None
  np.testing.assert_allclose(out, ref_out, atol=2e-6)
  np.testing.assert_allclose(step, ref_step, atol=2e-6)
  if kind == "explicit":
    assert out.sharding.spec[0] == "data"  # the outputs are sharded like the batch
  if grads is not None:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                 nnx.to_pure_dict(grads), ref_grads)


@pytest.mark.parametrize("rules", ["tp", "fsdp"])
def test_layers_on_an_explicit_mesh_equal_one_device(rules):
  """Each layer on its own, parameters placed by the rules on jax.make_mesh's default mesh and
  the input batch split over "data", without jax.set_mesh: the same values as unplaced."""
  from jaxsys.nn import Attention, Embed, QuantLinear, RMSNorm, SwiGLU
  from jaxsys.nn.rope import RopeConfig
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  x = np.random.default_rng(1).normal(size=(4, 6, 64)).astype(np.float32)
  pos = np.broadcast_to(np.arange(6, dtype=np.int32), (4, 6))
  layers = {"attention": (lambda: Attention(64, 8, 4, 8, rope=RopeConfig(), rngs=nnx.Rngs(0)), (x, pos)),
            "swiglu": (lambda: SwiGLU(64, 128, rngs=nnx.Rngs(0)), (x,)),
            "rmsnorm": (lambda: RMSNorm(64), (x,)),
            "embed": (lambda: Embed(128, 64, rngs=nnx.Rngs(0)), (TOKENS[:, :6],)),
            "quant_linear": (lambda: QuantLinear(64, 32, rngs=nnx.Rngs(0)), (x,))}
  for name, (make, args) in layers.items():
    ref = make()(*[jnp.asarray(a) for a in args])
    layer = make()
    shard_params(layer, mesh, rules)
    placed = [jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.P("data"))) for a in args]
    np.testing.assert_allclose(layer(*placed), ref, atol=2e-6, err_msg=name)
