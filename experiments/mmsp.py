"""LongVILA MM-SP: sequence-parallel attention strategies on an 8-device (simulated CPU) mesh.

For ring (contiguous), zigzag ring, Ulysses, 2D hybrid (ring x Ulysses) and all-gather K/V:

1. communication bytes per device per attention layer (forward, and forward + backward), read
   from the compiled HLO's collectives and cross-checked with the closed-form formula;
2. per-device peak memory (the compiler's plan) vs total sequence length, and the longest
   sequence each strategy fits in a fixed per-device budget;
3. wall time of one attention-layer training step (forward + backward) and of a full decoder
   training step (loss + gradients) under each strategy;
4. per-rank work imbalance (max/mean attention FLOPs) for causal attention.

Goal: hybrid communicates no more than ring and runs faster than ring. ``--seed S`` draws other
Q/K/V, decoder weights and tokens (seed 0: the default table).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from experiments._cli import reseed
from jaxsys.core.bench import compile_for_analysis, time_interleaved
from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import make_mesh
from jaxsys.core.results import Row, run_dir, write_result
from jaxsys.ops import masks
from jaxsys.parallel import api, costs

NAME = "mmsp"
DEVICES = 8  # simulated CPU devices by default (python -m experiments.mmsp --devices N)
MESH_EXAMPLE = "ring=2,ulysses=4"
# strategy label -> (strategy, (ring, ulysses) mesh shape); filled by ``make_setups`` in ``run``
SETUPS: dict[str, tuple[str, tuple[int, int]]] = {}


def make_setups(devices: int, mesh: dict | None = None) -> dict:
  """The strategies compared on ``devices`` devices: ring, zigzag, Ulysses and all-gather over all
  of them, and 2D hybrids (``ring x ulysses``). ``mesh`` (``--mesh``) picks the hybrid shape
  (``ring=2,ulysses=4``) or, with one axis (``ulysses=8``), leaves the hybrid out."""
  if mesh is not None:
    unknown = set(mesh) - {"ring", "ulysses"}
    if unknown:
      raise ConfigError(f"--mesh axes {sorted(unknown)} are not used by mmsp; it takes ring=R,ulysses=U")
    r, u = mesh.get("ring", 1), mesh.get("ulysses", 1)
    if r * u > devices:
      raise ConfigError(f"--mesh {mesh} needs {r * u} devices but {devices} are available; on CPU "
                        f"pass --devices {r * u}")
    devices = r * u
    hybrids = [(r, u)] if r > 1 and u > 1 else []
  else:
    hybrids = [(2, devices // 2), (devices // 2, 2)] if devices >= 4 and devices % 2 == 0 else []
  p = devices
  setups = {f"ring {p}": ("ring", (p, 1)), f"zigzag {p}": ("zigzag", (p, 1)),
            f"ulysses {p}": ("ulysses", (1, p))}
  for r, u in dict.fromkeys(hybrids):
    setups[f"hybrid {r}x{u}"] = ("hybrid", (r, u))
  setups[f"allgather {p}"] = ("allgather", (p, 1))
  return setups


def _headline(setups):
  """(baseline, ours): contiguous ring vs the first hybrid (or Ulysses when there is none)."""
  base = next(k for k, v in setups.items() if v[0] == "ring")
  ours = next((k for k, v in setups.items() if v[0] == "hybrid"),
              next(k for k, v in setups.items() if v[0] == "ulysses"))
  return base, ours


MiB = 2.0 ** 20
IMPL = {"impl": "auto"}  # per-block attention backend; see _pick_impl


def _pick_impl():
  """Uses impl="auto" unless it fails inside shard_map here; then the reference (recorded)."""
  p = max(r * u for _, (r, u) in SETUPS.values())
  q = jnp.ones((1, 4 * p, max(8, p), 8))
  try:
    for strategy, shape in {v[0]: v[1] for v in SETUPS.values() if v[0] in ("hybrid", "ulysses")}.items():
      fn = functools.partial(api.sequence_parallel_attention, mesh=_mesh(shape),
                             strategy=strategy, mask=masks.Causal(), impl="auto")
      jax.block_until_ready(jax.jit(_train_fn(fn))(q, q, q))
    IMPL["impl"] = "auto"
    return "auto", None
  except Exception as e:  # noqa: BLE001  (recorded in the result config)
    IMPL["impl"] = "reference"
    return "reference", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _mesh(shape):
  return make_mesh({"ring": shape[0], "ulysses": shape[1]})


def _attn_fn(strategy, mesh):
  return functools.partial(api.sequence_parallel_attention, mesh=mesh, strategy=strategy,
                           mask=masks.Causal(), tokens_reordered=True, impl=IMPL["impl"])


def _structs(plan, mesh, b, s, h, hk, d, dtype=jnp.float32):
  sh = NamedSharding(mesh, api.seq_spec(plan, 4))
  q = jax.ShapeDtypeStruct((b, s, h, d), dtype, sharding=sh)
  kv = jax.ShapeDtypeStruct((b, s, hk, d), dtype, sharding=sh)
  return sh, (q, kv, kv)


def _train_fn(attn):
  """One attention layer's training computation: forward and the gradients for cotangent o."""
  def step(q, k, v):
    o, vjp = jax.vjp(attn, q, k, v)
    return vjp(o)
  return step


