"""LServe on SmolLM2-135M-Instruct: the ``smollm2`` part of ``python -m experiments.lserve``.

The real model (30 layers x 3 kv heads = 90 kv heads, GQA 9/3, head_dim 64, f32 weights from
the GGUF) served by ``jaxsys.serving.ServingEngine`` in every configuration, so only the
attention differs:

* **Gates.** DuoAttention's distillation (``jaxsys.serving.streaming.identify_streaming_heads``,
  what ``jaxsys gates`` runs) on text passkey documents of 1024 tokens (seeds disjoint from the
  evaluation's), 50 % of the kv heads streaming with sink 64 + window 256 (the forward-only ranking
  of ``rank_streaming_heads``, ``jaxsys gates --method attention``, was better at 8K and worse at
  2K; experiments/README). The gates are kept in ``$JAXSYS_HOME/gates/`` under a name that
  encodes every setting, so a second run reuses them (the result says which); they are also
  written beside the result, as our JSON and as DuoAttention's ``full_attention_heads.tsv``.
* **Passkey** (``jaxsys.data.passkey_prompts``, the plain-text prompt of ``real_lm``) at 2K / 4K /
  8K tokens, 16 seeds each, greedy, a hit when the key's digits appear in the 8-token reply:
  dense; streaming heads only (every page selected); page selection only at a 1024-token budget
  and at 1/4 of the context; LServe = both (50 % streaming heads, budget 1/4 of the context).
  Streaming heads read sink + window in prefill except in the last ``DENSE_TAIL`` prompt rows
  (``LServeConfig.prefill_dense_tail``). Goal: LServe within 2 points of dense at every length.
* **Speed at 8K** (one request, interleaved rounds, best of them): decode tokens/s over 32 new
  tokens and prefill seconds (time to the first token) of the dense engine vs the LServe engine.
  Goals >= 1.3x each.

``run(out, details, seed=0)``: ``--seed S`` of ``experiments.lserve`` moves the gates' training
documents and initialisation (the gates cache key holds the documents' seed, so each run seed
learns its own gates once; seed 0 reads the gates cached before), the passkey prompts and the speed
prompts. The model is the fixed SmolLM2 checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np

from experiments._cli import reseed
from experiments.lserve import accuracy_engine
from jaxsys.core.results import Row

MODEL = "smollm2-135m-instruct"
LENGTHS = (2048, 4096, 8192)
SEEDS = 16
SINK, WINDOW, SPARSITY = 64, 256, 0.5
GATE_SETTINGS = {"length": 1024, "examples": 32, "steps": 28, "lr": 0.05, "l1": 0.05, "seed": 1000,
                 "sink": SINK, "window": WINDOW, "sparsity": SPARSITY}
# The streaming heads' rows of the last prompt tokens attend to the whole prompt in prefill
# (``LServeConfig.prefill_dense_tail``): at 8K the streaming heads' prefill, not their decode,
# is what loses the needle (experiments/README).
DENSE_TAIL = 64
PAGE = 64
NEW = 8          # reply tokens for passkey
MAX_BATCH = 4    # an 8K batch of 4 holds a 1.5 GB cache


def _gate_settings(seed: int = 0) -> dict:
  """``GATE_SETTINGS`` under the run's ``--seed``: the training documents' seed follows it (the
  initialisation's, ``reseed(0, seed)``, is a function of it, so the cache key need not hold both)."""
  return {**GATE_SETTINGS, "seed": reseed(GATE_SETTINGS["seed"], seed)}


def _gates(model, tok, out, progress=True, seed: int = 0):
  """``(StreamingGates, note)``: learned now, or read back from the settings-keyed cache."""
  from jaxsys.models.llm.interop.pretrained import cache_dir
  from jaxsys.serving.gates_cli import distillation_data
  from jaxsys.serving.streaming import StreamingGates, identify_streaming_heads
  settings = _gate_settings(seed)  # at seed 0 GATE_SETTINGS itself: the key of the gates cached before
  key = hashlib.sha256(json.dumps({"model": MODEL, **settings}, sort_keys=True).encode()).hexdigest()[:12]
  path = cache_dir() / "gates" / f"{MODEL}-{key}.json"
  if path.is_file():
    gates = StreamingGates.load(path, sparsity=SPARSITY, sink=SINK, window=WINDOW)
    note = f"gates read from {path} (learned by an earlier run with the same settings)"
  else:
    s = settings
    _, data = distillation_data(s["examples"], s["length"], s["seed"], tok)
    t0 = time.perf_counter()
    gates = identify_streaming_heads(model, data, sink=SINK, window=WINDOW, sparsity=SPARSITY,
                                     steps=s["steps"], lr=s["lr"], l1=s["l1"], batch_size=1,
                                     seed=reseed(0, seed), progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    gates.save(path)
    note = (f"gates learned in {time.perf_counter() - t0:.0f} s: distillation loss "
            f"{gates.history[0]:.3g} -> {gates.history[-1]:.3g}")
  gates.save(out / "gates.json")
  gates.save_tsv(out / "full_attention_heads.tsv")
  n = int(np.sum(gates.streaming))
  return gates, f"{note}; {n} of {np.size(gates.streaming)} kv heads streaming"


def _configs(ctx: int, gates):
  from jaxsys.serving.lserve import LServeConfig
  full = -(-(ctx + NEW + 8) // PAGE) * PAGE
  quarter = max(PAGE, ctx // 4 // PAGE * PAGE)
  base = dict(page_size=PAGE, sink=SINK, window=WINDOW, prefill_dense_tail=DENSE_TAIL)
  return {
      "dense": (LServeConfig(dense=True, **base), None),
      "streaming only (50% heads)": (LServeConfig(token_budget=full, **base), gates.streaming),
      "page selection only, budget 1024": (LServeConfig(token_budget=1024, **base), None),
      f"page selection only, budget {quarter} (1/4)": (LServeConfig(token_budget=quarter, **base), None),
      f"LServe (50% streaming, budget {quarter})": (LServeConfig(token_budget=quarter, **base),
                                                     gates.streaming),
      # LServe's own default budget: the whole context up to 4K, half of it at 8K
      "LServe (50% streaming, budget 4096)": (LServeConfig(token_budget=4096, **base), gates.streaming),
  }


def passkey_rows(model, tok, gates, details, lengths=LENGTHS, seeds=SEEDS, seed: int = 0) -> list[Row]:
  """Passkey accuracy per length and configuration (dense first: the others are points vs it).
  ``seeds`` prompts per length, from prompt seed ``reseed(0, seed)`` on (``seed``: the run's
  ``--seed``; the gates' documents start at ``reseed(1000, seed)``, disjoint)."""
  from jaxsys.data import passkey_prompts
  first = reseed(0, seed)
  rows = []
  for n in lengths:
    # 8K: the prompt and reply must fit the model's 8192 positions
    cases = passkey_prompts(tok, min(n, 8192 - 2 * NEW - 16), range(first, first + seeds))
    longest = max(len(c[0]) for c in cases) + NEW
    acc = {}
    for name, (ls, flags) in _configs(longest, gates).items():
      eng = accuracy_engine(model, ls, flags, longest, MAX_BATCH)
      t0, hits = time.perf_counter(), []
      res = eng.generate([c[0] for c in cases], NEW, stop_tokens=())
      for (_, key), t in zip(cases, res.tokens):
        text = tok.decode(t)
        hits.append(key in text)
        if key not in text:
          details.setdefault("passkey_misses", []).append({"tokens": n, "config": name, "key": key,
                                                           "reply": text})
      acc[name] = 100.0 * float(np.mean(hits))
      print(f"  smollm2 passkey @{n}: {name}: {acc[name]:.1f}% ({time.perf_counter() - t0:.0f} s)",
            flush=True)
      dense = acc["dense"]
      goal = ">= -2" if name.startswith("LServe") else None
      rows.append(Row(f"SmolLM2 passkey accuracy @{n // 1024}K, {name}", "%", ours=acc[name],
                      baseline=None if name == "dense" else dense,
                      baseline_name=None if name == "dense" else "dense",
                      ratio=None if name == "dense" else acc[name] - dense, goal=goal,
                      note=f"{seeds} seeds, prompts of {len(cases[0][0])} tokens, greedy {NEW} tokens; "
                           "ratio = points vs dense"))
    details.setdefault("passkey", {})[str(n)] = acc
  return rows


def speed_rows(model, gates, ctx: int = 8192 - 64, new: int = 32, rounds: int = 3,
               seed: int = 0) -> list[Row]:
  """Decode tokens/s and prefill seconds of one ``ctx``-token request, dense vs LServe; ``seed``:
  the run's ``--seed`` (the random prompts)."""
  rng = np.random.default_rng(reseed(0, seed))

  def fresh():  # a new prompt per call: the dense engine's prefix cache would skip a repeated one
    return rng.integers(100, 40000, ctx).tolist()

  prompt = fresh()
  longest = ctx + new + 8
  picks = {k: v for k, v in _configs(longest, gates).items() if k == "dense" or k.startswith("LServe")}
  engines = {k: accuracy_engine(model, ls, flags, longest, 1) for k, (ls, flags) in picks.items()}
  for eng in engines.values():                        # compile prefill and every decode step kind
    eng.generate([prompt], new, stop_tokens=())
  best: dict[tuple[str, str], float] = {}
  for _ in range(rounds):
    for k, eng in engines.items():
      p = fresh()
      t0 = time.perf_counter()
      eng.generate([p], 1, stop_tokens=())
      best[k, "prefill"] = min(best.get((k, "prefill"), np.inf), time.perf_counter() - t0)
      res = eng.generate([fresh()], new, stop_tokens=())
      best[k, "decode"] = min(best.get((k, "decode"), np.inf), res.decode_seconds / (new - 1))
  d_tps, d_pf = 1 / best["dense", "decode"], best["dense", "prefill"]
  rows = []
  for lk in (k for k in picks if k.startswith("LServe")):
    l_tps, l_pf = 1 / best[lk, "decode"], best[lk, "prefill"]
    print(f"  smollm2 @{ctx}: decode dense {d_tps:.1f} vs {lk} {l_tps:.1f} tok/s; prefill "
          f"{d_pf:.1f} vs {l_pf:.1f} s", flush=True)
    rows += [
        Row(f"SmolLM2 engine decode tokens/s @{round(ctx / 1024)}K, {lk} vs dense", "tokens/s", ours=l_tps,
            baseline=d_tps, baseline_name="dense engine", ratio=l_tps / d_tps, goal=">= 1.3",
            note=f"one request, prompt {ctx} tokens, {new} new tokens, best of {rounds} interleaved rounds"),
        Row(f"SmolLM2 engine prefill @{round(ctx / 1024)}K, {lk} vs dense", "s", ours=l_pf, baseline=d_pf,
            baseline_name="dense engine", ratio=d_pf / l_pf, goal=">= 1.3",
            note="time to the first token of one request; ratio = dense / LServe time"),
    ]
  return rows


def run(out, details, seed: int = 0, dtype: str = "float32") -> list[Row]:
  """Every SmolLM2 row; the gates files go to ``out``. ``seed``: the run's ``--seed``; ``dtype``:
  the model's compute dtype."""
  from experiments._cli import with_compute_dtype
  from jaxsys.models.llm.interop.pretrained import load_pretrained
  model, tok = load_pretrained(MODEL)
  model = with_compute_dtype(model, dtype)
  gates, note = _gates(model, tok, out, progress=os.environ.get("JAXSYS_NO_PROGRESS") is None, seed=seed)
  print(f"  smollm2 {note}", flush=True)
  details["gates"] = note
  rows = passkey_rows(model, tok, gates, details, seed=seed)
  rows += speed_rows(model, gates, seed=seed)
  return rows
