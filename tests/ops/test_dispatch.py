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
  for module in ("graph_attn", "quantized_agg", "paged_attention", "merge", "ids", "attn.api",
                 "attn.xla", "attn.pallas", "attn.reference"):
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


def _shrink_tpu_budgets(monkeypatch):
  """On-chip budgets of the Mosaic kernels set to nothing: every Mosaic launch is refused."""
  from pallas_kernels import page_select, paged_attention, quantized_aggregate
  for module in (page_select, paged_attention, quantized_aggregate):
    monkeypatch.setattr(module, "TPU_SMEM_BUDGET_BYTES", 0)


def _tpu_fallback_cases():
  """(dispatcher, call(impl)) for the ops whose Mosaic kernels refuse inputs beyond SMEM/VMEM."""
  from jaxsys.ops import paged_attention, quantized_agg
  from jaxsys.quant.packing import pack_features
  from jaxsys.serving import page_select
  rng = np.random.default_rng(0)
  kp = jnp.asarray(rng.standard_normal((3, 1, 4, 8)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((1, 2, 8)), jnp.float32)
  idx, num = jnp.asarray([[[2, 0]]], jnp.int32), jnp.asarray([[[0, 1]]], jnp.int32)
  z = jnp.asarray(rng.standard_normal((3, 1, 2, 8)), jnp.float32)
  pk = pack_features(np.abs(rng.standard_normal((6, 5))).astype(np.float32), np.full(6, 4),
                     np.ones(6), signed=False)
  s, r = np.array([0, 1, 2, 5]), np.array([1, 2, 3, 0])
  return {
      "paged_decode_attention": (paged_attention.PAGED_DECODE, lambda impl: (
          paged_attention.paged_decode_attention(q, kp, kp, idx, num, jnp.asarray([7]),
                                                 impl=impl))),
      "page_scores": (page_select.PAGE_SCORES, lambda impl: page_select.page_scores(
          q, -z, z, jnp.asarray([[2, 0]], jnp.int32), jnp.asarray([9]), page_size=8,
          logical_page_size=4, impl=impl)),
      "quantized_aggregate": (quantized_agg.QUANTIZED_AGGREGATE, lambda impl: (
          quantized_agg.quantized_aggregate(pk, (s, r), impl=impl))),
  }


@pytest.mark.parametrize("op", ["paged_decode_attention", "page_scores", "quantized_aggregate"])
def test_tpu_auto_falls_back_to_the_xla_twin_when_the_mosaic_kernel_refuses(monkeypatch, op):
  """On TPU, auto tries the Pallas kernel first; a kernel that cannot serve (here: inputs beyond
  its on-chip budget) raises NotImplementedError and the XLA twin serves the call."""
  dispatcher, call = _tpu_fallback_cases()[op]
  ref = call("xla")
  ran = []
  xla = dispatcher.get("xla")
  monkeypatch.setitem(dispatcher._impls, "xla", lambda *a, **k: ran.append(1) or xla(*a, **k))
  _shrink_tpu_budgets(monkeypatch)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert dispatch.auto_order() == ("pallas", "xla")
  np.testing.assert_array_equal(call("auto"), ref)
  assert ran == [1]


def test_tpu_kernel_refusal_reaches_the_dispatcher_with_its_reason(monkeypatch):
  """The Mosaic kernels resolve their backend from the default backend: on "tpu" the group
  aggregation takes the Mosaic path, whose budget refusal is the reason the dispatcher lists."""
  from jaxsys.ops.quantized_agg import _sum_groups, _xla_group, plan_aggregation
  from jaxsys.quant.packing import pack_features
  from pallas_kernels.quantized_aggregate import group_aggregate
  pk = pack_features(np.ones((4, 3), np.float32), np.full(4, 2), np.ones(4), signed=False)
  plan = plan_aggregation(pk, (np.array([0, 1]), np.array([1, 2])), "sum")
  kw = dict(num_features=pk.num_features, signed=pk.signed, num_nodes=pk.num_nodes)
  op = Dispatcher("group_aggregate", {
      "xla": lambda: _sum_groups(pk, plan, lambda w, sc, ge, b: _xla_group(
          w, sc, ge, b, kw["num_features"], kw["signed"], kw["num_nodes"])),
      "pallas": lambda: _sum_groups(pk, plan, lambda w, sc, ge, b: group_aggregate(
          w, sc, ge, bits=b, interpret=True, **kw))})
  _shrink_tpu_budgets(monkeypatch)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  with pytest.raises(ImplementationError, match=r"pallas: the Mosaic quantized aggregation .*SMEM"):
    op("pallas")
  np.testing.assert_array_equal(op("auto"), op("xla"))


# ----------------------------------------------------------------------------- real kernels past their budgets


def _on_gpu(monkeypatch):
  """The dispatchers and kernels as a GPU host sees them: ``auto`` tries compiled Pallas (Triton)
  first. Only refused cases are run, so nothing reaches a GPU compiler."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def _budget_cases():
  from jaxsys.ops import masks as M
  from jaxsys.ops.attn.api import attention
  from jaxsys.ops.paged_attention import paged_decode_attention
  from jaxsys.serving.page_select import page_scores
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((1, 64, 2, 256)), jnp.bfloat16)      # head_dim beyond the table
  q = jnp.asarray(rng.standard_normal((1, 4, 80)), jnp.float32)            # head_dim 80 on Triton
  pages = jnp.asarray(rng.standard_normal((6, 2, 16, 80)), jnp.float32)
  stats = jnp.asarray(rng.standard_normal((6, 2, 4, 80)), jnp.float32)
  idx, lens = jnp.asarray([[[0, 1, 2], [3, 4, 5]]], jnp.int32), jnp.asarray([40], jnp.int32)
  num = jnp.asarray([[[0, 1, 2], [0, 1, 2]]], jnp.int32)
  table = jnp.asarray([[0, 1, 2, 3]], jnp.int32)
  return {
      "attention": (lambda impl: attention(x, x, x, mask=M.Causal(), impl=impl), "head_dim=256"),
      "paged decode": (lambda impl: paged_decode_attention(q, pages, pages, idx, num, lens, impl=impl)[0],
                       "head_dim=80"),
      "page scores": (lambda impl: page_scores(q, stats, stats, table, lens, page_size=16,
                                               logical_page_size=4, impl=impl), "head_dim=80"),
  }


@pytest.mark.parametrize("op", ["attention", "paged decode", "page scores"])
def test_auto_falls_back_from_a_kernel_past_its_budget(monkeypatch, caplog, op):
  """On a GPU host, a case the Triton kernel cannot compile is refused before tracing: ``auto``
  returns the XLA twin's result and logs why; the explicit ``pallas`` impl names the reason."""
  call, reason = _budget_cases()[op]
  ref = np.asarray(call("xla"), np.float32)
  _on_gpu(monkeypatch)
  with caplog.at_level("INFO", logger="jaxsys.dispatch"):
    got = np.asarray(call("auto"), np.float32)
  np.testing.assert_array_equal(got, ref)
  assert reason in caplog.text and "trying xla" in caplog.text
  with pytest.raises(NotImplementedError, match=reason):
    call("pallas")
