"""The LLM stack on a pod: FSDP and TP through the one rules table, on 8 simulated CPU devices.

1. Loss curves: the same SFT run (full mode: SmolLM2-135M-Instruct on chat-formatted arithmetic,
   loss on the answers; quick: a small random decoder on the copy task) with ``rules="fsdp"`` on
   data=8, data=4 x model=2 and data=2 x model=4 (JAX's default Explicit meshes) and data=4 x
   model=2 on an Auto mesh, against one device: the largest relative difference of the losses.
2. Memory: the compiled train step's per-device argument bytes (parameters + AdamW state + the
   batch shard; ``compiled.memory_analysis()``) with FSDP on 1, 2, 4 and 8 devices, and a plot of
   bytes per device against the device count beside the ideal ``1/n``.
3. Communication: the collective bytes each device sends per step, read from the compiled HLO
   (``jaxsys.parallel.costs.hlo_collective_bytes``), against the FSDP formula: the parameters
   all-gathered for the forward and again for the backward, ``2 (n-1)/n P``, and the gradients
   reduce-scattered, ``(n-1)/n P`` (``P`` = trained parameter bytes).
4. LoRA r=16: optimizer state against full fine-tuning's (``jaxsys.nn.lora``), on the query and
   value projections (PEFT's default for Llama-family models; goal <= 2% on SmolLM2, full mode)
   and on all seven projections (no goal).

Quick mode takes about a minute on 2 cores.

Everything runs through ``jaxsys.train`` (``train`` and ``lower_step``); nothing here places a
parameter or builds a step by hand.
"""

from __future__ import annotations

import numpy as np

from experiments._cli import reseed, with_compute_dtype
from jaxsys.core.results import Row, run_dir, write_result

NAME = "scaling"
DEVICES = 8
LAYOUTS = (("data=8", {"data": 8}, "explicit"), ("data=4,model=2", {"data": 4, "model": 2}, "explicit"),
           ("data=2,model=4", {"data": 2, "model": 4}, "explicit"), ("data=4,model=2 (Auto)", {"data": 4, "model": 2}, "auto"))


def _setup(quick: bool, seed: int, dtype: str = "float32"):
  """``(make_model, batches, steps)``: a fresh model per run (computing in ``dtype``), the batch
  of a step, the steps."""
  import jax
  from flax import nnx

  import jaxsys.models as M
  from jaxsys.data import synthetic as S
  from jaxsys.models.llm import sft
  if quick:
    cfg = M.DecoderConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                          num_heads=8, num_kv_heads=4, max_position_embeddings=64)
    return (lambda: with_compute_dtype(M.random_model(cfg, seed=reseed(3, seed)), dtype),
            lambda step: S.training_batch({"copy": 1.0}, seed=reseed(0, seed), step=step, batch_size=8,
                                          length=32), 6)
  model0, tok = M.load_pretrained("smollm2-135m-instruct")
  rng = np.random.default_rng(reseed(0, seed))
  chats = [[{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
           for a, b in rng.integers(0, 1000, (64, 2))]
  data = sft.pack([sft.tokenize_chat(tok, c) for c in chats], 128, pad_id=int(tok.pad_token_id or 0))
  gdef, state = nnx.split(model0)
  return (lambda: with_compute_dtype(nnx.merge(gdef, jax.tree.map(lambda x: x.copy(), state)), dtype),
          sft.batches(data, 8, seed=reseed(1, seed)), 20)


def _mesh(shape: dict, kind: str):
  import jax

  from jaxsys.core.mesh import make_mesh
  if kind == "explicit":
    return jax.make_mesh(tuple(shape.values()), tuple(shape))
  return make_mesh(shape)


def _losses(make_model, batches, steps, mesh=None, rules="fsdp", lora=None):
  from flax import nnx

  from jaxsys import train as T
  from jaxsys.nn.lora import apply_lora
  model = make_model()
  if lora is not None:
    apply_lora(model, lora, rngs=nnx.Rngs(0))
  # SmolLM2's 9 query / 3 kv heads divide neither model=2 nor model=4: those parameters are
  # replicated over "model" (the MLP, vocab and, with fsdp, every embed axis still shard)
  cfg = T.TrainConfig(learning_rate=1e-4, warmup_steps=1, total_steps=steps, log_every=1, rules=rules,
                      replicate_indivisible=True)
  return np.array([r["loss"] for r in T.train(model, batches, cfg, mesh=mesh, progress=False).history])


def _step_costs(make_model, batch, n: int):
  """``(argument bytes per device, collective bytes per device, trained parameter bytes)``."""
  from jaxsys import train as T
  from jaxsys.core.bench import compile_for_analysis
  from jaxsys.parallel.costs import hlo_collective_bytes
  model = make_model()
  mesh = _mesh({"data": n}, "auto") if n > 1 else None
  # read, never run (the trained runs use other schedules): the analysis compile's plan and HLO
  compiled = compile_for_analysis(T.lower_step(model, batch, T.TrainConfig(rules="fsdp"), mesh=mesh))
  comm = sum(hlo_collective_bytes(compiled.as_text()).values()) if n > 1 else 0.0
  return compiled.memory_analysis().argument_size_in_bytes, comm, _trained_bytes(model)


def _trained_bytes(model) -> int:
  """Bytes of the parameters ``train`` optimizes in ``model`` (AdamW keeps two moments of each):
  every parameter, or the LoRA adapters alone when it has any."""
  import jax
  from flax import nnx

  from jaxsys.nn.lora import trainable_filter
  return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, trainable_filter(model))))


