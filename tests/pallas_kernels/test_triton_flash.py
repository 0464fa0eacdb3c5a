"""The jax-triton route (``pallas_kernels/triton_flash.py``, ``impl="jax_triton"``): the
Triton-language forward compiles for sm_90a within an H100's budgets at every verified tile, runs
correctly in Triton's interpreter against the dense formula, and its JAX wrapper pads, slices and
differentiates like the XLA twin."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.ops import attention, masks as M
from jaxsys.ops.attn import common, jax_triton as JT, xla
from pallas_kernels import offline, triton_flash as TF

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", sorted(TF.TILES))
def test_compiles_for_sm90_within_budgets(head_dim, causal, dtype):
  reason = offline.available()
  if reason:
    pytest.skip(reason)
  tiles = TF.TILES[head_dim]
  report = TF.compile_sm90(dtype, (2, 8, 1024, head_dim), (2, 2, 1024, head_dim), causal=causal,
                           tiles=tiles, kv_len=1000)
  assert report.problems() == [], report
  assert report.shared_bytes > 0 and report.registers > 0


_INTERPRET = textwrap.dedent("""
    import numpy as np
    from pallas_kernels import triton_flash as TF

    def reference(q, k, v, scale, kv_len, q_offset, causal):
      g = q.shape[1] // k.shape[1]
      k, v = np.repeat(k, g, 1).astype(np.float64), np.repeat(v, g, 1).astype(np.float64)
      s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) * scale
      qi, ki = np.arange(q.shape[2])[:, None] + q_offset, np.arange(k.shape[2])[None, :]
      vis = (ki < kv_len) & ((ki <= qi) if causal else True)
      s = np.where(vis, s, -np.inf)
      m = s.max(-1, keepdims=True)
      p = np.exp(s - m)
      return p / p.sum(-1, keepdims=True) @ v, np.log(p.sum(-1)) + m[..., 0]

    rng = np.random.default_rng(0)
    tiles = TF.TritonFlashTiles(block_m=32, block_n=16, num_warps=4)
    # (b, h, hk, Tq, Tk, d, kv_len, q_offset, causal, dtype)
    for b, h, hk, tq, tk, d, kv_len, off, causal, dt in [
        (1, 4, 2, 64, 64, 16, 64, 0, True, np.float32), (2, 2, 1, 32, 80, 32, 70, 0, False, np.float32),
        (1, 4, 1, 32, 96, 16, 90, 58, True, np.float16), (1, 2, 2, 64, 64, 16, 50, 0, True, np.float32)]:
      mk = lambda *s: rng.standard_normal(s).astype(dt)
      q, k, v = mk(b, h, tq, d), mk(b, hk, tk, d), mk(b, hk, tk, d)
      o, lse = TF.interpret(q, k, v, scale=d ** -0.5, kv_len=kv_len, q_offset=off, causal=causal, tiles=tiles)
      ro, rl = reference(q, k, v, d ** -0.5, kv_len, off, causal)
      tol = 2e-2 if dt == np.float16 else 1e-5
      np.testing.assert_allclose(o.astype(np.float64), ro, atol=tol, rtol=tol)
      np.testing.assert_allclose(lse, rl, atol=tol, rtol=tol)
    print("ok")
""")


def test_interpreter_matches_the_dense_formula():
  """Dense / causal, GQA, a padded kv length, a decode-style q_offset, f16: Triton's interpreter
  (its own process: TRITON_INTERPRET must precede the import) against a float64 formula."""
  pytest.importorskip("torch")
  env = dict(os.environ, TRITON_INTERPRET="1")
  res = subprocess.run([sys.executable, "-c", _INTERPRET], capture_output=True, text=True, env=env,
                       timeout=600)
  assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def _inputs(dtype=jnp.bfloat16, tq=40, tk=40, h=4, hk=2, d=24):
  ks = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(kk, (2, t, n, d), jnp.float32).astype(dtype)
          for kk, t, n in zip(ks, (tq, tk, tk), (h, hk, hk))]


def test_refuses_what_it_cannot_serve():
  q, k, v = _inputs()
  with pytest.raises(NotImplementedError, match="GPU"):   # this host has none
    attention(q, k, v, mask=M.Causal(), impl="jax_triton")
  cases = [(dict(mask=M.Local(8)), "dense or causal"), (dict(mask=M.Causal(), kv_lengths=jnp.array([3, 4])),
                                                        "kv_lengths"),
           (dict(mask=M.Causal(), q_offset=jnp.array([0, 1])), "static")]
  for kw, match in cases:
    with pytest.raises(NotImplementedError, match=match):
      JT.check(common.validate(q, k, v, **kw))
  with pytest.raises(NotImplementedError, match="bf16"):
    JT.check(common.validate(*_inputs(jnp.float32), mask=M.Causal()))
  with pytest.raises(NotImplementedError, match="head_dim"):
    JT.check(common.validate(*_inputs(d=256), mask=M.Causal()))
  assert JT.check(common.validate(q, k, v, mask=M.Causal())) == TF.TILES[32]


def test_wrapper_pads_slices_and_differentiates_like_the_twin(monkeypatch):
  """The kernel replaced by the XLA twin on its padded ``[b, h, T, d]`` inputs: what the wrapper
  adds (padding to the tiles and to head_dim 32, the layout, the lse, the XLA backward) is exact."""
  def fake_forward(q, k, v, *, scale, kv_len, q_offset, causal, tiles):
    assert q.shape[2] % tiles.block_m == 0 and k.shape[2] % tiles.block_n == 0 and q.shape[3] == 32
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    args = common.validate(t(q), t(k)[:, :kv_len], t(v)[:, :kv_len], mask=M.Causal() if causal else None,
                           scale=scale, q_offset=q_offset)
    out, lse = xla.blockwise_attention(args)
    return t(out), lse
  monkeypatch.setattr(TF, "flash_forward", fake_forward)
  monkeypatch.setattr(JT, "require_backend", lambda *a, **k: None)
  monkeypatch.setattr(JT.importlib.util, "find_spec", lambda name: object())
  q, k, v = _inputs(tq=40, tk=52)
  for mask, off in ((M.Causal(), 12), (None, 0)):
    args = common.validate(q, k, v, mask=mask, q_offset=off)
    f = lambda q, k, v, fn: fn(common.validate(q, k, v, mask=mask, q_offset=off))[0].astype(jnp.float32).sum()  # noqa: E731
    out, lse = JT.jax_triton_attention(args)
    ref, ref_lse = xla.blockwise_attention(args)
    np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(jnp.float32), atol=1e-2)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-2)
    g = jax.grad(f, (0, 1, 2))(q, k, v, JT.jax_triton_attention)
    g_ref = jax.grad(f, (0, 1, 2))(q, k, v, xla.blockwise_attention)
    for a, b in zip(g, g_ref):
      np.testing.assert_allclose(a.astype(jnp.float32), b.astype(jnp.float32), atol=2e-2)
