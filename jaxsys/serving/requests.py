"""Requests of the step-level engine: per-request parameters, their running state, step outputs.

:class:`RequestParams` is what one request asks for (vLLM's ``SamplingParams``, OpenAI's request
fields): the sampling distribution (temperature, top-p, top-k, min-p, seed; frequency, presence and
repetition penalties and a logit bias, :func:`jaxsys.decoding.sampling.penalize`), when to stop
(``max_tokens``, stop strings, stop token ids, EOS unless ``ignore_eos``, a completed ``grammar``),
the ``grammar`` its output must follow (``serving.structured``), log-probabilities
(``logprobs`` of the chosen tokens, ``top_logprobs`` alternatives) and ``n`` choices. A request
with ``n > 1`` runs as ``n`` sequences (choice ``i`` draws with ``fold_in(seed, i)``); they share
the prompt's pages through the prefix cache.

``ServingEngine.step()`` returns one :class:`StepOutput` per sequence that made progress: its new
token ids, the new text (held back while it may still become a stop string or ends inside a
multi-byte character) and, when it finished, why (``"stop"`` or ``"length"``, OpenAI's names).

Usage::

  params = RequestParams(max_tokens=32, temperature=0.7, top_p=0.9, stop=("\\n\\n",), seed=1)
  engine.add_request([{"role": "user", "content": "Hi"}], params, "req-1")
  for out in engine.step():
    print(out.request_id, out.index, out.new_token_ids, out.new_text, out.finish_reason)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxsys.core.errors import ConfigError
from jaxsys.decoding.sampling import SamplingParams

__all__ = ["MAX_TOP_LOGPROBS", "RequestParams", "SeqState", "StepOutput", "TextStream", "TokenLogprob"]

#: ``top_logprobs`` upper bound (OpenAI's); the engine always computes this many alternatives.
MAX_TOP_LOGPROBS = 20


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class RequestParams:
  """Per-request generation parameters; see the module docstring. ``seed=None`` draws one."""
  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  seed: int | None = None
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  logprobs: bool = False
  top_logprobs: int = 0
  n: int = 1
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: tuple[tuple[int, float], ...] = ()   # ((token id, bias), ...) or OpenAI's {"id": bias}
  grammar: str | None = None          # llguidance grammar the output must follow (serving.structured)

  def __post_init__(self):
    if isinstance(self.stop, str):
      object.__setattr__(self, "stop", (self.stop,))
    object.__setattr__(self, "stop", tuple(self.stop))
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
    if not _is_int(self.max_tokens) or self.max_tokens < 1:
      raise ConfigError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
    if not _is_int(self.n) or self.n < 1:
      raise ConfigError(f"n={self.n!r} must be an int >= 1")
    if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
      raise ConfigError(f"top_logprobs={self.top_logprobs!r} must be an int in [0, {MAX_TOP_LOGPROBS}]")
    if any(not isinstance(s, str) or not s for s in self.stop):
      raise ConfigError(f"stop={self.stop!r} must hold non-empty strings")
    if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
      raise ConfigError(f"grammar={self.grammar!r} must be a non-empty llguidance grammar string "
                        "(serving.structured.grammar_for)")
    if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
      raise ConfigError(f"stop_token_ids={self.stop_token_ids!r} must hold token ids >= 0")
    # validates temperature / top_p / top_k / min_p / seed (a uint32) / penalties / logit_bias
    object.__setattr__(self, "logit_bias", self.sampling().logit_bias)

  def sampling(self, seed: int | None = None) -> SamplingParams:
    """The decoding core's :class:`SamplingParams` of this request (``seed`` overrides)."""
    s = self.seed if seed is None else seed
    return SamplingParams(self.temperature, self.top_k, self.top_p, 0 if s is None else s,
                          min_p=self.min_p, frequency_penalty=self.frequency_penalty,
                          presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                          logit_bias=self.logit_bias)


@dataclasses.dataclass
class TokenLogprob:
  """Log-probability of a generated token and its ``top_logprobs`` alternatives ``(id, logprob)``."""
  token_id: int
  logprob: float
  top: list[tuple[int, float]]


@dataclasses.dataclass
class StepOutput:
  """What one sequence of a request produced in one ``step()``."""
  request_id: str
  index: int                          # choice index (0 .. n-1)
  new_token_ids: list[int]
  new_text: str | None                # None without a tokenizer
  logprobs: list[TokenLogprob] | None
  finished: bool
  finish_reason: str | None           # "stop" | "length" | "abort" | None
  num_prompt_tokens: int
  num_generated: int


# Lifecycle of a sequence: WAITING -> PREFILL (pages held, prompt chunks computed) -> DECODE ->
# FINISHED; preemption sends PREFILL/DECODE back to WAITING (pages freed, recomputed later).
WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


@dataclasses.dataclass
class SeqState:
  """Running state of one choice of a request (host side)."""
  request_id: str
  index: int
  prompt: np.ndarray                  # int32 prompt ids
  params: RequestParams
  seed: int
  arrival: int                        # admission order (FCFS; the newest is preempted first)
  stop_ids: frozenset
  out: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  logits: list = dataclasses.field(default_factory=list)   # [vocab] per token (Scheduler.keep_logits)
  status: str = WAITING
  computed: int = 0                   # tokens whose keys/values are in the cache
  keys: list = dataclasses.field(default_factory=list)   # prefix-cache keys of its full pages
  registered: int = 0                 # pages registered in the prefix cache
  slot: int | None = None
  finish_reason: str | None = None
  text: Any = None                    # TextStream (with a tokenizer)
  preemptions: int = 0
  constraint: Any = None              # serving.structured.Constraint (a request with a grammar)

  @property
  def rid(self) -> tuple[str, int]:
    return (self.request_id, self.index)

  @property
  def tokens(self) -> np.ndarray:
    """Prompt + generated tokens: what a recompute after preemption prefills."""
    return np.concatenate([self.prompt, np.asarray(self.out, np.int32)]) if self.out else self.prompt


class TextStream:
  """Incremental detokenization with stop strings.

  Each new token re-decodes the generated tokens (``skip_special_tokens``) and releases the text
  that can no longer change: not ending inside a multi-byte character (U+FFFD) and not a prefix
  of a stop string still being completed. The first stop string cuts the text (it is not part
  of the reply, as in the OpenAI API) and ends the sequence.
  """

  def __init__(self, tokenizer, stop: tuple[str, ...]):
    self.tokenizer, self.stop = tokenizer, stop
    self.hold = max((len(s) for s in stop), default=1) - 1
    self.sent = 0
    self.text = ""

  def add(self, tokens) -> tuple[str, bool]:
    """``(newly released text, hit a stop string)`` after the generated ``tokens`` so far."""
    text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
    cut = min((k for k in (text.find(s) for s in self.stop) if k >= 0), default=-1)
    if cut >= 0:
      self.text = text[:cut]
      return self.flush(), True
    self.text = text
    safe = len(text) - self.hold
    if text.endswith("\ufffd"):
      safe = min(safe, len(text.rstrip("\ufffd")))
    if safe <= self.sent:
      return "", False
    new, self.sent = text[self.sent:safe], safe
    return new, False

  def flush(self) -> str:
    """The rest of the text (at the end of the sequence)."""
    new = self.text[self.sent:] if len(self.text) > self.sent else ""
    self.sent = max(self.sent, len(self.text))
    return new
