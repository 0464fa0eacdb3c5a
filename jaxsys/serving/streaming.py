"""Streaming-head identification (DuoAttention, Xiao et al. 2024), as used by LServe.

Every (layer, kv head) gets a gate ``alpha in [0, 1]``; the gated model mixes, per head,

  attn(x) = alpha * full_attention(x) + (1 - alpha) * streaming_attention(x)

where streaming attention sees ``Sink(sink) | Local(window)``. With the model frozen, the gates
are trained to reproduce the full model's final hidden states on the answer tokens of synthetic
passkey sequences (distillation), with an L1 penalty pushing gates to 0:

  loss = mean_{answer tokens} || h_gated - h_full ||^2 + l1 * mean(alpha)

Heads whose gate ends in the lowest ``sparsity`` quantile become streaming heads (they do not
need the distant context on this data); the rest stay retrieval heads. ``StreamingGates``
saves/loads as a small JSON file.

Usage::

  gates = identify_streaming_heads(model, (tokens, answer_mask), sink=16, window=64, sparsity=0.5)
  gates.save("gates.json"); gates = StreamingGates.load("gates.json")
  ServingEngine(model, cfg, streaming=gates.streaming)
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.optim import OptimizerConfig
from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.ops import attention, masks
from jaxsys.train import apply_optax

__all__ = ["far_attention_scores", "FarAttentionProbe", "gated_hidden", "GateMix",
           "identify_streaming_heads", "rank_streaming_heads", "StreamingGates"]


@dataclasses.dataclass(frozen=True)
class StreamingGates:
  """Learned gates ``alpha [layers, kv_heads]`` and the resulting streaming flags."""
  alpha: tuple[tuple[float, ...], ...]
  streaming: tuple[tuple[bool, ...], ...]
  sink: int
  window: int
  sparsity: float
  history: tuple[float, ...] = ()

  @classmethod
  def from_alpha(cls, alpha, *, sink, window, sparsity, history=()):
    """Streaming = the ``round(sparsity * heads)`` heads with the smallest gates."""
    a = np.asarray(alpha, np.float64)
    if not 0.0 <= sparsity <= 1.0:
      raise ConfigError(f"sparsity={sparsity} must be in [0, 1]")
    n = int(round(sparsity * a.size))
    flags = np.zeros(a.size, bool)
    flags[np.argsort(a.reshape(-1), kind="stable")[:n]] = True
    return cls(tuple(map(tuple, a.round(6).tolist())), tuple(map(tuple, flags.reshape(a.shape).tolist())),
               int(sink), int(window), float(sparsity), tuple(float(h) for h in history))

  def with_sparsity(self, sparsity: float) -> "StreamingGates":
    return StreamingGates.from_alpha(self.alpha, sink=self.sink, window=self.window,
                                     sparsity=sparsity, history=self.history)

  def save(self, path) -> None:
    """Writes our JSON atomically (a reader never sees a partial file)."""
    from jaxsys.core.checkpoint import write_atomic
    write_atomic(path, json.dumps(dataclasses.asdict(self)))

  @classmethod
  def load(cls, path, *, sparsity: float = 0.5, sink: int | None = None,
           window: int | None = None) -> "StreamingGates":
    """Our JSON, or DuoAttention's / omniserve's ``full_attention_heads.tsv`` (``*.tsv``): one line
    per layer of tab-separated per-kv-head gate values. For a TSV the ``sparsity`` lowest gates
    become streaming heads (DuoAttention's ``sparsify_attention_heads``); ``sink`` / ``window``
    default to ``sink_size`` / ``recent_size`` of the ``config.json`` beside it, else 64 / 256."""
    from jaxsys.core.errors import InputError
    path = Path(path)
    if not path.is_file():
      raise InputError(f"gates file {path} does not exist")
    try:
      if path.suffix == ".tsv":
        alpha = np.loadtxt(path, dtype=np.float64, delimiter="\t", ndmin=2)
        meta = path.with_name("config.json")
        cfg = json.loads(meta.read_text()) if meta.exists() else {}
        return cls.from_alpha(alpha, sink=cfg.get("sink_size", 64) if sink is None else sink,
                              window=cfg.get("recent_size", 256) if window is None else window,
                              sparsity=sparsity)
      d = json.loads(path.read_text())
      return cls(tuple(map(tuple, d["alpha"])), tuple(map(tuple, d["streaming"])), d["sink"],
                 d["window"], d["sparsity"], tuple(d.get("history", ())))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
      raise InputError(f"gates file {path} is not a gates JSON or DuoAttention TSV "
                       f"({type(e).__name__}: {e})") from e

  def save_tsv(self, path) -> None:
    """Writes the gates in DuoAttention's ``full_attention_heads.tsv`` format."""
    import io
    from jaxsys.core.checkpoint import write_atomic
    buf = io.StringIO()
    np.savetxt(buf, np.asarray(self.alpha), delimiter="\t", fmt="%.6f")
    write_atomic(path, buf.getvalue())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GateMix:
  """A cache of the decoding core (``jaxsys.decoding.cache``) with no storage: each layer's
  attention is ``alpha * full + (1 - alpha) * streaming`` per kv head (``alpha [layers, kv_heads]``;
  ``None``: the layer's own attention only). Full attention uses the layer's mask (causal or its
  sliding window); streaming attention sees ``Sink(sink) | Local(window)`` within that mask."""
  alpha: Any
  sink: int = dataclasses.field(default=64, metadata=dict(static=True))
  window: int = dataclasses.field(default=256, metadata=dict(static=True))
  impl: str = dataclasses.field(default="auto", metadata=dict(static=True))

  lengths = None

  def attend(self, layer: int, attn, q, k, v):
    full = attention(q, k, v, mask=attn.mask, impl=self.impl)  # [b, T, heads, d]
    if self.alpha is None:
      return full, self
    stream_mask = masks.Sink(self.sink) | masks.Local(self.window)
    if attn.sliding_window is not None:
      stream_mask = attn.mask & stream_mask
    stream = attention(q, k, v, mask=stream_mask, impl=self.impl)
    g = q.shape[2] // k.shape[2]
    a = jnp.repeat(self.alpha[layer], g)[None, None, :, None].astype(full.dtype)  # per query head
    return a * full + (1 - a) * stream, self

  def advance(self, seq: int) -> "GateMix":
    return self


def gated_hidden(model, tokens, alpha, *, sink: int, window: int, impl: str = "auto"):
  """Final hidden states ``[b, T, embed]`` of the gate-mixed model (alpha ``[layers, kv_heads]``;
  alpha = None runs plain full attention)."""
  h, _ = model.forward_hidden(tokens, cache=GateMix(alpha, sink=sink, window=window, impl=impl))
  return h


def identify_streaming_heads(model, data, *, sink: int = 64, window: int = 256,
                             sparsity: float = 0.5, steps: int = 100, lr: float = 0.05,
                             l1: float = 0.05, batch_size: int = 4, seed: int = 0,
                             impl: str = "auto", progress: bool = True) -> StreamingGates:
  """Learns gates by distillation on ``data = (tokens int[n, T], answer_mask bool[n, T])``.

  The model stays frozen; only the ``[layers, kv_heads]`` gates train (Adam, clipped to
  [0, 1] after each step, initialised at 1 = full attention). ``progress``: a tqdm bar on
  stderr with the distillation loss.
  """
  from jaxsys.core.step import run_steps
  tokens, answer = _answer_data(data)
  if not answer.any():
    raise ShapeError("answer_mask selects no token to distill on")
  for name, val in (("steps", steps), ("batch_size", batch_size), ("window", window)):
    if val < 1:
      raise ConfigError(f"{name}={val} must be >= 1")
  mc = model.config
  graphdef, params = nnx.split(model)
  alpha = jnp.ones((mc.num_layers, mc.num_kv_heads), jnp.float32)
  opt = _adam(float(lr))  # one object per lr: the jitted step takes it as a static argument
  opt_state = opt.init(alpha)
  rng = np.random.default_rng(seed)

  def draw(s, alpha, rest):
    idx = rng.choice(len(tokens), size=min(batch_size, len(tokens)), replace=False)
    return jnp.asarray(tokens[idx], jnp.int32), jnp.asarray(answer[idx])

  def step(alpha, opt_state, rest, tok, ans):  # the model is frozen: only the gates train
    alpha, opt_state, loss = _gate_step(graphdef, params, alpha, opt_state, tok, ans, opt, sink, window, l1, impl)
    return alpha, opt_state, loss, None, rest

  run = run_steps(step, alpha, opt_state, None, draw, steps=steps, sync=True, progress=progress,
                  desc="streaming gates")
  alpha, history = run.params, [h["loss"] for h in run.history]
  return StreamingGates.from_alpha(np.asarray(alpha), sink=sink, window=window,
                                   sparsity=sparsity, history=history)


@functools.lru_cache(maxsize=8)
def _adam(lr: float):
  return OptimizerConfig("adam", lr).build()


def _answer_data(data):
  """``data = (tokens int[n, T], answer_mask bool[n, T])`` as numpy arrays, shapes checked."""
  tokens, answer = (np.asarray(x) for x in data)
  if tokens.ndim != 2 or answer.shape != tokens.shape:
    raise ShapeError(f"data must be (tokens int[n, T], answer_mask bool[n, T]), got "
                     f"{tokens.shape} and {answer.shape}")
  return tokens, answer


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9, 10))
def _gate_step(graphdef, params, alpha, opt_state, tokens, answer, opt, sink, window, l1, impl):
  model = nnx.merge(graphdef, params)
  target = jax.lax.stop_gradient(gated_hidden(model, tokens, None, sink=sink, window=window, impl=impl))
  w = answer.astype(jnp.float32)[..., None]

  def loss_fn(a):
    h = gated_hidden(model, tokens, a, sink=sink, window=window, impl=impl)
    mse = jnp.sum(w * (h - target) ** 2) / (jnp.sum(w) * h.shape[-1])
    return mse + l1 * jnp.mean(jnp.abs(a)), mse

  (loss, mse), grad = jax.value_and_grad(loss_fn, has_aux=True)(alpha)
  alpha, opt_state = apply_optax(opt, grad, opt_state, alpha)
  alpha = jnp.clip(alpha, 0.0, 1.0)  # projected: gates stay in [0, 1]
  return alpha, opt_state, mse


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FarAttentionProbe:
  """A cache of the decoding core that runs each layer's own attention and records, per kv head,
  the attention mass that the query states at ``idx`` put on keys outside ``Sink(sink) |
  Local(window)``: what a streaming head would lose there.

  ``idx int[A]``: query positions of a call without a cache (key ``t`` = position ``t``).
  ``stats``: one ``f32[kv_heads]`` per layer already run (the mean over the batch, ``idx`` and
  the kv head's query heads)."""
  idx: Any
  stats: tuple = ()
  sink: int = dataclasses.field(default=64, metadata=dict(static=True))
  window: int = dataclasses.field(default=256, metadata=dict(static=True))

  lengths = None

  def attend(self, layer: int, attn, q, k, v):
    out = attn.attend(q, k, v)                               # the layer's own attention
    b, _, h, d = q.shape
    hk = k.shape[2]
    qs = q[:, self.idx].reshape(b, -1, hk, h // hk, d)       # [b, A, kv_heads, group, d]
    s = jnp.einsum("bakgd,btkd->bkgat", qs, k, preferred_element_type=jnp.float32) / np.sqrt(d)
    t, i = jnp.arange(k.shape[1])[None], self.idx[:, None]   # [1, T], [A, 1]
    # the layer's own mask and the streaming heads' (GateMix's), evaluated at the probed rows
    p = jax.nn.softmax(jnp.where(attn.mask.visible(i, i, t), s, -jnp.inf), -1)  # [b, kv, g, A, T]
    kept = (masks.Sink(self.sink) | masks.Local(self.window)).visible(i, i, t)  # [A, T]
    far = jnp.sum(jnp.where(kept, 0.0, p), -1)              # [b, kv_heads, group, A]
    return out, dataclasses.replace(self, stats=self.stats + (far.mean((0, 2, 3)),))

  def advance(self, seq: int) -> "FarAttentionProbe":
    return self


def far_attention_scores(model, data, *, sink: int = 64, window: int = 256,
                         progress: bool = True) -> np.ndarray:
  """``f32[layers, kv_heads]``: the mean attention mass each kv head puts outside
  ``Sink(sink) | Local(window)`` at the first answer state of each sequence of ``data =
  (tokens int[n, T], answer_mask bool[n, T])``, in the full model (one forward pass per sequence,
  no gradient). The first answer state is the one the prefill decides, before any of the answer is
  in the context (later answer states can copy from the answer tokens already written).

  This is the part of a head's attention that turning it into a streaming head removes, measured
  at the length it will serve: DuoAttention's distillation asks the same question through the
  final hidden states, but needs a backward pass at that length (on SmolLM2 at 8K tokens,
  ~3 min per sequence on a 2-core CPU against ~35 s for this forward pass)."""
  from tqdm.auto import tqdm
  tokens, answer = _answer_data(data)
  if not answer.any(-1).all():
    raise ShapeError("answer_mask must select at least one token in every sequence")
  if window < 1 or sink < 0:
    raise ConfigError(f"window={window} must be >= 1 and sink={sink} >= 0")
  graphdef, params = nnx.split(model)
  total = np.zeros((model.config.num_layers, model.config.num_kv_heads))
  for row in tqdm(range(len(tokens)), desc="far attention", disable=not progress, leave=False):
    idx = np.nonzero(answer[row])[0][:1].astype(np.int32)
    total += np.asarray(_far_scores(graphdef, params, jnp.asarray(tokens[row:row + 1], jnp.int32),
                                    jnp.asarray(idx), sink, window))
  return (total / len(tokens)).astype(np.float32)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _far_scores(graphdef, params, tokens, idx, sink, window):
  model = nnx.merge(graphdef, params)
  _, probe = model.forward_hidden(tokens, cache=FarAttentionProbe(idx, sink=sink, window=window))
  return jnp.stack(probe.stats)                              # [layers, kv_heads]


def rank_streaming_heads(model, data, *, sink: int = 64, window: int = 256, sparsity: float = 0.5,
                         progress: bool = True) -> StreamingGates:
  """Streaming heads = the ``sparsity`` fraction with the least attention outside
  ``Sink(sink) | Local(window)`` at the answer states (:func:`far_attention_scores`); the gates
  are those scores over their maximum (so the file and TSV formats, and ``with_sparsity``, work
  as for learned gates).

  ``data``: one ``(tokens, answer_mask)`` pair, or a list of them (e.g. one per context length),
  whose scores are averaged with equal weight. Use the lengths to be served: a head's far mass
  changes with the context it spreads over. On SmolLM2 (passkey, 16 seeds, half the kv heads
  streaming, sink 64 + window 256) heads ranked on 8K documents kept 75 % at 8K (gates distilled
  on 1K documents: 56 %, dense 81 %) but 81 % at 2K (distilled and dense: 94 %); ranked on 2K + 4K
  + 8K documents, 75 % at 2K. So no single ranking held at every length there."""
  sets = data if isinstance(data, list) else [data]
  score = np.mean([far_attention_scores(model, d, sink=sink, window=window, progress=progress)
                   for d in sets], 0)
  return StreamingGates.from_alpha(score / max(float(score.max()), 1e-12), sink=sink, window=window,
                                   sparsity=sparsity)
