"""The one op dispatcher: fallback order, errors listing the reasons, one error type for a bad impl."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core import dispatch
from jaxsys.core.dispatch import Dispatcher, ImplementationError
from jaxsys.core.errors import ConfigError, JaxsysError


def _table(calls, fails):
  """A fake op: each implementation records its call, or raises NotImplementedError(reason)."""
  def impl(name):
    def run(x):
      calls.append(name)
      if name in fails:
        raise NotImplementedError(fails[name])
      return name, x
    return run
  return Dispatcher("fake_op", {n: impl(n) for n in ("xla", "pallas", "pallas_interpret")})


# backend, impl, failing implementations -> expected (served by, tried in order) or error reasons
CASES = [
    ("cpu", "auto", {}, ("xla", ["xla"])),
    ("gpu", "auto", {}, ("pallas", ["pallas"])),
    ("tpu", "auto", {}, ("pallas", ["pallas"])),
    ("gpu", "auto", {"pallas": "no kernel for this mask"}, ("xla", ["pallas", "xla"])),
    ("cpu", "pallas_interpret", {}, ("pallas_interpret", ["pallas_interpret"])),
    ("cpu", "xla", {"pallas": "unused"}, ("xla", ["xla"])),
    ("gpu", "auto", {"pallas": "needs block 128", "xla": "too long"},
     {"pallas": "needs block 128", "xla": "too long"}),
    ("cpu", "pallas", {"pallas": "compiles for GPU"}, {"pallas": "compiles for GPU"}),  # explicit: no fallback
    ("cpu", "auto", {"xla": "int8 pages"}, {"xla": "int8 pages"}),  # CPU never tries pallas
]


@pytest.mark.parametrize("backend,impl,fails,expected", CASES)
def test_dispatch_table(monkeypatch, backend, impl, fails, expected):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  calls = []
  op = _table(calls, fails)
  if isinstance(expected, tuple):
    assert op(impl, 7) == (expected[0], 7)
    assert calls == expected[1]
    return
  with pytest.raises(ImplementationError) as info:
    op(impl, 7)
  assert info.value.reasons == expected and list(calls) == list(expected)
  for name, why in expected.items():  # one error, every reason listed
    assert f"{name}: {why}" in str(info.value)
  assert isinstance(info.value, NotImplementedError) and isinstance(info.value, JaxsysError)


def test_bad_impl_name_is_a_config_error_listing_the_choices():
  op = _table([], {})
  with pytest.raises(ConfigError, match=r"impl='cuda' must be one of \('auto', 'xla', 'pallas', 'pallas_interpret'\)"):
    op("cuda", 1)


def test_string_entries_import_on_first_use_and_import_errors_propagate():
  op = Dispatcher("lazy_op", {"xla": "jaxsys.ops.merge:merge_lse", "pallas": "jaxsys.no_such_module:f"})
  from jaxsys.ops.merge import merge_lse
  assert op.get("xla") is merge_lse
  with pytest.raises(ModuleNotFoundError):  # a broken backend is never silently replaced
    op.get("pallas")


def _bad_impl_calls():
  """Every public op called with impl="cuda" on otherwise valid (tiny) inputs."""
  from jaxsys.ops import attention, graph_attn, paged_attention, quantized_agg
  from jaxsys.quant.packing import pack_features
  from jaxsys.serving import page_select
  q4 = jnp.zeros((1, 4, 1, 8))
  qn = jnp.zeros((4, 1, 8))
  s, r = np.array([0, 1]), np.array([1, 2])
  tiles = graph_attn.GraphTiles(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones((1, 4, 4), bool))
  kp = jnp.zeros((2, 1, 4, 8))
  pages = jnp.zeros((1, 1, 2), jnp.int32)
  pk = pack_features(np.ones((4, 2), np.float32), np.full(4, 4), np.ones(4), signed=False)
  z = jnp.zeros((1, 1, 2, 8))
  return {
      "attention": lambda impl: attention(q4, q4, q4, impl=impl),
      "sparse_graph_attention": lambda impl: graph_attn.sparse_graph_attention(qn, qn, qn, s, r, impl=impl),
      "tile_graph_attention": lambda impl: graph_attn.tile_graph_attention(qn, qn, qn, tiles, impl=impl),
      "paged_decode_attention": lambda impl: paged_attention.paged_decode_attention(
          jnp.zeros((1, 1, 8)), kp, kp, pages, pages, jnp.ones(1, jnp.int32), impl=impl),
      "quantized_aggregate": lambda impl: quantized_agg.quantized_aggregate(pk, (s, r), impl=impl),
      "page_scores": lambda impl: page_select.page_scores(
          jnp.zeros((1, 1, 8)), z, z, jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32),
          page_size=8, logical_page_size=4, impl=impl),
  }


def test_every_op_rejects_a_bad_impl_with_config_error_and_explains_pallas_on_cpu():
  for op, call in _bad_impl_calls().items():
    with pytest.raises(ConfigError, match="impl='cuda' must be one of"):
      call("cuda")
    if jax.default_backend() == "cpu":
      with pytest.raises(ImplementationError, match=rf"no {op} implementation could serve this call \(pallas: "):
        call("pallas")


def test_auto_falls_back_to_xla_when_the_kernel_cannot_serve(monkeypatch):
  """On a GPU, int8 pages are beyond the Pallas decode kernel: auto now falls back to xla
  (before, auto picked pallas and raised)."""
  from jaxsys.ops.paged_attention import paged_decode_attention
  rng = np.random.default_rng(0)
  kp = jnp.asarray(rng.integers(-100, 100, (3, 1, 4, 8)), jnp.int8)
  sc = jnp.asarray(rng.uniform(0.01, 0.02, (3, 1, 4)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((1, 2, 8)), jnp.float32)
  idx, num = jnp.asarray([[[2, 0]]], jnp.int32), jnp.asarray([[[0, 1]]], jnp.int32)
  args = (q, kp, kp, idx, num, jnp.asarray([7], jnp.int32))
  ref = paged_decode_attention(*args, k_scales=sc, v_scales=sc, impl="xla")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert dispatch.auto_order() == ("pallas", "xla")
  out = paged_decode_attention(*args, k_scales=sc, v_scales=sc)
  np.testing.assert_array_equal(out, ref)


def test_public_names_are_the_functions_whatever_the_import_order():
  import importlib

  import jaxsys.ops as ops
  for module in ("graph_attn", "quantized_agg", "paged_attention", "merge", "ids", "attention.api",
                 "attention.xla", "attention.pallas", "attention.reference"):
    importlib.import_module(f"jaxsys.ops.{module}")
  for _ in range(2):
    from jaxsys.ops import attention, graph_attention, quantized_aggregate
    for name, fn in (("attention", attention), ("graph_attention", graph_attention),
                     ("quantized_aggregate", quantized_aggregate)):
      assert callable(fn) and fn.__name__ == name and getattr(ops, name) is fn
  assert ops.graph_attn.graph_attention is graph_attention
  assert not callable(ops.quantized_agg)  # a plain module


def test_kernels_import_nothing_from_jaxsys():
  import pallas_kernels
  from jaxsys.core import errors
  from pallas_kernels import errors as kernel_errors
  for path in pathlib.Path(pallas_kernels.__file__).parent.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      assert not any(n == "jaxsys" or n.startswith("jaxsys.") for n in names), (path.name, names)
  assert errors.ConfigError is kernel_errors.ConfigError and errors.ShapeError is kernel_errors.ShapeError
