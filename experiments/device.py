"""The device suite: every Pallas kernel compiled and timed on the accelerator, in one run.

  python -m experiments.device                 # on a GPU (or TPU) host: ~5 minutes on one H100
  python -m experiments.device --smoke         # the same harness in interpret mode on CPU (a test)
  python -m experiments.device --only correctness attention

Needs what an accelerator host has: jax with CUDA (or TPU), flax, numpy (no jraph, gguf, pymetis,
torch or network). Each case prints one line, a failing case prints ``FAILED`` with its error and
the rest go on; ``runs/device/result.json`` holds every row (the shared ``Row`` format, with the
device, JAX version and the failures in its config). Parts (``--only``):

* ``correctness``: every kernel through its public op, ``impl="pallas"`` against ``impl="xla"``,
  forward and gradient where it has one, float32 and bfloat16, at the project's shapes (SmolLM2's
  9/3 heads at d=64, a Llama's 32/8 at d=128): attention (causal and block-sparse), paged decode,
  page scores, graph tile attention, quantized aggregation. A case the kernel refuses
  (``NotImplementedError``) reports what ``auto`` serves instead.
* ``attention``: flash attention forward and forward+backward, bf16, d=128, causal and dense,
  4K-32K tokens, against ``jax.nn.dot_product_attention(implementation="cudnn")`` and the XLA twin.
  Goals: >= 0.7x cuDNN forward, >= 0.5x forward+backward.
* ``jax_triton``: the Triton-language forward called through ``jax_triton`` (``impl="jax_triton"``,
  the route past JAX 0.11's deprecation of Pallas-Triton): against the XLA twin at SmolLM2's and a
  Llama's shapes, then forward time vs cuDNN at 4K-32K (the same goal, >= 0.7x). Carry the
  ``jax_triton`` wheel (pure Python); without it the part records one row saying so.
* ``block_sparse``: 10% / 25% layouts at 64- and 128-token blocks (16K), against the same kernel on
  an all-visited layout; goal >= 0.7 of the ideal (1 / density) forward, >= 0.6 forward+backward.
* ``paged_decode``: the paged decode op over every page of 8K-token requests at batch 8 and 64,
  against the HBM read bound measured in the same run (a jitted row sum over 1 GiB); goal >= 0.5
  of the bound at batch 64.
* ``aggregate``: quantized aggregation (mixed 2/4/8-bit packed features, 1M nodes, 10 edges per
  node, 64 features) against an f32 ``segment_sum`` of the dequantised features; goal >= 1.0x.

``--smoke`` shrinks every shape, runs the kernels with ``pallas_interpret`` on CPU and times one
round: it checks the harness, not the hardware (``tests/test_device_suite.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.bench import bandwidth_probe, time_interleaved
from jaxsys.core.results import Row, write_result

NAME = "device"
PARTS = ("correctness", "attention", "jax_triton", "block_sparse", "paged_decode", "aggregate")
TOL = {"float32": 2e-3, "bfloat16": 3e-2}  # kernel vs twin: f32 dots may run as TF32 on GPUs


class Suite:
  """Rows and failures of one run; ``case`` runs one case and survives its failure."""

  def __init__(self, smoke: bool):
    self.smoke = smoke
    self.impl = "pallas_interpret" if smoke else "pallas"
    self.rows: list[Row] = []
    self.failures: dict[str, str] = {}

  def case(self, label: str, fn):
    t0 = time.perf_counter()
    try:
      rows = fn()
    except Exception as e:  # noqa: BLE001 - one failing case must not stop the suite
      self.failures[label] = f"{type(e).__name__}: {e}"
      print(f"FAILED {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
      traceback.print_exc(limit=2, file=sys.stderr)
      return
    for r in rows:
      self.rows.append(r)
      verdict = "" if r.met is None else (" met" if r.met else " NOT MET")
      ratio = "" if r.ratio is None else f" ratio {r.ratio:.3g}"
      ours = "-" if r.ours is None else f"{r.ours:.4g} {r.unit}"
      print(f"{r.metric}: {ours}{ratio}{verdict}{'; ' + r.note if r.ours is None else ''} "
            f"({time.perf_counter() - t0:.1f}s)", flush=True)

  def rounds(self, full: int) -> int:
    return 1 if self.smoke else full


def _rand(key, shape, dtype):
  return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


def _maxerr(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


# ----------------------------------------------------------------------------- correctness


def _compare(suite, label, call, arrays=(), grad=False):
  """Kernel vs twin, ``call(impl, *arrays)``, and (``grad``) the gradients w.r.t. ``arrays``, as
  one row: the largest error relative to the twin's scale."""
  def run(impl):
    out = [call(impl, *arrays)]
    if grad:
      loss = lambda *a: jnp.sum(call(impl, *a).astype(jnp.float32))  # noqa: E731
      out += list(jax.grad(loss, tuple(range(len(arrays))))(*arrays))
    return out
  try:
    got = run(suite.impl)
  except NotImplementedError as e:
    return [Row(f"{label}: refused", "", ours=None, note=f"auto serves xla: {e}")]
  ref = run("xla")
  err = max(_maxerr(a, b) / (1.0 + float(jnp.max(jnp.abs(jnp.asarray(b, jnp.float32)))))
            for a, b in zip(got, ref))
  tol = TOL["bfloat16" if "bf16" in label else "float32"]
  return [Row(f"{label}: max |kernel - xla| / (1 + max |xla|)", "relative", ours=err,
              goal=f"<= {tol} (ours)", met=err <= tol)]


