"""Verifiable chat tasks with naturally long-tailed answers, for a real chat policy (SmolLM2).

Each prompt is one user message, encoded with the tokenizer's chat template (through
``jaxsys.serving.generation.encode_prompts``); the response must end with a final line
``Answer: ...``. Kinds (``N`` is the item or step count):

* ``count``: "Count from a to a+N-1" -> ``a, a+1, ..., a+N-1``.
* ``list``: "List the first N multiples of k" -> ``k, 2k, ..., Nk``.
* ``repeat``: "Repeat the word w N times" -> ``w w ... w``.
* ``sort``: "Sort these N numbers" -> the numbers ascending.
* ``arith``: a chain of N operations on a start value, worked one line per step
  (``7 + 5 = 12``), then ``Answer: <number>``.

``N`` is heavy-tailed: a truncated Zipf law ``P(N = n) ∝ n^(-zipf_a)`` on ``items = (lo, hi)``
(``steps`` for ``arith``), so most answers are short and a few are very long: the regime where a
GRPO rollout waits on its longest responses. Lower ``zipf_a`` or raise ``hi`` for a heavier tail.

Reward (in [0, 1]), as LongVILA-R1 / EasyR1 mix a format reward into the accuracy reward:
``(answer_weight * accuracy + format_weight * format) / (answer_weight + format_weight)``:

* ``format``: 1 if the last non-empty line of the response starts with ``Answer:``, else 0.
* ``accuracy``: from the text after the last ``Answer:``; list kinds score the fraction of items
  right position by position, ``hits / max(len(want), len(got))`` (1 only for the exact list),
  ``arith`` scores 1 for the exact final number, else 0. No ``Answer:`` scores 0.

Usage::

  model, tok = jaxsys.models.load_pretrained("smollm2-135m-instruct")
  tasks = ChatTaskSampler(tok, seed=0)
  trainer = GRPOTrainer(model, engine, tasks, cfg, reward_fn=tasks.reward_fn, pad_id=tasks.pad_id)
  # engine: RolloutConfig(max_prompt >= tasks.max_prompt, max_new >= tasks.max_response,
  #                       stop_tokens=tasks.stop_tokens, ...)
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxsys.core.errors import ConfigError, check_one_of, check_range

__all__ = [
    "ChatExample", "ChatTaskSampler", "KINDS", "make_example", "parse_answer", "score",
    "truncated_zipf",
]

KINDS = ("count", "list", "repeat", "sort", "arith")
WORDS = ("apple", "river", "stone", "cloud", "green", "tiger", "lamp", "music")
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_INT = re.compile(r"-?\d+")
_FMT = "Give the final line as 'Answer: {}'."


@dataclasses.dataclass(frozen=True)
class ChatExample:
  kind: str
  messages: tuple            # chat messages ({"role", "content"} dicts)
  prompt: tuple[int, ...]    # token ids: chat template with the generation prompt
  answer: tuple              # the exact items (ints or words); arith: (final value,)
  reference: str             # a correct worked response (for a supervised warm-up)
  n: int                     # items or steps: the long-tailed size


def truncated_zipf(rng, a: float, lo: int, hi: int) -> int:
  """``n`` in ``[lo, hi]`` with ``P(n) ∝ n^(-a)``."""
  n = np.arange(lo, hi + 1, dtype=np.float64)
  p = n ** -a
  return int(rng.choice(n.astype(np.int64), p=p / p.sum()))


def _items_text(items) -> str:
  return ", ".join(str(x) for x in items)


def make_example(kind: str, rng, n: int, tokenizer=None) -> ChatExample:
  """One ``kind`` example of size ``n`` (prompt ids empty without a ``tokenizer``)."""
  check_one_of("kind", kind, KINDS)
  if n < 1:
    raise ConfigError(f"n={n} must be >= 1")
  if kind == "count":
    a = int(rng.integers(0, 50))
    items = tuple(range(a, a + n))
    text = f"Count from {a} to {a + n - 1}, separated by commas. " + _FMT.format("<the numbers>")
  elif kind == "list":
    k = int(rng.integers(2, 10))
    items = tuple(k * i for i in range(1, n + 1))
    text = (f"List the first {n} multiples of {k}, separated by commas. "
            + _FMT.format("<the numbers>"))
  elif kind == "repeat":
    w = WORDS[int(rng.integers(len(WORDS)))]
    items = (w,) * n
    text = (f"Repeat the word '{w}' {n} time{'s' if n > 1 else ''}, separated by spaces. "
            + _FMT.format("<the words>"))
  elif kind == "sort":
    xs = [int(x) for x in rng.integers(0, 100, n)]
    items = tuple(sorted(xs))
    text = (f"Sort these numbers in ascending order: {_items_text(xs)}. "
            + _FMT.format("<the sorted numbers>"))
  else:
    return _arith(rng, n, tokenizer)
  body = " ".join(items) if kind == "repeat" else _items_text(items)
  return _finish(kind, text, items, f"Answer: {body}", n, tokenizer)


def _arith(rng, n: int, tokenizer) -> ChatExample:
  """``n`` operations (+, -, x small operands) on a start value, worked one line per step."""
  v = int(rng.integers(1, 20))
  words, lines = [f"Start with {v}."], []
  for i in range(n):
    op = ["+", "-", "*"][int(rng.integers(3))] if abs(v) < 200 else ["+", "-"][int(rng.integers(2))]
    x = int(rng.integers(2, 4)) if op == "*" else int(rng.integers(1, 10))
    new = v + x if op == "+" else v - x if op == "-" else v * x
    verb = {"+": f"add {x}", "-": f"subtract {x}", "*": f"multiply by {x}"}[op]
    words.append(f"Then {verb}." if i else f"{verb.capitalize()}.")
    lines.append(f"{v} {op} {x} = {new}")
    v = new
  text = " ".join(words) + " Work it out one step per line. " + _FMT.format("<number>")
  return _finish("arith", text, (v,), "\n".join(lines + [f"Answer: {v}"]), n, tokenizer)


def _finish(kind, text, items, reference, n, tokenizer) -> ChatExample:
  messages = ({"role": "user", "content": text},)
  prompt = ()
  if tokenizer is not None:
    from jaxsys.serving.generation import encode_prompts  # noqa: PLC0415  (pulls in serving)
    prompt = tuple(int(t) for t in encode_prompts(tokenizer, [list(messages)])[0])
  return ChatExample(kind, messages, prompt, tuple(items), reference, n)


def parse_answer(text: str) -> tuple[str | None, bool]:
  """``(text after the last 'Answer:' on its line, or None; format ok)``: the format holds when
  the last non-empty line starts with ``Answer:``."""
  lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
  fmt = bool(lines) and _ANSWER.match(lines[-1]) is not None
  hits = list(_ANSWER.finditer(text))
  if not hits:
    return None, fmt
  return text[hits[-1].end():].split("\n", 1)[0].strip(), fmt


def _check_weights(answer_weight: float, format_weight: float):
  if answer_weight < 0 or format_weight < 0 or answer_weight + format_weight <= 0:
    raise ConfigError(f"answer_weight={answer_weight} and format_weight={format_weight} must be "
                      ">= 0 with a positive sum")


def score(example: ChatExample, text: str, *, answer_weight: float = 0.9,
          format_weight: float = 0.1) -> dict:
  """``{"accuracy", "format", "reward"}`` of a decoded response (see the module docstring)."""
  _check_weights(answer_weight, format_weight)
  body, fmt = parse_answer(text)
  acc = 0.0
  if body is not None:
    if example.kind == "repeat":
      got = body.replace(",", " ").split()
    else:
      got = [int(x) for x in _INT.findall(body)]
    if example.kind == "arith":
      acc = float(bool(got) and got[0] == example.answer[0])
    else:
      want = list(example.answer)
      hit = sum(1 for i, w in enumerate(want) if i < len(got) and got[i] == w)
      acc = hit / max(len(want), len(got))
  reward = (answer_weight * acc + format_weight * float(fmt)) / (answer_weight + format_weight)
  return {"accuracy": acc, "format": float(fmt), "reward": reward}


@dataclasses.dataclass
class ChatTaskSampler:
  """Chat prompts of the ``kinds`` mixture (weights ``mix``, same order) with heavy-tailed sizes.

  ``tokenizer``: a chat tokenizer (``load_pretrained(...)[1]``); ``reward_fn(example,
  response_token_ids)`` decodes the response (special tokens dropped) and scores it.
  """
  tokenizer: object
  kinds: tuple[str, ...] = KINDS
  mix: tuple[float, ...] = (0.3, 0.1, 0.2, 0.2, 0.2)
  items: tuple[int, int] = (2, 64)
  steps: tuple[int, int] = (1, 12)
  zipf_a: float = 1.1
  answer_weight: float = 0.9
  format_weight: float = 0.1
  seed: int = 0

  def __post_init__(self):
    if not self.kinds:
      raise ConfigError("kinds must not be empty")
    for k in self.kinds:
      check_one_of("kinds", k, KINDS)
    if len(self.mix) != len(self.kinds) or min(self.mix) < 0 or sum(self.mix) <= 0:
      raise ConfigError(f"mix={self.mix} must have one weight >= 0 per kind {self.kinds}, "
                        "with a positive sum")
    for name in ("items", "steps"):
      lo, hi = getattr(self, name)
      if not 1 <= lo <= hi:
        raise ConfigError(f"{name}={getattr(self, name)} must satisfy 1 <= lo <= hi")
    check_range("zipf_a", self.zipf_a, 0, None)
    _check_weights(self.answer_weight, self.format_weight)
    self.rng = np.random.default_rng(self.seed)
    self._p = np.asarray(self.mix, np.float64) / sum(self.mix)
    self._max = None

  def one(self, rng=None) -> ChatExample:
    rng = rng or self.rng
    kind = self.kinds[int(rng.choice(len(self.kinds), p=self._p))]
    lo, hi = self.steps if kind == "arith" else self.items
    return make_example(kind, rng, truncated_zipf(rng, self.zipf_a, lo, hi), self.tokenizer)

  def sample(self, n: int, rng=None) -> list[ChatExample]:
    return [self.one(rng) for _ in range(n)]

  def reward_fn(self, example: ChatExample, response) -> float:
    """Decodes ``response`` token ids and scores them: the ``GRPOTrainer`` ``reward_fn``."""
    text = self.tokenizer.decode([int(t) for t in response], skip_special_tokens=True)
    return score(example, text, answer_weight=self.answer_weight,
                 format_weight=self.format_weight)["reward"]

  @property
  def pad_id(self) -> int:
    tok = self.tokenizer
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

  @property
  def stop_tokens(self) -> tuple[int, ...]:
    eos = self.tokenizer.eos_token_id
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))

  def _longest(self):
    """Token lengths of the largest prompt and reference (+1 for the stop token) over the kinds
    at their largest size (32 seeded probes each: number widths vary)."""
    if self._max is None:
      prompts, refs = [], []
      for k in self.kinds:
        n = self.steps[1] if k == "arith" else self.items[1]
        for s in range(32):
          ex = make_example(k, np.random.default_rng(s), n, self.tokenizer)
          prompts.append(len(ex.prompt))
          refs.append(len(self.tokenizer(ex.reference)["input_ids"]) + 1)
      self._max = (max(prompts), max(refs))
    return self._max

  @property
  def max_prompt(self) -> int:
    return self._longest()[0]

  @property
  def max_response(self) -> int:
    """Length of the longest reference answer: give the engine's ``max_new`` headroom above it."""
    return self._longest()[1]