def measure_strategy(label, b, lengths, h, hk, d, time_len, iters, dtype=jnp.float32, seed: int = 0):
  """Compiles one attention-layer training step per length; reads collectives and peak memory
  from the compiled program and times it at ``time_len`` (one compile serves all three).
  ``seed``: the run's ``--seed`` (the timed Q/K/V)."""
  strategy, shape = SETUPS[label]
  mesh = _mesh(shape)
  plan = api.make_plan(mesh, strategy)
  fn = None
  res = {"hlo_train": {}, "hlo_train_by_kind": {}, "analytic_train": {}, "analytic_fwd": {},
         "peak_bytes": {}}
  for s in lengths:
    sh, args = _structs(plan, mesh, b, s, h, hk, d, dtype)
    fn = jax.jit(_train_fn(_attn_fn(strategy, mesh)), out_shardings=(sh,) * 3)
    # the timed length's program also runs: compiled the default way; the others are only read
    compiled = fn.lower(*args).compile() if s == time_len else compile_for_analysis(fn.lower(*args))
    by_kind = costs.hlo_collective_bytes(compiled.as_text())
    kw = dict(batch=b, seq=s, heads=h, kv_heads=hk, dim=d, ring_size=plan.ring_size,
              ulysses_size=plan.ulysses_size)
    res["hlo_train"][s] = sum(by_kind.values())
    res["hlo_train_by_kind"][s] = by_kind
    res["analytic_train"][s] = sum(costs.analytic_comm_bytes(strategy, backward=True, **kw).values())
    res["analytic_fwd"][s] = sum(costs.analytic_comm_bytes(strategy, **kw).values())
    mem = compiled.memory_analysis()
    res["peak_bytes"][s] = None if mem is None else int(
        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
    if s == time_len:
      key = jax.random.PRNGKey(reseed(0, seed))
      q = jax.device_put(jax.random.normal(key, (b, s, h, d), dtype), sh)
      k = jax.device_put(jax.random.normal(key, (b, s, hk, d), dtype), sh)
      res["_timed"] = (fn, (q, k, k))  # timed round-robin across strategies in run()
  return res


def best_ms(programs: dict, rounds: int) -> dict:
  """Min ms per ``label: (fn, args)`` program, timed round-robin (``time_interleaved``) so that
  load changes on a shared machine hit every strategy alike (one program at a time)."""
  return {k: t.ms for k, t in time_interleaved(programs, rounds=rounds).items()}


def measure_decoder_step(labels, s, iters, heads=8, seed: int = 0):
  """Loss + gradients of a small decoder under each strategy (zigzag data done once). ``seed``: the
  run's ``--seed`` (tokens and weights; every strategy gets the same ones)."""
  from flax import nnx

  from jaxsys.models.llm.decoder import Decoder, DecoderConfig
  from jaxsys.parallel import zigzag

  cfg = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=heads, num_kv_heads=heads)
  tokens = jax.random.randint(jax.random.PRNGKey(reseed(1, seed)), (1, s + 1), 0, cfg.vocab_size)
  out = {}
  for label in labels:
    strategy, shape = SETUPS[label]
    mesh = _mesh(shape)
    plan = api.make_plan(mesh, strategy)
    model = Decoder(cfg, rngs=nnx.Rngs(reseed(0, seed)), attention_fn=functools.partial(
        api.sequence_parallel_attention, mesh=mesh, strategy=strategy, tokens_reordered=True,
        impl=IMPL["impl"]))
    batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:],
             "positions": jnp.arange(s, dtype=jnp.int32)[None]}
    if plan.layout == "zigzag" and plan.ring_size > 1:
      batch = zigzag.zigzag_batch(batch, plan.ring_size)
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, batch):
      def loss(p):
        logits = nnx.merge(graphdef, p)(batch["inputs"], positions=batch["positions"])
        lp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(lp, batch["labels"][..., None], -1))
      return jax.value_and_grad(loss)(params)

    def call(params, batch, step=step, mesh=mesh):
      with jax.set_mesh(mesh):
        return step(params, batch)

    # Compiled here: ``step`` closes over this iteration's ``graphdef`` (late-bound), so it must
    # be traced before the loop moves on to the next strategy.
    jax.block_until_ready(call(params, batch))
    out[label] = (call, (params, batch))
  return best_ms(out, rounds=2 * iters + 1)


