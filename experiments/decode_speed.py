"""Greedy decode speed of the jaxsys decoder vs transformers (PyTorch eager) on the same CPU.

A ~60M-parameter Llama config with random weights is built in transformers, converted with
``jaxsys.models.from_hf_model`` and both generate greedily from the same prompts (batch 1 and
8) in the same process. jaxsys runs prefill as one jitted call and the whole decode loop as one
jitted ``lax.while_loop`` with the KV cache updated in place; transformers runs
``model.generate`` (its default attention, dynamic KV cache). Reported: decode tokens/s (new
tokens over decode wall time, compiled executables warm), prefill time, and whether the greedy
tokens agree. ``--seed S`` draws other random weights and prompts (seed 0: the default table);
``--dtype bfloat16`` runs jaxsys in bf16 against transformers in float32.
"""

from __future__ import annotations

import time

import numpy as np

from experiments._cli import reseed, with_compute_dtype
from jaxsys.core.bench import time_interleaved
from jaxsys.core.results import Row, run_dir, write_result

NAME = "decode_speed"


def _config(quick: bool):
  import transformers
  return transformers.LlamaConfig(
      vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
      tie_word_embeddings=False)


def run(quick: bool, out_dir: str, seed: int = 0, dtype: str = "float32") -> list[Row]:
  """``dtype``: jaxsys's compute dtype (``--dtype``; transformers stays float32)."""
  import torch
  import jaxsys.models as M
  from jaxsys.serving.generation import generate

  torch.set_num_threads(max(1, torch.get_num_threads()))
  cfg = _config(quick)
  torch.manual_seed(reseed(0, seed))  # transformers draws the random weights from the global generator
  hf = __import__("transformers").LlamaForCausalLM(cfg).eval()
  hf.generation_config.eos_token_id = None
  model = with_compute_dtype(M.from_hf_model(hf), dtype)
  n_params = model.config.num_params()
  prompt_len, new = (64, 32) if quick else (128, 64)
  rng = np.random.default_rng(reseed(0, seed))
  rows = []
  details = {}
  for batch in (1, 8):
    prompts = rng.integers(3, cfg.vocab_size, (batch, prompt_len))
    jax_prompts = [p.tolist() for p in prompts]

    def ours():
      return generate(model, jax_prompts, max_new_tokens=new, stop_tokens=())

    def theirs():
      with torch.no_grad():
        return hf.generate(torch.as_tensor(prompts), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)

    iters = 1 if quick else 3
    ours()  # compile
    runs = []
    ref = theirs()[:, prompt_len:].numpy()  # warm-up, and the tokens to compare
    # timed alternately, both already warm (one call each per round)
    timed = time_interleaved({"ours": lambda: runs.append(ours()), "theirs": theirs}, rounds=iters,
                           warmup=0)
    t_ours, t_theirs = timed["ours"], timed["theirs"]
    res = min(runs, key=lambda r: r.decode_seconds)
    decode_ours, prefill_ours = res.decode_seconds, min(r.prefill_seconds for r in runs)
    # transformers: prefill = one forward over the prompt with a fresh cache
    with torch.no_grad():
      t0 = time.perf_counter()
      hf(torch.as_tensor(prompts), use_cache=True)
      prefill_theirs = time.perf_counter() - t0
    decode_theirs = max(t_theirs.min - prefill_theirs, 1e-9)
    agree = float(np.mean([a == b.tolist() for a, b in zip(res.tokens, ref)]))
    tps_ours, tps_theirs = batch * new / decode_ours, batch * new / decode_theirs
    rows.append(Row(metric=f"greedy decode tokens/s, batch {batch}", unit="tokens/s (ratio ours/baseline)",
                    ours=tps_ours, baseline=tps_theirs, baseline_name="transformers eager (torch)",
                    ratio=tps_ours / tps_theirs, goal=">= 1.0",
                    note=f"{n_params / 1e6:.0f}M params, prompt {prompt_len}, {new} new tokens; "
                         f"greedy tokens identical for {agree:.0%} of rows"))
    rows.append(Row(metric=f"prefill {prompt_len} tokens, batch {batch}", unit="ms",
                    ours=1e3 * prefill_ours, baseline=1e3 * prefill_theirs,
                    baseline_name="transformers eager (torch)"))
    rows.append(Row(metric=f"end-to-end generate, batch {batch}", unit="ms",
                    ours=1e3 * t_ours.min, baseline=1e3 * t_theirs.min,
                    baseline_name="transformers eager (torch)"))
    details[f"batch{batch}"] = {"tokens_agree": agree}
  write_result(NAME, rows, config={"params": n_params, "prompt_len": prompt_len,
                                   "new_tokens": new, "hidden": cfg.hidden_size,
                                   "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
                                   "seed": seed, "dtype": dtype},
               quick=quick, out_dir=out_dir, extra={"details": details})
  run_dir(NAME, out_dir)
  return rows


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main("decode_speed"))
