"""Part ``structured`` of experiments/serving: what a JSON-schema constraint costs a server.

The same load twice on one continuous-batching server: ``n`` requests sent at once (streamed
``/v1/completions`` through the official ``openai`` client), each generating exactly
``max_tokens`` tokens, once unconstrained (``ignore_eos``) and once with vLLM's ``guided_json``: a
schema (an array of at least 64 short strings) that no reply can complete within
``max_tokens``, so both loads produce the same number of tokens and the difference is the
grammar's: llguidance's token mask per constrained row and step, and the mask entering the one
sampler as a bias. Each load runs ``repeats`` times, interleaved, and the fastest of each counts
(the machine is shared). Goal: structured requests/s >= 0.8x unconstrained.

Also measured alone: llguidance's mask + advance per token (µs) along one constrained reply.

The model needs a tokenizer: SmolLM2-135M-Instruct in the full mode; in quick mode a 4-layer
random-weight model with SmolLM2's vocabulary and tokenizer (a smaller model makes the
grammar's share of each step larger, not smaller). Without ``jaxsys fetch smollm2-135m-instruct``
the part reports "not measured".
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from experiments._cli import reseed
from experiments.serving import _load, _summary
from jaxsys.core.results import Row

SCHEMA = {"type": "object", "required": ["items"], "additionalProperties": False,
          "properties": {"items": {"type": "array", "minItems": 64,
                                   "items": {"type": "string", "minLength": 1, "maxLength": 6}}}}
NAME = "smollm2-135m-instruct"
BURST = 1e6  # requests/s: the Poisson gaps of experiments.serving._load are ~0, all sent at once


def _model(quick: bool, seed: int):
  from jaxsys.models.llm.interop import pretrained
  if pretrained.find(NAME) is None:
    return None, None
  if not quick:
    from jaxsys.models import load_pretrained
    return load_pretrained(NAME)
  from jaxsys.models.llm._decoder_config import DecoderConfig
  from jaxsys.models.llm.decoder import random_model
  from jaxsys.models.llm.interop.gguf import load_tokenizer
  tok = load_tokenizer(pretrained.find(NAME))
  cfg = DecoderConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                      num_kv_heads=4, max_position_embeddings=1024, eos_token_id=tok.eos_token_id)
  return random_model(cfg, seed=reseed(3, seed)), tok


def _mask_cost(tok, vocab: int, text: str) -> float:
  """µs per token of llguidance's mask + advance along ``text`` (a constrained reply)."""
  from jaxsys.serving.structured import Constraint, grammar_for, ll_tokenizer
  ll = ll_tokenizer(tok, vocab, [tok.eos_token_id])
  ids = tok.encode(text, add_special_tokens=False)
  c = Constraint(ll, grammar_for(json_schema=SCHEMA))
  words = -(-vocab // 32)
  t0 = time.perf_counter()
  n = 0
  for t in ids:
    c.allowed_bits(words)
    n += 1
    if c.advance(int(t)):  # complete (or, for a re-tokenized text, off the grammar): stop timing
      break
  return (time.perf_counter() - t0) / n * 1e6


def structured(quick: bool, config: dict, seed: int = 0) -> list[Row]:
  from jaxsys.serving import ServingConfig, ServingEngine
  from jaxsys.serving.lserve import LServeConfig
  from jaxsys.serving.openai_server import start_server
  model, tok = _model(quick, seed)
  metric = "structured (guided_json) vs unconstrained requests/s"
  if model is None:
    return [Row(metric, "requests/s", note=f"not measured: run `jaxsys fetch {NAME}` first")]
  n, max_tokens, repeats = (8, 24, 2) if quick else (16, 48, 3)
  rng = np.random.default_rng(reseed(3, seed))
  words = ["apple", "river", "stone", "light", "green", "cloud", "seven", "paper"]
  prompts = [f"List {k} {rng.choice(words)} words as JSON:" for k in rng.integers(60, 90, n)]
  engine = ServingEngine(model, ServingConfig(lserve=LServeConfig(dense=True, page_size=16, logical_page_size=4),
                                              max_batch=8, num_pages=8 * 8 + 8, max_seq_len=128,
                                              max_num_batched_tokens=256, prefill_chunk=64),
                         tokenizer=tok)
  # every request of a load is sent at once (a rate no server keeps up with); ignore_eos as in
  # every serving load (experiments.serving._exact_length)
  loads = {"unconstrained": {}, "structured": {"guided_json": SCHEMA}}
  model_name = NAME if not quick else "random-4L-smollm2-vocab"
  server = start_server(engine, model_name)
  spans = {k: [] for k in loads}
  try:
    for extra in loads.values():  # compile both programs (with and without a mask) first
      asyncio.run(_load(server.url, model_name, prompts[:2], BURST, max_tokens, seed, extra=extra))
    for _ in range(repeats):
      for name, extra in loads.items():
        res = asyncio.run(_load(server.url, model_name, prompts, BURST, max_tokens, seed, extra=extra))
        spans[name].append(_summary(res)["span_s"])
        if name == "structured":
          reply = res[0]["text"]
  finally:
    server.stop()
  assert reply.startswith('{"items":["'), reply[:40]  # the grammar held
  u, s = (n / min(spans[k]) for k in ("unconstrained", "structured"))
  us = _mask_cost(tok, model.config.vocab_size, reply)
  config["structured"] = {"requests": n, "max_tokens": max_tokens, "repeats": repeats, "schema": SCHEMA,
                          "spans_s": {k: [round(x, 3) for x in v] for k, v in spans.items()},
                          "model": "SmolLM2-135M-Instruct" if not quick else "random 4-layer, SmolLM2 vocab"}
  print(f"  structured: {s:.2f} req/s vs unconstrained {u:.2f} req/s; mask {us:.0f} us/token", flush=True)
  return [Row(f"{metric}, {n} at once, {max_tokens} tokens each", "requests/s (ratio = ours/baseline)",
              ours=s, baseline=u, baseline_name="unconstrained", ratio=s / u, goal=">= 0.8"),
          Row("llguidance mask + advance per token (JSON schema)", "us", ours=us,
              note="host time per constrained row and step, measured alone")]