def _lora_rows(make_model, full: int, quick: bool) -> list[Row]:
  """LoRA r=16 against full fine-tuning: on the query and value projections (PEFT's default for
  Llama-family models: the 2% goal) and on all seven projections (no goal)."""
  from flax import nnx

  from jaxsys.nn.lora import LoRAConfig, apply_lora
  rows = []
  for label, targets, goal in (("q, v projections (PEFT's default)", ("attn/wq$", "attn/wv$"), "<= 0.02"),
                               ("all 7 projections", (), None)):
    model = make_model()
    apply_lora(model, LoRAConfig(rank=16, alpha=32, targets=targets), rngs=nnx.Rngs(0))
    ours = _trained_bytes(model)
    rows.append(Row(metric=f"LoRA r=16 on {label}: trained parameters (optimizer state) vs full fine-tuning",
                    unit="bytes (ratio)", baseline=full, baseline_name="full fine-tuning", ours=ours,
                    ratio=ours / full, goal=None if quick else goal,
                    note="AdamW keeps two moments per trained parameter" + (
                        "; the 2% goal is SmolLM2's (full mode): rank 16 is a large share of this quick "
                        "model's 128-wide projections" if quick else "")))
  return rows


def _plot(out, counts, measured):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot(counts, np.asarray(measured) / 2**20, "o-", label="FSDP, compiled step (measured)")
  ax.plot(counts, measured[0] / np.asarray(counts) / 2**20, "--", label="ideal 1/n")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("devices (data axis)")
  ax.set_ylabel("MiB per device")
  ax.set_title("parameters + AdamW state + batch shard")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / "memory_per_device.png", dpi=100)
  plt.close(fig)


def run(quick: bool, out_dir: str, seed: int = 0, mesh: dict | None = None,
        dtype: str = "float32") -> list[Row]:
  """``mesh`` (``--mesh data=2,model=4``): compare that one layout (Explicit axes) instead of
  :data:`LAYOUTS`; ``dtype``: the models' compute dtype (bfloat16 loosens the loss agreement)."""
  out = run_dir(NAME, out_dir)
  make_model, batches, steps = _setup(quick, seed, dtype)
  rows = []
  ref = _losses(make_model, batches, steps)
  layouts = LAYOUTS if mesh is None else ((",".join(f"{a}={n}" for a, n in mesh.items()), mesh, "explicit"),)
  for label, shape, kind in layouts:
    got = _losses(make_model, batches, steps, _mesh(shape, kind))
    rel = float(np.max(np.abs(got - ref) / np.abs(ref)))
    rows.append(Row(metric=f"fsdp loss curve vs 1 device, {label}", unit="max relative difference",
                    ours=rel, ideal=0.0, goal="<= 1e-4 (ours)", note=f"{steps} steps; losses {ref[0]:.4f} -> {ref[-1]:.4f}"))
  counts = (1, 2, 4, 8)
  costs = {n: _step_costs(make_model, batches(0), n) for n in counts}
  mem = [costs[n][0] for n in counts]
  rows.append(Row(metric="per-device step memory, fsdp on 8 devices vs 1", unit="bytes (ratio = 8 / 1)",
                  baseline=mem[0], baseline_name="1 device", ours=mem[-1], ratio=mem[-1] / mem[0], ideal=0.125,
                  goal="<= 0.15", note="compiled train step's argument bytes: parameters, AdamW moments, batch shard"))
  p_bytes = costs[8][2]
  formula = 3 * (8 - 1) / 8 * p_bytes
  rows.append(Row(metric="collective bytes per device per step, fsdp data=8", unit="bytes (ratio = HLO / formula)",
                  baseline=formula, baseline_name="3 (n-1)/n P: 2 all-gathers + 1 reduce-scatter",
                  ours=costs[8][1], ratio=costs[8][1] / formula, ideal=1.0,
                  note=f"|HLO / formula - 1| = {abs(costs[8][1] / formula - 1):.3f} (goal <= 0.1)"))
  rows.append(Row(metric="collective bytes: |HLO / FSDP formula - 1|, data=8", unit="relative error",
                  ours=abs(costs[8][1] / formula - 1), ideal=0.0, goal="<= 0.1 (ours)"))
  rows += _lora_rows(make_model, costs[1][2], quick)
  _plot(out, counts, mem)
  write_result(NAME, rows, config={"quick": quick, "steps": steps, "seed": seed, "devices": DEVICES,
                                   "mesh": mesh, "dtype": dtype},
               quick=quick, out_dir=out_dir, extra={"memory_per_device": dict(zip(counts, mem)),
                                                    "reference_losses": ref.tolist()})
  return rows


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main(NAME))
