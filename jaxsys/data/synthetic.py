"""Synthetic token tasks with verifiable answers, deterministic by seed (no tokenizer needed).

Tasks (each an :class:`Example` = ``prompt`` + ``answer`` token lists over :data:`VOCAB`):

* ``copy``: ``<bos> COPY x_1..x_n SEP`` -> ``x_1..x_n <eos>``. Repeated random sequences make
  a model grow induction heads (Olsson et al., 2022): "find the previous occurrence of the
  current token, emit what followed it" -- the mechanism retrieval needs. ``n`` may be a range
  ``(lo, hi)`` drawn per example (training uses it: a fixed ``n`` is solvable by position alone).
* ``recall``: multi-query associative recall in a haystack (MQAR, Arora et al., 2023):
  ``n_keys`` key/value pairs ``k v`` scattered in random filler, then ``n_queries`` times
  ``? k v``; every value after a query is an answer token (the last one is the answer).
* ``passkey``: multi-key passkey retrieval (Mohtashami & Jaggi, 2023): needles
  ``KEY k d d d d`` (4 digits) hidden in filler; ``? k`` -> the digits.
* ``arith``: ``a + b =`` / ``a - b =`` with up to ``max_digits`` digits -> digits of the result.

``reward(example, response)`` is 1.0 when ``response`` starts with the answer (EOS included, or
the response ends right after the answer), else 0.0: a verifiable reward for RL (GRPO).
``training_batch`` turns a task mixture into ``tokens [batch, length]`` with a ``loss_mask`` on
answer tokens. The vocabulary is described by :data:`VOCAB` and :func:`token_names`;
:func:`save_tokenizer` writes a ``transformers``-loadable word-level tokenizer.

Usage::

  ex = make_example("recall", np.random.default_rng(0), length=256, n_keys=8)
  batch = training_batch({"copy": 0.5, "recall": 0.5}, seed=0, step=3, batch_size=32, length=128)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxsys.core.errors import ConfigError

__all__ = [
    "detokenize", "Example", "examples", "make_example", "PASSKEY_FILLER", "passkey_prompts",
    "passkey_text", "reward",
    "save_tokenizer", "TASKS", "token_names", "training_batch", "Vocab", "VOCAB",
]


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Integer vocabulary: specials, task markers, digits, keys, values and filler symbols."""
  pad: int = 0
  bos: int = 1
  eos: int = 2
  sep: int = 3
  query: int = 4
  plus: int = 5
  minus: int = 6
  equals: int = 7
  needle: int = 8
  copy: int = 9
  recall: int = 10
  passkey: int = 11
  arith: int = 12
  digit0: int = 16     # digits 0-9: 16..25
  key0: int = 32       # 32 key symbols: 32..63
  value0: int = 64     # 32 value symbols: 64..95
  filler0: int = 96    # 32 filler symbols: 96..127
  num_keys: int = 32
  num_values: int = 32
  num_filler: int = 32
  size: int = 128

  def digit(self, d) -> int:
    return self.digit0 + int(d)

  def digits(self, n: int) -> list[int]:
    return [self.digit(c) for c in str(int(n))]


VOCAB = Vocab()
TASKS = ("copy", "recall", "passkey", "arith")


def token_names(v: Vocab = VOCAB) -> list[str]:
  """A printable name for every token id (used by the tokenizer and for debugging)."""
  names = [f"<unused{i}>" for i in range(v.size)]
  for attr, name in (("pad", "<pad>"), ("bos", "<bos>"), ("eos", "<eos>"), ("sep", ":"),
                     ("query", "?"), ("plus", "+"), ("minus", "-"), ("equals", "="),
                     ("needle", "KEY"), ("copy", "COPY"), ("recall", "RECALL"),
                     ("passkey", "PASSKEY"), ("arith", "ARITH")):
    names[getattr(v, attr)] = name
  for i in range(10):
    names[v.digit0 + i] = str(i)
  for i in range(v.num_keys):
    names[v.key0 + i] = f"k{i}"
  for i in range(v.num_values):
    names[v.value0 + i] = f"v{i}"
  for i in range(v.num_filler):
    names[v.filler0 + i] = f"f{i}"
  return names


def detokenize(ids: Sequence[int], v: Vocab = VOCAB) -> str:
  names = token_names(v)
  return " ".join(names[int(i)] if 0 <= int(i) < v.size else f"<{int(i)}>" for i in ids)


@dataclasses.dataclass(frozen=True)
class Example:
  task: str
  prompt: tuple[int, ...]
  answer: tuple[int, ...]          # ends with EOS
  answer_mask: tuple[bool, ...] = ()   # for training: which prompt tokens are also targets

  @property
  def tokens(self) -> tuple[int, ...]:
    return self.prompt + self.answer


def _filler(rng, n, v: Vocab):
  return (v.filler0 + rng.integers(0, v.num_filler, n)).tolist()


