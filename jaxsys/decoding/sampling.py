"""The one sampling module: parameters, the distribution they define, and drawing from it.

Every sampler in the library (``generate``, the serving engine, the rollout engine, speculative
acceptance) uses :class:`SamplingParams` with one convention, vLLM's: ``temperature == 0`` is
greedy, ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` are off. Lossless speculative sampling must reproduce
*the distribution vanilla sampling draws from*, so temperature / top-k / top-p are applied to the
target logits first (the processed distribution ``p``) and acceptance works on ``p``.

Usage::

  params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=0)
  probs = target_probs(logits, params)          # float32 [..., vocab], rows sum to 1
  token = sample(key, logits, params)           # vanilla sampling from the same distribution

Inside a compiled loop whose temperature / top-p should not be compile-time constants,
:func:`sample_logits` takes them as traced values (only ``greedy`` and ``top_k`` are static).
A batch whose rows each carry their own parameters (the serving engine's requests) samples with
:func:`sample_rows` (every parameter a traced ``[batch]`` array, one key per row) and reports
log-probabilities with :func:`token_logprobs`.

Penalties and bias (OpenAI's ``frequency_penalty`` / ``presence_penalty`` / ``logit_bias``, HF's and
vLLM's ``repetition_penalty``) change the logits before the filter, per row, in :func:`penalize`:
:class:`Penalties` carries them as traced ``[batch]`` / ``[batch, vocab]`` arrays, applied to the
logits that :func:`sample_rows` (and a greedy argmax) then draw from; a batch where no row has any
passes no ``Penalties`` and its program has no trace of them. The on-device loop of ``generate``
carries them in its state (:meth:`Penalties.record` adds each step's token); paths without a token
history (:func:`sample`, :func:`target_probs`) refuse penalized params with a ``ConfigError``
rather than ignore them. The log-probabilities a server or ``generate`` reports stay the model's
own (before penalties, temperature and filters).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import ConfigError

__all__ = [
    "filtered_logits", "GREEDY", "Penalties", "penalize", "sample", "sample_logits", "sample_probs", "sample_rows",
    "SamplingParams", "target_probs", "token_logprobs", "unpack_allowed",
]


#: Largest seed: the key is ``jax.random.key(uint32 seed)`` on every path.
MAX_SEED = 2**32 - 1
#: Largest temperature: the samplers divide float32 logits by it (beyond ~1e4 every row is uniform
#: anyway, and past float32's range it would silently become inf).
MAX_TEMPERATURE = 1e4
#: Largest repetition penalty (vLLM accepts any positive value; past this every seen token is banned anyway).
MAX_REPETITION_PENALTY = 100.0


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """``temperature`` >= 0 (0: greedy), ``top_k`` >= 0 (0: off), ``top_p`` in (0, 1] (1: off);
  ``min_p`` in [0, 1] (0: off) drops tokens less likely than ``min_p`` times the most likely one;
  ``seed`` (an int in [0, 2**32 - 1]) makes a sampled run reproducible.

  Penalties (:func:`penalize`; all off by default): ``frequency_penalty`` and ``presence_penalty`` in
  [-2, 2] subtract ``count x frequency + (count > 0) x presence`` from the logit of each token generated
  ``count`` times so far; ``repetition_penalty`` > 0 (1: off) divides the positive logits and
  multiplies the negative ones of every token in the prompt or the output; ``logit_bias`` ``((token id,
  bias in [-100, 100]), ...)`` is added to those tokens' logits (-100 bans a token, +100 forces it)."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  min_p: float = 0.0
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: tuple[tuple[int, float], ...] = ()

  def __post_init__(self):
    t, k, p = self.temperature, self.top_k, self.top_p
    if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED:
      raise ConfigError(f"seed={self.seed!r} must be an int in [0, {MAX_SEED}] (a uint32 PRNG seed)")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE:
      raise ConfigError(f"temperature={t!r} must be a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
      raise ConfigError(f"top_k={k!r} must be an int >= 0 (0 disables top-k)")
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0):
      raise ConfigError(f"top_p={p!r} must be in (0, 1] (1 disables top-p)")
    m = self.min_p
    if not isinstance(m, (int, float)) or isinstance(m, bool) or not (0.0 <= m <= 1.0):
      raise ConfigError(f"min_p={m!r} must be in [0, 1] (0 disables min-p)")
    for name in ("frequency_penalty", "presence_penalty"):
      v = getattr(self, name)
      if not _is_number(v) or not -2.0 <= v <= 2.0:
        raise ConfigError(f"{name}={v!r} must be a number in [-2, 2] (0 disables it)")
    r = self.repetition_penalty
    if not _is_number(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
      raise ConfigError(f"repetition_penalty={r!r} must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 disables it)")
    bias = self.logit_bias
    if isinstance(bias, dict):  # OpenAI's {"token id": bias} shape
      bias = tuple(bias.items())
    try:
      bias = tuple(sorted((int(t), float(b)) for t, b in bias
                          if (isinstance(t, (int, str)) and not isinstance(t, bool) and _is_number(b))))
    except (TypeError, ValueError):
      bias = None
    if bias is None or len(bias) != len(self.logit_bias) or len({t for t, _ in bias}) != len(bias) or \
        any(t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
      raise ConfigError(f"logit_bias={self.logit_bias!r} must map distinct token ids >= 0 to biases in [-100, 100]")
    object.__setattr__(self, "logit_bias", bias)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def penalized(self) -> bool:
    """Whether any penalty or bias is on (only then do samplers pay for them)."""
    return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                or self.logit_bias)

  def without_penalties(self) -> "SamplingParams":
    """These parameters with penalties and bias off: for a path that applies :func:`penalize`
    itself (with its own token history) and then filters and draws with the rest."""
    return dataclasses.replace(self, frequency_penalty=0.0, presence_penalty=0.0,
                               repetition_penalty=1.0, logit_bias=())

  def check_vocab(self, vocab: int):
    if self.top_k > vocab:
      raise ConfigError(f"top_k={self.top_k} must be <= vocab size {vocab}")
    if any(t >= vocab for t, _ in self.logit_bias):
      raise ConfigError(f"logit_bias has token ids >= vocab size {vocab}: "
                        f"{[t for t, _ in self.logit_bias if t >= vocab][:8]}")


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Penalties(NamedTuple):
  """Per-row penalty state, traced (a pytree): ``counts float32[b, vocab]`` (times each token was
  generated), ``seen bool[b, vocab]`` (token in the prompt or the output), ``frequency``,
  ``presence``, ``repetition`` ``float32[b]``, ``bias float32[b, vocab]``. :meth:`rows` builds it
  on the host."""
  counts: Any
  seen: Any
  frequency: Any
  presence: Any
  repetition: Any
  bias: Any

  @staticmethod
  def rows(params, outputs, prompts, vocab: int, batch: int) -> "Penalties":
    """Row ``i`` from ``params[i]`` (a :class:`SamplingParams`), its generated ``outputs[i]`` and its
    ``prompts[i]`` (token ids), padded with neutral rows to ``batch`` rows (fixed shapes)."""
    counts = np.zeros((batch, vocab), np.float32)
    seen = np.zeros((batch, vocab), bool)
    bias = np.zeros((batch, vocab), np.float32)
    scal = np.zeros((3, batch), np.float32)
    scal[2] = 1.0
    for i, (p, out, prompt) in enumerate(zip(params, outputs, prompts)):
      if not p.penalized:
        continue
      counts[i] = np.bincount(np.asarray(out, np.int64), minlength=vocab)[:vocab]
      if p.repetition_penalty != 1.0:
        seen[i, np.asarray(prompt, np.int64)] = True
        seen[i] |= counts[i] > 0
      for t, b in p.logit_bias:
        bias[i, t] = b
      scal[:, i] = (p.frequency_penalty, p.presence_penalty, p.repetition_penalty)
    return Penalties(counts, seen, scal[0], scal[1], scal[2], bias)

  @staticmethod
  def init(params: "SamplingParams", batch: int, vocab: int) -> "Penalties":
    """``batch`` rows that all use ``params``, with no history yet (built inside a program)."""
    bias = jnp.zeros((vocab,), jnp.float32)
    if params.logit_bias:
      ids, vals = zip(*params.logit_bias)
      bias = bias.at[jnp.asarray(ids)].set(jnp.asarray(vals, jnp.float32))
    full = lambda v: jnp.full((batch,), v, jnp.float32)  # noqa: E731
    return Penalties(jnp.zeros((batch, vocab), jnp.float32), jnp.zeros((batch, vocab), bool),
                     full(params.frequency_penalty), full(params.presence_penalty),
                     full(params.repetition_penalty), jnp.broadcast_to(bias, (batch, vocab)))

  def record_prompts(self, prompts, lengths) -> "Penalties":
    """Marks each row's prompt tokens seen (``prompts int32[b, Lp]`` right-padded, true
    ``lengths int32[b]``): the repetition penalty covers the prompt, as in HF and vLLM."""
    b, lp = prompts.shape
    valid = jnp.arange(lp)[None] < lengths[:, None]
    cols = jnp.where(valid, prompts, self.seen.shape[1])  # padding -> out of range, dropped
    return self._replace(seen=self.seen.at[jnp.arange(b)[:, None], cols].set(True, mode="drop"))

  def record(self, tokens, live) -> "Penalties":
    """The state after row ``i`` generated ``tokens[i]`` (``int32[b]``), for the rows where ``live
    bool[b]`` holds: an on-device loop keeps its history with this instead of the host."""
    rows = jnp.arange(tokens.shape[0])
    counts = self.counts.at[rows, tokens].add(live.astype(self.counts.dtype))
    seen = self.seen.at[rows, tokens].set(self.seen[rows, tokens] | live)
    return self._replace(counts=counts, seen=seen)


def penalize(logits, pen: Penalties):
  """``logits float32[b, vocab]`` with each row's penalties and bias applied, in vLLM's order:
  repetition (divide positive / multiply negative logits of seen tokens), then frequency and
  presence (subtract ``count x frequency + (count > 0) x presence``), then the additive bias."""
  col = lambda a: jnp.asarray(a, jnp.float32)[:, None]  # noqa: E731  ([b] -> [b, 1])
  x = logits.astype(jnp.float32)
  rep = col(pen.repetition)
  x = jnp.where(pen.seen, jnp.where(x > 0, x / rep, x * rep), x)
  counts = jnp.asarray(pen.counts, jnp.float32)
  x = x - counts * col(pen.frequency) - (counts > 0) * col(pen.presence)
  return x + pen.bias


def unpack_allowed(bits, vocab: int):
  """Grammar masks packed 32 tokens to a word (``uint32[b, ceil(vocab / 32)]``, bit ``i % 32`` of
  word ``i // 32`` is token ``i``: llguidance's layout) -> ``bool[b, vocab]``, True where allowed."""
  idx = jnp.arange(vocab, dtype=jnp.uint32)
  return ((jnp.asarray(bits, jnp.uint32)[:, idx // 32] >> (idx % 32)) & 1).astype(bool)


GREEDY = SamplingParams(temperature=0.0)


def _no_penalties(params: SamplingParams, where: str) -> None:
  if params.penalized:
    raise ConfigError(f"{where} has no token history to apply frequency/presence/repetition penalties or "
                      "logit_bias to; they are applied by the serving engine (ServingEngine, jaxsys serve)")


def filtered_logits(logits, params: SamplingParams):
  """Temperature-scaled logits with filtered-out tokens at -inf (float32). Not for greedy."""
  _no_penalties(params, "filtered_logits")
  return _filter(logits, params.temperature, params.top_k, params.top_p if params.top_p < 1.0 else None,
                 params.min_p or None)


def _filter(logits, temperature, top_k, top_p, min_p=None):
  """The one sampling filter (every path samples through it): temperature, then top-k, top-p and
  min-p, as ``SamplingParams`` defines them. ``logits float32[..., vocab]``.

  ``temperature``, ``top_p`` and ``min_p`` are None (off; not temperature) or scalars / arrays
  broadcasting against ``logits[..., :1]``, traced or not (``top_p >= 1`` and ``min_p <= 0`` are
  off per row). ``top_k`` is a static int (0: off) or an int array like the others (0 per row:
  off). A static ``top_k`` without ``top_p`` is one ``lax.top_k``; otherwise one descending sort
  of each row serves both top-k and top-p: top-p keeps the smallest prefix whose mass reaches
  ``top_p`` (the token that crosses it stays, so at least one token survives), and tokens tied
  at a threshold all stay."""
  x = logits.astype(jnp.float32) / temperature
  vocab = x.shape[-1]
  static_k = isinstance(top_k, int)
  if static_k and top_p is None:
    if top_k and top_k < vocab:
      kth = jax.lax.top_k(x, top_k)[0][..., -1:]
      x = jnp.where(x < kth, -jnp.inf, x)
  else:
    desc = -jnp.sort(-x, axis=-1)                                     # [..., vocab]
    if static_k:
      k = jnp.full(x.shape[:-1] + (1,), min(top_k, vocab) if top_k else vocab)
    else:
      k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
      k = jnp.broadcast_to(k, x.shape[:-1] + (1,))
    rank = jnp.arange(vocab)
    desc = jnp.where(rank < k, desc, -jnp.inf)                         # top-k on the sorted row
    x = jnp.where(x < jnp.take_along_axis(desc, k - 1, axis=-1), -jnp.inf, x)
    if top_p is not None:
      p = jax.nn.softmax(desc, axis=-1)
      keep = ((jnp.cumsum(p, axis=-1) - p) < top_p) | (top_p >= 1.0)
      last = jnp.sum(keep, axis=-1, keepdims=True) - 1
      x = jnp.where(x < jnp.take_along_axis(desc, last, axis=-1), -jnp.inf, x)
  if min_p is not None:
    x = jnp.where(jnp.asarray(min_p) > 0, _min_p(x, min_p), x)
  return x


def _min_p(x, min_p):
  """Drops tokens whose probability is below ``min_p`` x the largest (Nguyen et al. 2024, min-p
  sampling): in log space ``x < max(x) + log(min_p)``; ``min_p`` broadcasts against ``x[..., :1]``."""
  thresh = jnp.max(x, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p, 1e-30))
  return jnp.where(x < thresh, -jnp.inf, x)


def target_probs(logits, params: SamplingParams):
  """The processed distribution ``p`` (float32 ``[..., vocab]``) vanilla sampling draws from."""
  _no_penalties(params, "target_probs")
  if params.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(filtered_logits(logits, params), axis=-1)


def sample(key, logits, params: SamplingParams):
  """Vanilla sampling from ``target_probs(logits, params)``: int32 ``[...]``."""
  _no_penalties(params, "sample")
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits, params), axis=-1).astype(jnp.int32)


def sample_logits(key, logits, *, greedy: bool, temperature=1.0, top_k: int = 0, top_p=None,
                  min_p=None):
  """:func:`sample` with traced ``temperature`` / ``top_p`` / ``min_p`` (None: off; ``greedy``
  and ``top_k`` static): ``logits float32[..., vocab] -> int32[...]``."""
  if greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  x = _filter(logits, temperature, top_k, top_p, min_p)
  return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


def loop_params(params: SamplingParams, *, max_new: int, stops, prompts=None, vocab: int = 0,
                batch: int = 0) -> tuple[tuple, dict]:
  """What the on-device decode loop (``jaxsys.decoding.core.decode_loop``) takes for
  ``params``: ``(mode, traced)`` with ``mode = (greedy, top_k, use_top_p, use_min_p)``
  static and ``traced`` the seed, temperature, top_p, min_p, ``max_new`` and ``stops int32[n]``
  arrays, plus ``pen`` (:class:`Penalties` of ``batch`` rows, from the token-id ``prompts``) when
  ``params`` has penalties or bias. The one place these are built: every caller of the loop
  (``generate``, video GRPO) samples from :func:`target_probs`' distribution, min-p included."""
  mode = (params.greedy, params.top_k, params.top_p < 1.0, params.min_p > 0.0)
  traced = {"seed": jnp.uint32(params.seed), "temperature": jnp.float32(max(params.temperature, 1e-6)),
            "top_p": jnp.float32(params.top_p), "min_p": jnp.float32(params.min_p),
            "max_new": jnp.int32(max_new), "stops": jnp.asarray(tuple(stops) or (-1,), jnp.int32)}
  if params.penalized:
    if prompts is None or vocab < 1 or batch < len(prompts):
      raise ConfigError("penalties and logit_bias need the prompts, the vocab size and the batch: "
                        "this caller of the decode loop does not pass them")
    pen = Penalties.rows([params] * len(prompts), [()] * len(prompts), prompts, vocab, batch)
    traced["pen"] = Penalties(*(jnp.asarray(a) for a in pen))
  return mode, traced


def sample_probs(key, probs):
  """Samples from explicit probabilities ``[..., vocab]`` (rows need not be normalised)."""
  logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
  return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


def sample_rows(keys, logits, temperature, top_k, top_p, min_p):
  """Per-row sampling: row ``i`` of ``logits float32[b, vocab]`` is drawn with ``keys[i]`` from the
  distribution of ``SamplingParams(temperature[i], top_k[i], top_p[i], min_p=min_p[i])`` (all
  parameters traced ``[b]`` arrays; ``temperature[i] == 0`` is greedy) through the one filter,
  :func:`_filter` (penalties, where a row has them, are applied to ``logits`` first by
  :func:`penalize`). Returns ``int32[b]``. A row's draw depends only on its own key and logits, so a
  request samples the same tokens whichever other requests share its batch."""
  greedy = temperature <= 0
  col = lambda a: jnp.asarray(a)[:, None]  # noqa: E731  ([b] -> [b, 1], against [b, vocab])
  x = _filter(logits, col(jnp.where(greedy, 1.0, temperature)), col(top_k), col(top_p), col(min_p))
  drawn = jax.vmap(lambda kk, row: jax.random.categorical(kk, row))(keys, x)
  return jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)


def token_logprobs(logits, tokens, top: int):
  """The model's log-probabilities (temperature 1, before any filter, as the OpenAI API reports
  them): ``(chosen float32[b], top_ids int32[b, top], top_logprobs float32[b, top])``."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
  vals, ids = jax.lax.top_k(logp, top)
  return chosen, ids.astype(jnp.int32), vals