def longest_fit(peak: dict, budget: float) -> int:
  """Longest length whose peak memory fits ``budget``: log-log interpolation of the measured
  points (extrapolated with the last segment's slope, capped at 4x the longest measured)."""
  pts = sorted((s, m) for s, m in peak.items() if m)
  if not pts:
    return 0
  ls, lm = np.log2([p[0] for p in pts]), np.log2([p[1] for p in pts])
  target = np.log2(budget)
  if lm[0] > target:
    return 0
  for i in range(len(pts) - 1):
    if lm[i + 1] >= target:
      t = (target - lm[i]) / (lm[i + 1] - lm[i])
      return int(2 ** (ls[i] + t * (ls[i + 1] - ls[i])))
  slope = (lm[-1] - lm[-2]) / (ls[-1] - ls[-2]) if len(pts) > 1 else 1.0
  return int(min(2 ** (ls[-1] + (target - lm[-1]) / max(slope, 1e-6)), 4 * pts[-1][0]))


def imbalance(s, h):
  res = {}
  for label, (strategy, shape) in SETUPS.items():
    plan = api.make_plan(_mesh(shape), strategy)
    w = costs.rank_work(strategy, seq=s, ring_size=plan.ring_size, ulysses_size=plan.ulysses_size,
                        causal=True, heads=h)
    res[label] = {k: float(v.max() / v.mean()) for k, v in w.items()}
  return res