def _scatter(rng, haystack: list[int], needles: list[list[int]]) -> list[int]:
  """Inserts each needle (a token list) at a random gap of ``haystack``, in order."""
  slots = np.sort(rng.integers(0, len(haystack) + 1, len(needles)))
  out, prev = [], 0
  for s, nd in zip(slots, needles):
    out += haystack[prev:s] + nd
    prev = s
  return out + haystack[prev:]


def _copy(rng, length, v, n=None):
  # a range (lo, hi) varies the copy distance per example, so the only solution is content-based
  # (induction heads); a fixed n lets a model copy from a fixed relative position instead
  if isinstance(n, (tuple, list)):
    hi = min(n[1], (length - 4) // 2)
    if not 1 <= n[0] <= hi:
      raise ConfigError(f"copy n={tuple(n)} needs 1 <= low <= min(high, (length - 4) // 2 = "
                        f"{(length - 4) // 2}) for {length=}")
    n = int(rng.integers(n[0], hi + 1))
  n = n or max(1, (length - 4) // 2)
  xs = (v.value0 + rng.integers(0, v.num_values, n)).tolist()
  return Example("copy", (v.bos, v.copy, *xs, v.sep), (*xs, v.eos))


def _recall(rng, length, v, n_keys=8, n_queries=None):
  if isinstance(n_keys, (tuple, list)):  # a range (lo, hi) drawn per example
    n_keys = int(rng.integers(n_keys[0], n_keys[1] + 1))
  if n_keys > v.num_keys:
    raise ConfigError(f"{n_keys=} must be <= {v.num_keys} key symbols")
  n_queries = n_queries or n_keys
  keys = rng.choice(v.num_keys, n_keys, replace=False)
  vals = rng.integers(0, v.num_values, n_keys)
  asked = rng.choice(n_keys, n_queries, replace=n_queries > n_keys)
  tail = 1 + 3 * n_queries  # "? k v" per query, then eos
  n_fill = length - 2 - 2 * n_keys - tail
  if n_fill < 0:
    raise ConfigError(f"recall with {n_keys=} and {n_queries=} needs length >= {length - n_fill}")
  body = _scatter(rng, _filler(rng, n_fill, v),
                  [[v.key0 + int(k), v.value0 + int(x)] for k, x in zip(keys, vals)])
  prompt = [v.bos, v.recall, *body]
  mask = [False] * len(prompt)
  for j, q in enumerate(asked):
    prompt += [v.query, v.key0 + int(keys[q])]
    mask += [False, False]
    if j < n_queries - 1:  # earlier answers sit in the prompt (multi-query), still trained on
      prompt.append(v.value0 + int(vals[q]))
      mask.append(True)
  return Example("recall", tuple(prompt), (v.value0 + int(vals[asked[-1]]), v.eos), tuple(mask))


def _passkey(rng, length, v, n_needles=4, n_digits=4):
  if isinstance(n_needles, (tuple, list)):
    n_needles = int(rng.integers(n_needles[0], n_needles[1] + 1))
  keys = rng.choice(v.num_keys, n_needles, replace=False)
  codes = rng.integers(0, 10, (n_needles, n_digits))
  q = int(rng.integers(0, n_needles))
  needle_len = 2 + n_digits
  n_fill = length - 2 - n_needles * needle_len - 2 - (n_digits + 1)
  if n_fill < 0:
    raise ConfigError(f"passkey with {n_needles=} needs length >= {length - n_fill}")
  needles = [[v.needle, v.key0 + int(k), *[v.digit(d) for d in c]] for k, c in zip(keys, codes)]
  body = _scatter(rng, _filler(rng, n_fill, v), needles)
  prompt = (v.bos, v.passkey, *body, v.query, v.key0 + int(keys[q]))
  return Example("passkey", prompt, (*[v.digit(d) for d in codes[q]], v.eos))


def _arith(rng, length, v, max_digits=2):
  hi = 10 ** max_digits
  a, b = (int(x) for x in rng.integers(0, hi, 2))
  op = "+" if rng.random() < 0.5 else "-"
  if op == "-" and b > a:
    a, b = b, a
  result = a + b if op == "+" else a - b
  prompt = (v.bos, v.arith, *v.digits(a), v.plus if op == "+" else v.minus, *v.digits(b), v.equals)
  return Example("arith", prompt, (*v.digits(result), v.eos))


_MAKERS = {"copy": _copy, "recall": _recall, "passkey": _passkey, "arith": _arith}


def make_example(task: str, rng: np.random.Generator, length: int = 256, v: Vocab = VOCAB,
                 **kwargs) -> Example:
  """One example of ``task``; ``copy``/``recall``/``passkey`` fill exactly ``length`` tokens
  (copy: about), ``arith`` is short. ``kwargs`` go to the task (n_keys, n_queries, n_needles,
  n_digits, max_digits, n)."""
  if task not in _MAKERS:
    raise ConfigError(f"{task=} must be one of {TASKS}")
  return _MAKERS[task](rng, length, v, **kwargs)


def examples(task: str, seed: int, count: int, length: int = 256, **kwargs) -> list[Example]:
  """``count`` examples, the same for the same ``seed`` (evaluation sets)."""
  rng = np.random.default_rng([seed, TASKS.index(task) if task in TASKS else 99, length])
  return [make_example(task, rng, length, **kwargs) for _ in range(count)]


def reward(example: Example, response: Sequence[int]) -> float:
  """1.0 if ``response`` reproduces the answer (the final EOS may be cut by a length limit)."""
  resp = [int(t) for t in response]
  ans = list(example.answer)
  if resp[:len(ans)] == ans:
    return 1.0
  body = ans[:-1] if ans and ans[-1] == VOCAB.eos else ans
  return 1.0 if resp == body else 0.0


def training_batch(mix: Mapping[str, float], *, seed: int, step: int, batch_size: int,
                   length: int, task_kwargs: Mapping[str, dict] | None = None,
                   v: Vocab = VOCAB) -> dict[str, np.ndarray]:
  """A batch for next-token training, deterministic in ``(seed, step)``.

  Returns ``tokens int32[batch, length]`` (right-padded with PAD) and
  ``loss_mask float32[batch, length]``: ``loss_mask[b, t]`` is 1 where token ``t`` is an answer
  token (predicted from position ``t - 1``).
  """
  names = sorted(mix)
  probs = np.asarray([mix[n] for n in names], np.float64)
  if np.any(probs < 0) or probs.sum() <= 0:
    raise ConfigError(f"mix={dict(mix)} must have non-negative weights with a positive sum")
  rng = np.random.default_rng([seed, step])
  tasks = rng.choice(len(names), batch_size, p=probs / probs.sum())
  tokens = np.full((batch_size, length), v.pad, np.int32)
  mask = np.zeros((batch_size, length), np.float32)
  for i, t in enumerate(tasks):
    ex = make_example(names[t], rng, length, v, **(task_kwargs or {}).get(names[t], {}))
    seq = list(ex.tokens)[:length]
    if len(ex.tokens) > length:
      raise ConfigError(f"task {names[t]!r} produced {len(ex.tokens)} tokens > {length=}")
    tokens[i, :len(seq)] = seq
    pm = list(ex.answer_mask) or [False] * len(ex.prompt)
    mask[i, :len(seq)] = np.asarray(pm + [True] * len(ex.answer), np.float32)
  return {"tokens": tokens, "loss_mask": mask}


def save_tokenizer(path, v: Vocab = VOCAB):
  """Writes a word-level ``tokenizer.json`` (space separated token names) for AutoTokenizer."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  names = token_names(v)
  tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                 pad_token="<pad>")
  fast.save_pretrained(str(path))
  return path


#: The filler of the text passkey task (Mohtashami & Jaggi, 2023).
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def passkey_text(seed: int, n_filler: int, *, depth: float | None = None,
                 digits: int = 5) -> tuple[str, str]:
  """Text passkey retrieval for a real tokenizer: ``(document, key)``.

  The document is an instruction, ``n_filler`` repetitions of :data:`PASSKEY_FILLER` and, after
  ``round(depth * n_filler)`` of them, ``"The pass key is K. Remember it. K is the pass key."``
  with a random ``digits``-digit key K; ``depth`` (in [0, 1]) is drawn from the seed when None.
  The caller adds the question ("What is the pass key?") in its own prompt format and sizes
  ``n_filler`` to a token budget with its tokenizer.
  """
  if n_filler < 0 or digits < 1:
    raise ConfigError(f"{n_filler=} must be >= 0 and {digits=} >= 1")
  if depth is not None and not 0.0 <= depth <= 1.0:
    raise ConfigError(f"{depth=} must lie in [0, 1] or be None")
  rng = np.random.default_rng([seed, 7919])
  key = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
  at = round((rng.random() if depth is None else depth) * n_filler)
  needle = f"The pass key is {key}. Remember it. {key} is the pass key."
  parts = [PASSKEY_FILLER] * n_filler
  parts.insert(at, needle)
  head = ("There is an important piece of information hidden inside a lot of irrelevant text. "
          "Find it and memorize it. I will quiz you about it.")
  return " ".join([head, *parts]), key


def passkey_prompts(tokenizer, target: int, seeds) -> list[tuple[list[int], str]]:
  """Plain-text passkey prompts of about ``target`` tokens ending in "The pass key is", one per
  seed: ``[(prompt ids, key)]``. The filler count comes from the tokenizer's own cost of a filler
  sentence (measured on two documents), so every seed's prompt has the same number of sentences."""

  def ids(seed, n):
    doc, key = passkey_text(seed, n)
    return tokenizer.encode(doc + "\nWhat is the pass key? The pass key is", add_special_tokens=False), key

  per = (len(ids(0, 20)[0]) - len(ids(0, 10)[0])) / 10    # tokens per filler sentence
  fixed = len(ids(0, 10)[0]) - 10 * per
  n = max(1, int((target - fixed) // per))
  return [ids(s, n) for s in seeds]