def correctness(suite: Suite):
  from jaxsys.ops import masks as M
  from jaxsys.ops.attn.api import attention
  t = 128 if suite.smoke else 2048
  for dtype in ("float32", "bfloat16"):
    tag = "f32" if dtype == "float32" else "bf16"
    for (h, hk, d) in ((9, 3, 64), (32, 8, 128)):
      q, k, v = (_rand(i, (1, t, n, d), dtype) for i, n in ((0, h), (1, hk), (2, hk)))
      lay = np.tril(np.ones((1, t // 64, t // 64), bool)) & (np.random.default_rng(0).random((1, t // 64, t // 64)) < 0.5)
      lay |= np.eye(t // 64, dtype=bool)[None]
      for mname, mask in (("causal", M.Causal()), ("block-sparse 64", M.BlockSparse(lay, 64, 64))):
        label = f"attention {mname} {h}/{hk} d={d} {tag}"

        def call(impl, q, k, v, mask=mask):
          return attention(q, k, v, mask=mask, impl=impl)
        suite.case(label, lambda label=label, call=call, a=(q, k, v): _compare(suite, label, call, a, True))
  suite.case("paged decode", lambda: _paged_correctness(suite))
  suite.case("page scores", lambda: _select_correctness(suite))
  suite.case("graph tiles", lambda: _graph_correctness(suite))
  suite.case("quantized aggregation", lambda: _aggregate_correctness(suite))


def _paged_inputs(b, h, hk, d, page, kk, dtype, seed=0):
  n = b * kk
  q = _rand(seed, (b, h, d), jnp.float32)
  kp, vp = (_rand(seed + i, (n, hk, page, d), dtype) for i in (1, 2))
  idx = jnp.arange(n, dtype=jnp.int32).reshape(b, 1, kk).repeat(hk, 1)
  num = jnp.broadcast_to(jnp.arange(kk, dtype=jnp.int32), (b, hk, kk))
  lens = jnp.full((b,), kk * page, jnp.int32)
  return q, kp, vp, idx, num, lens


def _paged_correctness(suite):
  from jaxsys.ops.paged_attention import paged_decode_attention
  rows = []
  for dtype in ("float32", "bfloat16"):
    for (h, hk, d) in ((9, 3, 64), (32, 8, 128)):
      args = _paged_inputs(2, h, hk, d, 16, 8, dtype)
      label = f"paged decode {h}/{hk} d={d} {'f32' if dtype == 'float32' else 'bf16'}"
      rows += _compare(suite, label, lambda impl: paged_decode_attention(*args, sink=16, window=32, impl=impl))
  return rows


def _select_correctness(suite):
  from jaxsys.serving.page_select import page_scores
  rows = []
  for (h, hk, d) in ((9, 3, 64), (32, 8, 128)):
    q = _rand(0, (2, h, d), jnp.float32)
    a = _rand(1, (2, 32, hk, 4, d), jnp.float32)
    kmin, kmax = jnp.min(a, 0), jnp.max(a, 0)
    table = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    lens = jnp.asarray([1000, 517], jnp.int32)
    rows += _compare(suite, f"page scores {h}/{hk} d={d}", lambda impl: jnp.where(
        jnp.isinf(s := page_scores(q, kmin, kmax, table, lens, page_size=64, logical_page_size=16,
                                   impl=impl)), 0.0, s))
  return rows


def _graph_correctness(suite):
  from jaxsys.ops.graph_attn import GraphTiles, tile_graph_attention
  rows = []
  n, b, h = (256, 64, 4)
  for d in (64, 128):
    q, k, v = (_rand(i, (n, h, d), jnp.float32) for i in range(3))
    nb = n // b  # every (row, col) block pair one tile, 20% of its entries visible
    rows_, cols_ = np.divmod(np.arange(nb * nb), nb)
    bits = np.random.default_rng(0).random((nb * nb, b, b)) < 0.2
    tiles = GraphTiles(jnp.asarray(rows_, jnp.int32), jnp.asarray(cols_, jnp.int32), jnp.asarray(bits))
    rows += _compare(suite, f"graph tiles B={b} d={d}",
                     lambda impl, q, k, v: tile_graph_attention(q, k, v, tiles, impl=impl), (q, k, v), True)
  return rows


def _aggregate_case(n, f, degree, seed=0):
  from jaxsys.quant.packing import pack_features
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, f)).astype(np.float32)
  bits = rng.choice([2, 4, 8], n)
  pk = pack_features(x, bits, np.abs(x).max(1) / (2.0 ** (bits - 1) - 1), signed=True)
  return pk, rng.integers(0, n, n * degree), rng.integers(0, n, n * degree)


def _aggregate_correctness(suite):
  from jaxsys.ops import quantized_aggregate
  pk, s, r = _aggregate_case(512, 64, 10)
  return _compare(suite, "quantized aggregation 2/4/8 bits",
                  lambda impl: quantized_aggregate(pk, (s, r), aggregation="gcn", impl=impl))


# ----------------------------------------------------------------------------- timing parts


def attention_timing(suite: Suite):
  from jaxsys.ops import masks as M
  from jaxsys.ops.attn.api import attention
  lengths = (256,) if suite.smoke else (4096, 8192, 16384, 32768)
  h, d = (2, 128) if suite.smoke else (16, 128)
  peer_impl = None if suite.smoke else "cudnn"
  for t in lengths:
    q, k, v = (_rand(i, (1, t, h, d), jnp.bfloat16) for i in range(3))
    for causal in (True, False):
      mask = M.Causal() if causal else None
      fns = {"ours": lambda q, k, v, m=mask: attention(q, k, v, mask=m, impl=suite.impl),
             "xla": lambda q, k, v, m=mask: attention(q, k, v, mask=m, impl="xla"),
             "cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                 q, k, v, is_causal=c, implementation=peer_impl)}
      for bwd in (False, True):
        label = f"attention {'causal' if causal else 'dense'} @{t} {'fwd+bwd' if bwd else 'fwd'}"
        suite.case(label, lambda fns=fns, bwd=bwd, label=label: _timed_vs_peer(
            suite, label, fns, (q, k, v), bwd, 0.5 if bwd else 0.7))


def jax_triton_timing(suite: Suite):
  import importlib.util

  from jaxsys.ops import masks as M
  from jaxsys.ops.attn.api import attention
  if suite.smoke or importlib.util.find_spec("jax_triton") is None:
    why = "smoke mode (no GPU)" if suite.smoke else "jax_triton is not installed (carry its wheel)"
    suite.rows.append(Row("jax_triton route", "-", ours=None, note=f"not run: {why}"))
    return
  for h, hk, d in ((9, 3, 64), (32, 8, 128)):
    q = _rand(0, (2, 1024, h, d), jnp.bfloat16)
    k, v = (_rand(i, (2, 1024, hk, d), jnp.bfloat16) for i in (1, 2))
    for causal in (True, False):
      mask = M.Causal() if causal else None
      label = f"jax_triton {'causal' if causal else 'dense'} {h}/{hk} d={d} bf16"
      suite.case(label, lambda mask=mask, label=label, q=q, k=k, v=v: _compare(
          suite, label, lambda impl, q, k, v: attention(q, k, v, mask=mask,
                                                        impl="jax_triton" if impl != "xla" else impl),
          (q, k, v), grad=True))
  for t in (4096, 8192, 16384, 32768):
    q, k, v = (_rand(i, (1, t, 16, 128), jnp.bfloat16) for i in range(3))
    for causal in (True, False):
      mask = M.Causal() if causal else None
      fns = {"ours": lambda q, k, v, m=mask: attention(q, k, v, mask=m, impl="jax_triton"),
             "xla": lambda q, k, v, m=mask: attention(q, k, v, mask=m, impl="xla"),
             "cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                 q, k, v, is_causal=c, implementation="cudnn")}
      label = f"attention (jax_triton) {'causal' if causal else 'dense'} @{t} fwd"
      suite.case(label, lambda fns=fns, label=label: _timed_vs_peer(suite, label, fns, (q, k, v), False, 0.7))


def _grads(fns):
  """Each ``f(q, k, v)`` as the gradients of ``sum(f)`` w.r.t. q, k and v (forward+backward)."""
  return {n: jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2))
          for n, f in fns.items()}


def _timed_vs_peer(suite, label, fns, args, bwd, goal):
  if bwd:
    fns = _grads(fns)
  timed = time_interleaved({n: jax.jit(f) for n, f in fns.items()}, *args, rounds=suite.rounds(5))
  ratio = timed["cudnn"].min / timed["ours"].min
  return [Row(f"{label} vs cuDNN", "ms", ours=timed["ours"].ms, baseline=timed["cudnn"].ms,
              baseline_name="jax.nn.dot_product_attention(cudnn)", ratio=ratio, goal=f">= {goal}",
              met=ratio >= goal, note=f"XLA twin {timed['xla'].ms:.2f} ms")]


def block_sparse_timing(suite: Suite):
  from jaxsys.ops import masks as M
  from jaxsys.ops.attn.api import attention
  t, h, d = (512, 2, 64) if suite.smoke else (16384, 16, 128)
  q, k, v = (_rand(i, (1, t, h, d), jnp.bfloat16) for i in range(3))
  for blk in (64, 128):
    n = t // blk
    full = M.BlockSparse(np.ones((1, n, n), bool), blk, blk)
    for density in (0.1, 0.25):
      lay = np.random.default_rng(blk).random((1, n, n)) < density
      lay |= np.eye(n, dtype=bool)[None]
      real = float(lay.mean())
      for bwd in (False, True):
        label = f"block-sparse {int(density * 100)}% {blk} {'fwd+bwd' if bwd else 'fwd'}"
        goal = 0.6 if bwd else 0.7
        suite.case(label, lambda lay=lay, real=real, bwd=bwd, label=label, goal=goal, blk=blk, full=full:
                   _sparse_row(suite, label, attention, (q, k, v), M.BlockSparse(lay, blk, blk), full,
                               real, bwd, goal))


def _sparse_row(suite, label, attention, args, mask, full, real, bwd, goal):
  fns = {"sparse": lambda q, k, v: attention(q, k, v, mask=mask, impl=suite.impl),
         "all visited": lambda q, k, v: attention(q, k, v, mask=full, impl=suite.impl)}
  if bwd:
    fns = _grads(fns)
  timed = time_interleaved({n: jax.jit(f) for n, f in fns.items()}, *args, rounds=suite.rounds(5))
  ratio = timed["all visited"].min / timed["sparse"].min
  return [Row(f"{label} vs the all-visited layout", "ms", ours=timed["sparse"].ms,
              baseline=timed["all visited"].ms, baseline_name="same kernel, every block visited",
              ratio=ratio, ideal=1 / real, goal=f">= {goal} of ideal", met=ratio * real >= goal,
              note=f"density {real:.3f}; {ratio * real:.2f} of the ideal")]


def paged_decode_timing(suite: Suite):
  from jaxsys.ops.paged_attention import paged_decode_attention
  h, hk, d, page = (8, 2, 64, 16) if suite.smoke else (32, 8, 128, 64)
  pages_per_req = 4 if suite.smoke else 8192 // page
  probe, probe_args, probe_bytes = bandwidth_probe(1 / 64 if suite.smoke else 1.0)
  for b in (8, 64):
    args = _paged_inputs(b, h, hk, d, page, pages_per_req, "bfloat16")
    nbytes = 2 * b * hk * pages_per_req * page * d * 2  # K and V, bf16, every page read once
    suite.case(f"paged decode batch {b}", lambda args=args, nbytes=nbytes, b=b: _paged_row(
        suite, paged_decode_attention, args, nbytes, b, (probe, probe_args, probe_bytes)))


def _paged_row(suite, op, args, nbytes, b, probe):
  fn, pargs, pbytes = probe
  timed = time_interleaved({"decode": jax.jit(lambda *a: op(*a, impl=suite.impl)),
                            "probe": lambda *_: fn(*pargs)}, *args, rounds=suite.rounds(10))
  bw = pbytes / timed["probe"].min
  frac = (nbytes / bw) / timed["decode"].min
  return [Row(f"paged decode, batch {b}: fraction of the HBM read bound", "fraction", ours=frac,
              goal=">= 0.5 (ours)" if b == 64 else None, met=frac >= 0.5 if b == 64 else None,
              note=f"{nbytes / 1e6:.0f} MB in {timed['decode'].ms:.3f} ms; read bandwidth "
                   f"{bw / 1e9:.0f} GB/s (row sum over {pbytes / 2**30:.2f} GiB)")]


def aggregate_timing(suite: Suite):
  from jaxsys.ops import quantized_aggregate
  from jaxsys.ops.quantized_agg import plan_aggregation
  n = 1024 if suite.smoke else 1_000_000
  pk, s, r = _aggregate_case(n, 64, 10)
  plan = plan_aggregation(pk, (s, r), "sum")
  x = jnp.asarray(np.random.default_rng(0).standard_normal((n, 64)), jnp.float32)
  snd, rcv = jnp.asarray(s, jnp.int32), jnp.asarray(r, jnp.int32)

  def row():  # arrays are arguments (the plan's edge lists are the op's static host data)
    timed = time_interleaved({
        "quantized": jax.jit(lambda pk, x, snd, rcv: quantized_aggregate(pk, None, plan=plan, impl=suite.impl)),
        "f32 segment_sum": jax.jit(lambda pk, x, snd, rcv: jax.ops.segment_sum(x[snd], rcv, n))},
        pk, x, snd, rcv, rounds=suite.rounds(5))
    ratio = timed["f32 segment_sum"].min / timed["quantized"].min
    return [Row(f"quantized aggregation @{n} nodes vs f32 segment_sum", "ms", ours=timed["quantized"].ms,
                baseline=timed["f32 segment_sum"].ms, baseline_name="f32 segment_sum", ratio=ratio,
                goal=">= 1.0", met=ratio >= 1.0, note="2/4/8-bit packed features, 10 edges per node")]
  suite.case(f"quantized aggregation @{n}", row)


_PART_FUNCS = {"correctness": correctness, "attention": attention_timing, "jax_triton": jax_triton_timing,
               "block_sparse": block_sparse_timing, "paged_decode": paged_decode_timing,
               "aggregate": aggregate_timing}


def run(smoke: bool = False, out_dir=None, parts=None) -> Suite:
  suite = Suite(smoke)
  print(f"[device] {jax.devices()[0].device_kind} x {jax.device_count()}, jax {jax.__version__}, "
        f"{'smoke (interpret mode)' if smoke else 'compiled kernels'}", flush=True)
  for part in parts or PARTS:
    _PART_FUNCS[part](suite)
  write_result(NAME + ("_smoke" if smoke else ""), suite.rows, out_dir=out_dir, quick=smoke,
               config={"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "smoke": smoke, "parts": list(parts or PARTS), "failures": suite.failures})
  print(f"[device] {len(suite.rows)} rows, {len(suite.failures)} failed cases", flush=True)
  return suite


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m experiments.device", description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="interpret mode on CPU, tiny shapes")
  p.add_argument("--out", default="runs", help="output folder (default: runs)")
  p.add_argument("--only", nargs="+", choices=PARTS, help="parts to run (default: all)")
  a = p.parse_args(argv)
  if not a.smoke and jax.default_backend() not in ("gpu", "tpu"):
    p.error(f"the device suite compiles kernels for a GPU or TPU; this host's backend is "
            f"{jax.default_backend()!r} (use --smoke to check the harness on CPU)")
  suite = run(a.smoke, a.out, a.only)
  return 1 if suite.failures else 0


if __name__ == "__main__":
  sys.exit(main())
