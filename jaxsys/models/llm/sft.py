"""Supervised fine-tuning of a decoder LM on chats: data, packing, and the run (the one train loop).

Data: a JSONL file, one chat per line, OpenAI-style::

  {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}]}

* :func:`read_chats` validates every line; a malformed one is an ``InputError`` naming the file,
  the line number and the field (invalid JSON, no ``messages`` list, a role outside
  ``system/user/assistant/tool``, non-string content, no assistant turn). Nothing is skipped.
* :func:`tokenize_chat` renders the chat with the model's chat template and marks the loss on
  assistant turns only: for assistant message ``i`` the targets are the tokens the template adds
  between ``messages[:i]`` + generation prompt and ``messages[:i + 1]`` (the reply and its
  end-of-turn token, not the role header).
* :func:`pack` packs tokenized chats first-fit into rows of ``seq_len`` tokens with
  ``segment_ids`` and per-segment ``positions`` (``causal_lm_loss`` drops cross-segment targets,
  and attention stays within a segment). A chat longer than ``seq_len`` is an error naming its line
  (nothing is truncated silently).
* :func:`batches` gives the batch of step ``s`` as a pure function of ``s`` (rows reshuffled each
  epoch from ``seed``), so a resumed run sees the same data.
* :func:`finetune` runs :func:`jaxsys.train.train` on them, optionally with LoRA
  (:mod:`jaxsys.nn.lora`) and on a mesh (FSDP / TP rules), and returns the history.

The ``jaxsys finetune`` command (``jaxsys.serving.finetune_cli``) adds model loading, export as a
Hugging Face folder (with its tokenizer files) and GGUF, and resume from its work folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxsys.core.errors import ConfigError, InputError

__all__ = ["ROLES", "PackedData", "batches", "finetune", "pack", "read_chats", "tokenize_chat"]

ROLES = ("system", "user", "assistant", "tool")


def _check_chat(obj, where: str) -> list[dict]:
  if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
    raise InputError(f"{where}: expected an object with a non-empty 'messages' list")
  for j, m in enumerate(obj["messages"]):
    if not isinstance(m, dict):
      raise InputError(f"{where}: messages[{j}] must be an object with 'role' and 'content'")
    if m.get("role") not in ROLES:
      raise InputError(f"{where}: messages[{j}].role={m.get('role')!r} must be one of {ROLES}")
    if not isinstance(m.get("content"), str):
      raise InputError(f"{where}: messages[{j}].content must be a string")
  if not any(m["role"] == "assistant" for m in obj["messages"]):
    raise InputError(f"{where}: the chat has no assistant message (nothing to learn from)")
  return [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]


def read_chats(path: str | os.PathLike) -> list[list[dict]]:
  """Every chat of a JSONL file (module docstring); blank lines are allowed, nothing else is
  skipped. Raises ``InputError`` naming the line and field of the first malformed line."""
  path = Path(path)
  if not path.is_file():
    raise InputError(f"--data {path}: no such file")
  chats = []
  with path.open(encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path.name} line {n}"
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
      chats.append(_check_chat(obj, where))
  if not chats:
    raise InputError(f"{path}: no chats (one JSON object with 'messages' per line)")
  return chats


def tokenize_chat(tokenizer, messages: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
  """``(ids int32[n], loss_mask int8[n])``: the templated chat and 1 on assistant-turn targets."""
  ids = np.asarray(tokenizer.apply_chat_template(list(messages), tokenize=True), np.int32)
  mask = np.zeros(len(ids), np.int8)
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    start = len(tokenizer.apply_chat_template(list(messages[:i]), add_generation_prompt=True,
                                              tokenize=True)) if i else 0
    end = len(tokenizer.apply_chat_template(list(messages[:i + 1]), tokenize=True))
    if end > len(ids) or start > end:
      raise ConfigError("the chat template does not render a chat's prefixes as prefixes of the "
                        "whole chat: assistant turns cannot be located for the loss mask")
    mask[start:end] = 1
  return ids, mask


@dataclasses.dataclass(frozen=True)
class PackedData:
  """Rows of ``seq_len`` tokens: ``tokens``, ``loss_mask``, ``segment_ids`` (0 = padding) and
  ``positions``, all ``int32 [rows, seq_len]``; ``chats`` packed, ``targets`` loss tokens."""
  tokens: np.ndarray
  loss_mask: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  chats: int
  targets: int


def pack(seqs: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, *, names: Sequence[str] | None = None,
         pad_id: int = 0) -> PackedData:
  """First-fit packing of ``(ids, mask)`` pairs into rows of ``seq_len`` tokens (longest first)."""
  if seq_len < 2:
    raise ConfigError(f"seq_len={seq_len} must be >= 2")
  order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
  rows: list[list[int]] = []   # chat indices per row
  free: list[int] = []
  for i in order:
    n = len(seqs[i][0])
    if n > seq_len:
      name = names[i] if names is not None else f"chat {i}"
      raise InputError(f"{name} has {n} tokens, more than --seq-len {seq_len}: raise --seq-len or "
                       "shorten the chat (nothing is truncated)")
    r = next((k for k, f in enumerate(free) if f >= n), None)
    if r is None:
      rows.append([])
      free.append(seq_len)
      r = len(rows) - 1
    rows[r].append(i)
    free[r] -= n
  shape = (len(rows), seq_len)
  tok, msk = np.full(shape, pad_id, np.int32), np.zeros(shape, np.int32)
  seg, pos = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
  for r, members in enumerate(rows):
    at = 0
    for s, i in enumerate(members, 1):
      ids, mask = seqs[i]
      tok[r, at:at + len(ids)], msk[r, at:at + len(ids)] = ids, mask
      seg[r, at:at + len(ids)], pos[r, at:at + len(ids)] = s, np.arange(len(ids))
      at += len(ids)
  return PackedData(tok, msk, seg, pos, len(seqs), int(msk.sum()))


def batches(data: PackedData, batch_size: int, seed: int = 0):
  """``step -> batch dict`` for :func:`jaxsys.train.train`: ``batch_size`` rows, a fresh
  permutation of the rows each epoch (an epoch's last batch wraps into the next permutation)."""
  n = len(data.tokens)
  if batch_size < 1:
    raise ConfigError(f"batch_size={batch_size} must be >= 1")

  def perm(epoch):
    return np.random.default_rng([seed, epoch]).permutation(n)

  def get(step):
    idx = [perm(k // n)[k % n] for k in range(step * batch_size, (step + 1) * batch_size)]
    return {"tokens": data.tokens[idx], "loss_mask": data.loss_mask[idx],
            "segment_ids": data.segment_ids[idx], "positions": data.positions[idx]}
  return get


def finetune(model, tokenizer, chats: Sequence[Sequence[dict]], cfg, *, seq_len: int = 512,
             batch_size: int = 8, seed: int = 0, lora=None, mesh=None, workdir=None,
             progress: bool = True, names: Sequence[str] | None = None):
  """Trains ``model`` in place on ``chats`` (assistant turns only) through the one train loop.

  ``cfg``: a :class:`jaxsys.train.TrainConfig`; ``lora``: a :class:`jaxsys.nn.lora.LoRAConfig`
  (adapters applied here, trained alone; merge with ``merge_lora`` before export); ``mesh``: FSDP
  / TP by ``cfg.rules``. Returns ``(TrainResult, PackedData)``."""
  from flax import nnx

  from jaxsys.nn.lora import apply_lora
  from jaxsys.train import train
  seqs = [tokenize_chat(tokenizer, c) for c in chats]
  data = pack(seqs, seq_len, names=names, pad_id=int(tokenizer.pad_token_id or 0))
  if lora is not None and not any(True for _ in _lora_weights(model)):
    apply_lora(model, lora, rngs=nnx.Rngs(seed))
  res = train(model, batches(data, batch_size, seed), cfg, workdir=workdir, mesh=mesh, progress=progress)
  return res, data


def _lora_weights(model):
  from flax import nnx

  from jaxsys.nn.lora import LoRAWeight
  return (m for _, m in nnx.iter_graph(model) if isinstance(m, LoRAWeight))