def _plots(out, res, budget, dec_times, imb, comm_s):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  labels = list(res)
  x = np.arange(len(labels))
  fig, ax = plt.subplots(figsize=(8, 4))
  ax.bar(x - 0.2, [res[k]["hlo_train"][comm_s] / MiB for k in labels], 0.4, label="compiled HLO")
  ax.bar(x + 0.2, [res[k]["analytic_train"][comm_s] / MiB for k in labels], 0.4, label="formula")
  ax.set_xticks(x, labels, rotation=20)
  ax.set_ylabel(f"MiB sent / device / layer (fwd+bwd, s={comm_s})")
  ax.legend()
  ax.set_title("communication per attention layer")
  fig.tight_layout()
  fig.savefig(out / "comm_bytes.png", dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 4))
  for label in labels:
    curve = res[label]["peak_bytes"]
    ls = sorted(curve)
    ax.plot(ls, [curve[s_] / MiB for s_ in ls], marker="o", label=label)
  ax.axhline(budget / MiB, color="k", ls="--", label="budget")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  ax.set_xlabel("total sequence length")
  ax.set_ylabel("peak MiB / device (attention layer fwd+bwd)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out / "memory_vs_length.png", dpi=100)
  plt.close(fig)

  fig, axes = plt.subplots(1, 3, figsize=(13, 4))
  axes[0].bar(labels, [res[k]["step_ms"] for k in labels])
  axes[0].set_ylabel("ms / attention-layer train step")
  dl = list(dec_times)
  axes[1].bar(dl, [dec_times[k] for k in dl], color="C2")
  axes[1].set_ylabel("ms / decoder training step")
  il = list(imb)
  axes[2].bar(il, [imb[k]["visible"] for k in il], color="C1")
  axes[2].axhline(1.0, color="k", ls="--")
  axes[2].set_ylabel("max / mean causal FLOPs per rank")
  for a in axes:
    a.tick_params(axis="x", rotation=30)
  fig.tight_layout()
  fig.savefig(out / "time_and_balance.png", dpi=100)
  plt.close(fig)


def run(quick: bool, out_dir: str, mesh: dict | None = None, dtype: str = "float32", seed: int = 0):
  """``mesh``: e.g. ``{"ring": 2, "ulysses": 4}`` (the hybrid's shape) or ``{"ulysses": 8}``;
  default: every strategy over all devices with hybrids 2 x P/2 and P/2 x 2."""
  n = jax.device_count()
  if n < 2:
    raise ConfigError(
        f"mmsp compares sequence-parallel strategies and needs >= 2 devices; found {n} "
        f"({jax.devices()[0].platform}). On CPU: python -m experiments.mmsp --devices 8 (simulated "
        "devices); on GPUs/TPUs: a host or pod slice with more chips (docs/pods.md).")
  SETUPS.clear()
  SETUPS.update(make_setups(n, mesh))
  base, head = _headline(SETUPS)
  p = SETUPS[base][1][0]
  b, d = 1, 32
  h = hk = max(8, max(u for _, (_, u) in SETUPS.values()))  # heads divisible by every Ulysses size
  lengths = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384]
  lengths = [max(s_, 16 * p) for s_ in lengths]
  comm_s = time_s = lengths[0] if quick else 4096
  dec_s = max(256 if quick else 1024, 16 * p)
  iters = 3 if quick else 5
  budget = (32 if quick else 64) * MiB
  dec_labels = [base, head]
  jdtype = jnp.dtype(dtype)

  impl, impl_error = _pick_impl()
  res = {label: measure_strategy(label, b, lengths, h, hk, d, time_s, iters, jdtype, seed=seed)
         for label in SETUPS}
  step_ms = best_ms({k: v.pop("_timed") for k, v in res.items()}, rounds=2 * iters + 1)
  for label, ms in step_ms.items():
    res[label]["step_ms"] = ms
  dec_times = measure_decoder_step(dec_labels, dec_s, iters, heads=h, seed=seed)
  imb = imbalance(comm_s, h)
  fits = {k: longest_fit(v["peak_bytes"], budget) for k, v in res.items()}
  hlo = {k: v["hlo_train"][comm_s] for k, v in res.items()}
  times = {k: v["step_ms"] for k, v in res.items()}

  rows = [Row(f"comm bytes/device/attention layer fwd+bwd (HLO, s={comm_s}), {head} vs {base}",
              "MiB (ratio = ring/hybrid)", hlo[head] / MiB, baseline=hlo[base] / MiB,
              baseline_name=base, ratio=hlo[base] / hlo[head], goal=">= 1")]
  for label, r in res.items():
    rows.append(Row(f"comm fwd+bwd {label}: HLO vs formula (s={comm_s})", "MiB (ratio = HLO/formula)",
                    hlo[label] / MiB, baseline=r["analytic_train"][comm_s] / MiB,
                    baseline_name="formula", ratio=hlo[label] / r["analytic_train"][comm_s],
                    note=f"forward-only formula {r['analytic_fwd'][comm_s] / MiB:.3f} MiB; "
                         f"HLO by kind {r['hlo_train_by_kind'][comm_s]}"))
  rows.append(Row(f"attention-layer train step s={time_s}, {head} vs {base}", "ms",
                  times[head], baseline=times[base], baseline_name=base, goal=">= 1"))
  for label in SETUPS:
    if label not in (base, head):
      rows.append(Row(f"attention-layer train step s={time_s}, {label} vs {base}", "ms",
                      times[label], baseline=times[base], baseline_name=base))
  rows.append(Row(f"decoder train step (2 layers, s={dec_s}), {head} vs {base}", "ms",
                  dec_times[head], baseline=dec_times[base], baseline_name=base))
  rows.append(Row(f"causal work imbalance max/mean FLOPs per rank, zigzag vs contiguous ring (P={p})",
                  "max/mean", imb[f"zigzag {p}"]["visible"], baseline=imb[base]["visible"],
                  baseline_name="contiguous ring", ideal=1.0, goal="<= 1.01 (ours)",
                  note=f"contiguous ring formula (2P-1)/P = {(2 * p - 1) / p:.3f}; executed-block "
                       f"imbalance zigzag {imb[f'zigzag {p}']['executed']:.3f} vs ring "
                       f"{imb[base]['executed']:.3f}"))
  rows.append(Row(f"causal work imbalance max/mean FLOPs per rank, {head}", "max/mean",
                  imb[head]["visible"], ideal=1.0, goal="<= 1.01 (ours)"))
  for label in SETUPS:
    if label != base:
      rows.append(Row(f"longest sequence in {budget / MiB:.0f} MiB/device (interpolated), {label} vs {base}",
                      "tokens (ratio = ours/ring)", fits[label], baseline=fits[base],
                      baseline_name=base,
                      ratio=fits[label] / fits[base] if fits[base] else None))

  out = run_dir(NAME, out_dir)
  _plots(out, res, budget, dec_times, imb, comm_s)
  config = {"batch": b, "heads": h, "kv_heads": hk, "head_dim": d, "comm_seq": comm_s,
            "memory_lengths": lengths, "budget_mib": budget / MiB, "time_seq": time_s,
            "decoder_seq": dec_s, "devices": jax.device_count(), "dtype": dtype, "mesh": mesh,
            "mask": "causal", "setups": {k: list(v[1]) for k, v in SETUPS.items()},
            "attention_impl": impl, "auto_impl_error": impl_error, "seed": seed}
  extra = {"per_strategy": {k: {kk: ({str(a): b_ for a, b_ in vv.items()} if isinstance(vv, dict) else vv)
                                for kk, vv in v.items()} for k, v in res.items()},
           "fits_in_budget": fits, "decoder_step_ms": dec_times, "imbalance": imb}
  write_result(NAME, rows, config=config, quick=quick, out_dir=out_dir, extra=extra)
  return rows


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main("mmsp"))
