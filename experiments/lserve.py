"""LServe: sparse decode / prefill attention and the serving engine, against dense, on CPU.

(a) decode attention time per step vs context (4K-128K): dense (contiguous head-major cache,
    the fastest dense layout here) vs LServe (token budget 4096 over 64-token pages with
    16-token logical pages, selection reused for 4 steps, 50% streaming heads with sink 64 +
    window 256), full scale (32 query / 8 kv heads, head_dim 128, float32, random weights).
    Ideal = dense bytes / LServe bytes (selected pages + streaming pages + statistics / reuse).
(b) prefill attention time with 50% streaming heads (one block-sparse attention call with a
    per-head mask) vs dense causal; ideal = dense blocks / visited blocks.
(c) KV memory per token of context (dense vs LServe, incl. page statistics).
(d) end-to-end decode tokens/s of ``jaxsys.serving.Engine`` at long context, dense vs LServe
    (a small random-weight model whose attention shape matches (a)).
(e) accuracy on the tiny trained retrieval model (``experiments/lserve_accuracy.py``).
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.bench import time_fn
from jaxsys.core.results import Row, run_dir, write_result
from jaxsys.serving import lserve
from jaxsys.serving.page_select import SelectionConfig
from jaxsys.serving.paged_cache import PagedCacheConfig

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PAGE, LOGICAL, BUDGET, REUSE, SINK, WINDOW = 64, 16, 4096, 4, 64, 256


def _cache_config(ctx: int, streaming_fraction: float = 0.5) -> PagedCacheConfig:
  n_stream = int(round(KV_HEADS * streaming_fraction))
  flags = (tuple([False] * (KV_HEADS - n_stream) + [True] * n_stream),)
  return PagedCacheConfig(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          num_pages=ctx // PAGE, page_size=PAGE, logical_page_size=LOGICAL,
                          max_requests=1, sink=SINK, window=WINDOW, streaming=flags)


def _random_state(c: PagedCacheConfig, ctx: int, rng):
  """A filled single-request cache (random keys) without running the write path at 64K+."""
  r, s = len(c.retrieval_heads(0)), len(c.streaming_heads(0))
  shape = (c.num_pages, r, PAGE, HEAD_DIM)
  k = jax.random.normal(rng, shape, jnp.float32)
  v = jax.random.normal(jax.random.fold_in(rng, 1), shape, jnp.float32)
  blk = k.reshape(c.num_pages, r, PAGE // LOGICAL, LOGICAL, HEAD_DIM)
  sshape = (c.num_stream_pages, s, PAGE, HEAD_DIM)
  return {"k": [k], "v": [v], "kmin": [blk.min(3)], "kmax": [blk.max(3)],
          "sk": [jax.random.normal(jax.random.fold_in(rng, 2), sshape)],
          "sv": [jax.random.normal(jax.random.fold_in(rng, 3), sshape)]}


def _dense_decode(q, k, v):
  """Dense decode attention over a contiguous head-major cache ``k, v [b, kv_heads, T, d]``."""
  b = q.shape[0]
  qg = q.reshape(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)  # [batch, kv_heads, group, dim]
  s = jnp.einsum("bhgd,bhtd->bhgt", qg, k) / math.sqrt(HEAD_DIM)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhgt,bhtd->bhgd", p, v).reshape(b, HEADS, HEAD_DIM)


def decode_bytes(ctx: int, streaming_fraction: float = 0.5) -> tuple[float, float]:
  """(dense, LServe) KV bytes read per decode step (float32)."""
  c = _cache_config(ctx, streaming_fraction)
  r, s = len(c.retrieval_heads(0)), len(c.streaming_heads(0))
  tok = 2 * HEAD_DIM * 4
  dense = KV_HEADS * ctx * tok
  sel = SelectionConfig(BUDGET, PAGE, LOGICAL, REUSE)
  pages = min(sel.num_select, ctx // PAGE)
  ours = (r * pages * PAGE * tok + s * c.stream_pages_per_request * PAGE * tok
          + r * (ctx // LOGICAL) * tok / REUSE)
  return dense, ours


def bench_decode(contexts, iters) -> tuple[list[Row], dict]:
  rows, curve = [], {"ctx": [], "dense_ms": [], "lserve_ms": [], "ideal": []}
  sel = SelectionConfig(BUDGET, PAGE, LOGICAL, REUSE)
  for ctx in contexts:
    c = _cache_config(ctx)
    key = jax.random.PRNGKey(ctx)
    q = jax.random.normal(key, (1, HEADS, HEAD_DIM), jnp.float32)
    kd = jax.random.normal(jax.random.fold_in(key, 7), (1, KV_HEADS, ctx, HEAD_DIM), jnp.float32)
    vd = jax.random.normal(jax.random.fold_in(key, 8), (1, KV_HEADS, ctx, HEAD_DIM), jnp.float32)
    dense = jax.jit(_dense_decode)
    t_dense = time_fn(dense, q, kd, vd, iters=iters).ms
    del kd, vd
    st = _random_state(c, ctx, key)
    bt = jnp.arange(c.num_pages, dtype=jnp.int32)[None]
    stt = jnp.arange(c.stream_pages_per_request, dtype=jnp.int32)[None]
    lengths = jnp.asarray([ctx], jnp.int32)

    @jax.jit
    def cycle(q, st):
      """One selection step + (reuse - 1) steps reusing it; returns the last output."""
      out, numbers = lserve.decode_attention(c, sel, st, 0, q, bt, stt, lengths, reselect=True)
      for _ in range(REUSE - 1):
        q = q + 1e-3 * out  # a data dependence so steps are not merged
        out, _ = lserve.decode_attention(c, sel, st, 0, q, bt, stt, lengths, numbers, reselect=False)
      return out

    t_ours = time_fn(cycle, q, st, iters=iters).ms / REUSE
    del st
    db, ob = decode_bytes(ctx)
    ideal = db / ob
    rows.append(Row(f"decode attention time/step @{ctx // 1024}K", "ms", ours=t_ours, baseline=t_dense,
                    baseline_name="dense", ideal=ideal,
                    goal=">= 0.5 of ideal" if ctx == 65536 else None,
                    note=f"budget {BUDGET}, 50% streaming heads (sink {SINK}, window {WINDOW}), reuse {REUSE}"))
    for k_, v_ in (("ctx", ctx), ("dense_ms", t_dense), ("lserve_ms", t_ours), ("ideal", ideal)):
      curve[k_].append(v_)
    print(f"  decode {ctx}: dense {t_dense:.2f} ms, lserve {t_ours:.2f} ms, "
          f"ratio {t_dense / t_ours:.2f}, ideal {ideal:.1f}", flush=True)
  return rows, curve


def memory_rows(ctx: int = 65536) -> list[Row]:
  c = _cache_config(ctx)
  dense = PagedCacheConfig(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE,
                           logical_page_size=LOGICAL)
  ours = c.token_bytes()
  per_tok_ours = ours["retrieval_per_token"] + ours["streaming_per_request"] / ctx
  per_tok_dense = KV_HEADS * 2 * HEAD_DIM * 4
  del dense
  c8 = PagedCacheConfig(**{**c.__dict__, "kv_int8": True})
  q8 = c8.token_bytes()
  per_tok_8 = q8["retrieval_per_token"] + q8["streaming_per_request"] / ctx
  return [Row(f"KV bytes per token per layer @{ctx // 1024}K", "bytes", ours=per_tok_ours,
              baseline=per_tok_dense, baseline_name="dense f32", ratio=per_tok_dense / per_tok_ours,
              ideal=2.0, note="ratio = dense/LServe; 50% streaming heads, stats of 16-token logical pages"),
          Row(f"KV bytes per token per layer @{ctx // 1024}K, int8 KV", "bytes", ours=per_tok_8,
              baseline=per_tok_dense, baseline_name="dense f32", ratio=per_tok_dense / per_tok_8,
              note="ratio = dense/LServe int8 (per-token scales)")]


def _plot(curve, out):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  x = np.asarray(curve["ctx"]) / 1024
  ax[0].loglog(x, curve["dense_ms"], "o-", label="dense")
  ax[0].loglog(x, curve["lserve_ms"], "s-", label="LServe")
  ax[0].set_xlabel("context (K tokens)")
  ax[0].set_ylabel("decode attention ms / step")
  ax[0].legend()
  ratio = np.asarray(curve["dense_ms"]) / np.asarray(curve["lserve_ms"])
  ax[1].semilogx(x, ratio, "s-", label="measured speedup")
  ax[1].semilogx(x, curve["ideal"], "k--", label="ideal (bytes)")
  ax[1].set_xlabel("context (K tokens)")
  ax[1].legend()
  fig.tight_layout()
  fig.savefig(out / "decode_attention.png", dpi=100)
  plt.close(fig)


def run(quick: bool, out_dir: str) -> list[Row]:
  contexts = (4096, 16384, 65536) if quick else (4096, 8192, 16384, 32768, 65536, 131072)
  iters = 3 if quick else 5
  out = run_dir("lserve", out_dir)
  rows, curve = bench_decode(contexts, iters)
  _plot(curve, out)
  rows += memory_rows()
  from experiments import lserve_parts
  rows += lserve_parts.prefill_rows(quick)
  rows += lserve_parts.engine_rows(quick)
  rows += lserve_parts.accuracy_rows(quick, out)
  write_result("lserve", rows, quick=quick, out_dir=out_dir,
               config={"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page": PAGE,
                       "logical_page": LOGICAL, "budget": BUDGET, "reuse": REUSE, "sink": SINK,
                       "window": WINDOW, "contexts": list(contexts), "dtype": "float32"})
  return rows


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main("lserve"))
