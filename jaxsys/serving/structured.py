"""Structured outputs: a grammar that a sequence's tokens must follow, enforced by a token mask.

A request's ``RequestParams.grammar`` (an llguidance grammar, built by :func:`grammar_for` from a JSON
schema, a regex or a list of choices) gives each of its sequences a :class:`Constraint`: an
``llguidance.LLMatcher`` over the engine's tokenizer (the same ``tokenizers`` JSON the model's
tokenizer uses). Before each draw the scheduler asks every constrained row for the tokens the grammar
allows next (llguidance's packed bitmask, :meth:`Constraint.allowed_bits`, copied to the device
as ``vocab / 8`` bytes per row) and the step's draw (``scheduler.draw``) puts ``-inf`` on the
others' logits after penalties and bias; rows without a grammar add nothing, and a step with no
constrained (or penalized) row builds no mask at all. After the draw the token advances the
matcher; once the grammar is complete (llguidance then allows only EOS) the sequence stops with
``finish_reason "stop"``. llguidance (the ``serve`` extra) is the engine: torch-free, and its mask
costs tens of microseconds per token for JSON schemas.

OpenAI / vLLM request fields (``openai_protocol``): ``response_format`` ``{"type": "json_object"}``
(any JSON object) or ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, and vLLM's
``guided_json``, ``guided_regex``, ``guided_choice``. JSON is compact (no free whitespace between
tokens), so a model cannot wander in whitespace until ``max_tokens``.
"""

from __future__ import annotations

import json
import re
import weakref

import numpy as np

from jaxsys.core.errors import ConfigError, InputError

__all__ = ["Constraint", "grammar_for", "ll_tokenizer"]

_JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance():
  try:
    import llguidance  # noqa: PLC0415  (the serve extra)
  except ImportError as e:
    raise ConfigError("structured outputs need llguidance: pip install 'jaxsys[serve]'") from e
  return llguidance


def grammar_for(*, json_schema=None, regex: str | None = None, choices=None) -> str:
  """The llguidance grammar of exactly one of: a JSON schema (a dict; ``{"type": "object"}`` for any
  object), a regex, or a list of strings to choose from. ``InputError`` naming the argument otherwise."""
  given = [n for n, v in (("json_schema", json_schema), ("regex", regex), ("choices", choices)) if v is not None]
  if len(given) != 1:
    raise InputError(f"give exactly one of json_schema, regex, choices (got {given or 'none'})")
  m = _llguidance().LLMatcher
  if json_schema is not None:
    if not isinstance(json_schema, dict):
      raise InputError(f"json_schema must be a JSON object, got {type(json_schema).__name__}")
    try:
      grammar = m.grammar_from_json_schema(json.dumps(json_schema), defaults=_JSON_OPTIONS)
    except ValueError as e:
      raise InputError(f"json_schema is not a usable JSON schema: {e}") from e
  elif regex is not None:
    if not isinstance(regex, str) or not regex:
      raise InputError("regex must be a non-empty string")
    grammar = m.grammar_from_regex(regex)
  else:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
      raise InputError("choices must be a non-empty list of non-empty strings")
    grammar = m.grammar_from_regex("|".join(re.escape(c) for c in choices))
  is_error, messages = m.validate_grammar_with_warnings(grammar)
  if is_error:
    raise InputError(f"{given[0]} does not compile: {messages[0]}")
  return grammar


# tokenizer -> {(vocab size, eos ids): LLTokenizer}; weak, so a dropped engine frees its entry
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
  """llguidance's view of ``tokenizer`` (a :class:`jaxsys.models.llm.interop.tokenizer.Tokenizer`) over the model's
  ``vocab_size`` ids, ending at ``eos_ids``, built once per tokenizer (~0.5 s for 49K tokens; its
  tokenizers JSON alone takes ~25 ms to serialise, too long for every request)."""
  backend = getattr(tokenizer, "backend", None)
  if backend is None:
    raise ConfigError("structured outputs need a jaxsys.models.Tokenizer (its tokenizers JSON)")
  key = (int(vocab_size), tuple(int(e) for e in eos_ids))
  built = _LL_TOKENIZERS.setdefault(tokenizer, {})
  if key not in built:
    built[key] = _llguidance().LLTokenizer(backend.to_str(), n_vocab=key[0], eos_token=list(key[1]))
  return built[key]


class Constraint:
  """One sequence's grammar state: :meth:`allowed` before a draw, :meth:`advance` after it."""

  def __init__(self, ll_tok, grammar: str):
    self.matcher = _llguidance().LLMatcher(ll_tok, grammar, log_level=0)
    self.vocab = ll_tok.vocab_size
    if self.matcher.is_error():
      raise InputError(f"the requested grammar is invalid: {self.matcher.get_error()}")

  def allowed(self, vocab: int) -> np.ndarray:
    """``bool[vocab]``: the tokens the grammar allows next (bit ``i`` of llguidance's mask is token ``i``)."""
    bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
    mask = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
    return np.pad(mask, (0, vocab - mask.size))

  def allowed_bits(self, words: int) -> np.ndarray:
    """The same mask packed as llguidance computes it: ``uint32[words]``, bit ``i % 32`` of word
    ``i // 32`` is token ``i`` (about 1/32 of the bytes of :meth:`allowed` to copy to the device;
    :func:`jaxsys.decoding.sampling.unpack_allowed` unpacks it there)."""
    bits = np.frombuffer(self.matcher.compute_bitmask(), "<u4")[:words]
    return np.pad(bits, (0, words - bits.size))

  def advance(self, token: int) -> bool:
    """Consumes the drawn token; True once the grammar is complete (or broken: the mask allowed only
    what it accepts, so that means the sequence must end here)."""
    self.matcher.consume_token(int(token))
    return self.matcher.is_stopped() or self.matcher.is_error()
