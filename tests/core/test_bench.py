"""core.bench: time_interleaved (warm-up first, round-robin order, one Timing per label),
compile counting, host-drawn benchmark inputs and the read-bandwidth probe."""

import jax.numpy as jnp
import pytest

from jaxsys.core.bench import Timing, time_interleaved
from jaxsys.core.errors import ConfigError, InputError


def test_round_robin_order_after_warmup():
  calls = []

  def make(name):
    def f(x):
      calls.append(name)
      return jnp.asarray(x) + 1
    return f

  out = time_interleaved({"a": make("a"), "b": (make("b"), (2.0,))}, 1.0, rounds=3, warmup=2)
  # every warm-up call comes before the first timed round, then a, b alternate
  assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
  assert list(out) == ["a", "b"]
  assert all(isinstance(t, Timing) and len(t.times) == 3 for t in out.values())
  assert out["a"].min >= 0 and out["a"].ms == pytest.approx(1e3 * out["a"].min)


def test_per_function_arguments_are_used():
  seen = {}

  def rec(name):
    def f(*args):
      seen[name] = args
    return f

  time_interleaved({"shared": rec("shared"), "own": (rec("own"), (1, 2))}, 7, rounds=1, warmup=0)
  assert seen == {"shared": (7,), "own": (1, 2)}


def test_bad_arguments_raise():
  with pytest.raises(ConfigError, match="rounds"):
    time_interleaved({"a": lambda: None}, rounds=0)
  with pytest.raises(InputError, match="fns\\['a'\\]"):
    time_interleaved({"a": 3}, rounds=1)


def test_compile_count_sees_new_shapes_only():
  import jax

  from jaxsys.core.bench import BACKEND_COMPILES, TRACE_COUNTS, compile_count, count_trace

  @jax.jit
  def f(x):
    count_trace("test_bench.f")
    return x * 2

  n0, t0 = compile_count(), TRACE_COUNTS["test_bench.f"]
  f(jnp.ones(3))
  n1 = compile_count()
  f(jnp.ones(3))  # cache hit: no trace, no compile
  assert compile_count() == n1 > n0 and TRACE_COUNTS["test_bench.f"] == t0 + 1
  f(jnp.ones(5))  # a new shape retraces and recompiles
  assert compile_count() > n1 and TRACE_COUNTS["test_bench.f"] == t0 + 2
  assert TRACE_COUNTS[BACKEND_COMPILES] == compile_count()


def test_normal_input_is_seeded_and_compiles_nothing():
  import numpy as np

  from jaxsys.core.bench import compile_count, normal_input

  n0 = compile_count()
  a, b, c = normal_input(7, (3, 64, 5)), normal_input(7, (3, 64, 5)), normal_input(8, (3, 64, 5))
  assert compile_count() == n0  # a jax.random draw would compile a program for this shape
  assert a.shape == (3, 64, 5) and a.dtype == jnp.float32
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c) and abs(float(a.mean())) < 0.2 and 0.8 < float(a.std()) < 1.2
  assert normal_input(7, (4,), "bfloat16").dtype == jnp.bfloat16


def test_read_bandwidth_reports_both_probes():
  import math

  from jaxsys.core.bench import bandwidth_probe, read_bandwidth

  fn, args, nbytes = bandwidth_probe(1 / 256)  # 4 MiB: semantics only, not a DRAM figure
  assert nbytes == args[0].nbytes == 4 << 20 and fn(*args).shape == (args[0].shape[0],)
  bw = read_bandwidth(1 / 256, iters=2)
  assert set(bw) == {"xla", "numpy"}
  assert all(math.isfinite(v) and v > 0 for v in bw.values())
  with pytest.raises(ConfigError, match="gib"):
    read_bandwidth(0)
  with pytest.raises(ConfigError, match="iters"):
    read_bandwidth(1 / 256, iters=0)


def test_analysis_compile_gives_the_default_plan_and_collectives():
  """compile_for_analysis (LLVM level 0 on CPU) reads the same memory plan and the same collectives
  as a default compile: both are decided by HLO passes before LLVM."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jaxsys.core.bench import ANALYSIS_OPTIONS, compile_for_analysis, compiled_memory
  from jaxsys.parallel.costs import hlo_collective_bytes
  n = min(len(jax.devices()), 4)
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sh = NamedSharding(mesh, P("data"))

  def loss(w, x):  # a data-parallel gradient: an all-reduce over "data"
    return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

  w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
  x = jax.ShapeDtypeStruct((8 * n, 64), jnp.float32, sharding=sh)
  lowered = jax.jit(loss).lower(w, x)
  fast, full = compile_for_analysis(lowered), lowered.compile()
  a, b = fast.memory_analysis(), full.memory_analysis()
  for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
    assert getattr(a, field) == getattr(b, field)
  assert hlo_collective_bytes(fast.as_text()) == hlo_collective_bytes(full.as_text())
  if n > 1:
    assert sum(hlo_collective_bytes(full.as_text()).values()) > 0
  assert compiled_memory(loss, w, x, unrun=True) == compiled_memory(loss, w, x)
  assert ANALYSIS_OPTIONS == {"xla_backend_optimization_level": 0}
