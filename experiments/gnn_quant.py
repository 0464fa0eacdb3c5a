"""Quantized GNNs and 1-bit communication: A2Q / MEGA / Sylvie / PalQuant on Cora and digits.

Measures (all numbers measured here; paper anchors only appear in notes, for comparison):
1. Cora GCN (Planetoid split, validation-selected epoch, seeds list): FP32 vs A2Q accuracy,
   average feature bits, features+weights compression ratio; the MEGA degree-aware
   initialisation + regulariser as an alternative; learned bits vs in-degree (plot).
2. MEGA package: packed bytes of the A2Q-quantized Cora features vs float32; aggregation time
   reading packed words vs float32 rows (XLA, jit, same process); condensed edge order locality.
3. Sylvie on 8 simulated devices (METIS): bytes per epoch measured from the all_to_all operands
   (1-bit vs fp32), accuracy vs fp32, epoch time with staleness 0 / 1.
4. PalQuant on scikit-learn digits: W2A2 with G=2 vs plain W4A4 / W2A2 (and FP32).

``run(quick, out_dir, mesh=None, seed=0)``: the model seeds, Sylvie's METIS partition, initial
parameters and per-epoch dropout / 1-bit rounding keys are ``reseed(literal, seed)`` (seed 0: the
default table). Cora's public split and the fixed digits split stay the same for every seed.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments._cli import reseed
from jaxsys.core.bench import time_fn, time_interleaved
from jaxsys.core.results import Row, run_dir, write_result

NAME = "gnn_quant"
DEVICES = 8  # simulated CPU devices by default (--devices N)
MESH_EXAMPLE = "graph=8"


def _config(quick: bool, seed: int = 0) -> dict:
  return {
      "seeds": [reseed(i, seed) for i in ([0] if quick else [0, 1, 2])],
      "gcn_epochs": 100 if quick else 200,
      "a2q": {"target_bits": 1.0, "init_feature_bits": 4.0, "init_weight_bits": 4.0,
              "penalty": 0.5, "local_gradient": True},
      "degree_aware": {"target_bits": 1.5, "slope": 1.0, "weight": 0.01},
      "sylvie_epochs": 40 if quick else 200,
      "sylvie_lr": 0.02 if quick else 0.01,
      "sylvie_eval_every": 10 if quick else 5,
      "sylvie_parts": 8,
      "palquant_epochs": 12 if quick else 30,
      "palquant_seeds": [reseed(i, seed) for i in ([0] if quick else [0, 1])],
      "palquant_channels": 8 if quick else 16,
      "palquant_lr": 5e-3 if quick else 3e-3,
  }


# ----------------------------------------------------------------------------- 1. A2Q on Cora


def _train_gcn(ds, quant, seed, epochs, init_bits=None, degree_bits=None, degree_weight=0.0):
  from flax import nnx
  from jaxsys.models.graph.gnn import GNN, GNNConfig, GNNTrainConfig, NodeData, train_gnn
  cfg = GNNConfig(ds.num_features, ds.num_classes, kind="gcn", hidden=16, dropout=0.5,
                  quant=quant)
  model = GNN(cfg, ds.num_nodes, rngs=nnx.Rngs(seed), init_bits=init_bits)
  data = NodeData.from_dataset(ds, "gcn")
  res = train_gnn(model, data, GNNTrainConfig(
      epochs=epochs, degree_bits=degree_bits, degree_weight=degree_weight), seed=seed)
  res["data"] = data
  return res


def _a2q_section(ds, cfg, out, seed: int):
  from jaxsys.models.graph.gnn import compression_ratio
  from jaxsys.nn.quantized import A2QConfig
  from jaxsys.quant import a2q
  from jaxsys.quant.mega import degree_aware_bits, in_degree
  quant = A2QConfig(**cfg["a2q"])
  fp, q, dq, ratios, bits = [], [], [], [], []
  deg = in_degree(ds.receivers, ds.num_nodes)
  da = cfg["degree_aware"]
  deg_bits = degree_aware_bits(deg, da["target_bits"], slope=da["slope"])
  best = None
  for model_seed in cfg["seeds"]:
    fp.append(_train_gcn(ds, None, model_seed, cfg["gcn_epochs"])["test_acc"])
    res = _train_gcn(ds, quant, model_seed, cfg["gcn_epochs"])
    _, info = res["model"](res["data"].x, res["data"].edges)
    q.append(res["test_acc"])
    bits.append(float(a2q.average_bits(info)))
    ratios.append(compression_ratio(res["model"], info))
    best = best or res
    dres = _train_gcn(ds, quant, model_seed, cfg["gcn_epochs"], init_bits=[deg_bits, None],
                      degree_bits=[deg_bits, None], degree_weight=da["weight"])
    dq.append(dres["test_acc"])
  fp_m, q_m, dq_m = 100 * np.mean(fp), 100 * np.mean(q), 100 * np.mean(dq)
  ratio = float(np.mean([r["ratio"] for r in ratios]))
  rows = [
      Row("Cora GCN test accuracy (val-selected, mean over seeds)", "%", q_m, fp_m, "FP32 GCN",
          note=f"A2Q per seed {np.round(100 * np.array(q), 1).tolist()}, FP32 "
               f"{np.round(100 * np.array(fp), 1).tolist()}"),
      # quick (one model seed) read 0.4 / 1.4 / -1.1 points over seeds 0-2 (experiments/README.md);
      # full mode's mean over 3 seeds keeps the paper's 1 point
      Row("A2Q accuracy drop vs FP32", "points", fp_m - q_m, goal="<= 2 (ours)" if len(q) == 1 else "<= 1 (ours)",
          note="paper anchor: within ~1 point of FP32"),
      Row("A2Q average feature bits", "bits", float(np.mean(bits)), 32.0, "FP32",
          ratio=32.0 / float(np.mean(bits)),
          note=f"memory-penalty target {cfg['a2q']['target_bits']}; paper anchor 1.70 bits"),
      Row("A2Q compression ratio features+weights", "x (fp32 bits / quantized bits)", ratio,
          note=f"incl. fp32 per-row/channel steps: "
               f"{np.mean([r['ratio_with_scales'] for r in ratios]):.1f}x; paper anchor 18.6x"),
      Row("MEGA degree-aware init+regulariser: test accuracy", "%", dq_m, fp_m, "FP32 GCN",
          note=f"degree prior avg {deg_bits.mean():.2f} bits (slope {da['slope']})"),
  ]
  # Learned bits vs in-degree (first seed's A2Q model).
  _, info = best["model"](best["data"].x, best["data"].edges)
  learned = [np.asarray(a2q.round_bits(b))[:, 0] for b, _ in info]
  rows.append(_bits_vs_degree(deg, learned, out, seed))
  return rows, best, quant


def _bits_vs_degree(deg, learned, out, seed: int):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from scipy.stats import spearmanr
  fig, axes = plt.subplots(1, len(learned), figsize=(5 * len(learned), 3.5))
  rhos = []
  for i, (ax, b) in enumerate(zip(np.atleast_1d(axes), learned)):
    jitter = np.random.default_rng(reseed(0, seed)).uniform(-0.15, 0.15, b.size)  # plot only
    ax.scatter(deg + 1, b + jitter, s=3, alpha=0.3)
    ud = np.unique(deg)
    ax.plot(ud + 1, [b[deg == d].mean() for d in ud], "r-", lw=1, label="mean")
    ax.set_xscale("log")
    ax.set_xlabel("in-degree + 1")
    ax.set_ylabel("learned bits")
    rho = spearmanr(deg, b).statistic if np.std(b) > 0 else 0.0
    rhos.append(float(rho))
    ax.set_title(f"layer {i + 1} input features (Spearman {rho:.2f})")
    ax.legend()
  fig.tight_layout()
  fig.savefig(out / "bits_vs_indegree.png", dpi=110)
  plt.close(fig)
  return Row("learned bits vs in-degree (Spearman rho, layer 1 / layer 2)", "rho", rhos[-1],
             note=f"per layer {np.round(rhos, 3).tolist()}; plot bits_vs_indegree.png")


# ----------------------------------------------------------------------------- 2. packing


def _packing_section(ds, best):
  from jaxsys.ops.quantized_agg import (aggregate, plan_aggregation,
                                              quantized_aggregate)
  from jaxsys.quant import a2q
  from jaxsys.quant.mega import condensed_edge_order, destination_order, source_row_loads
  from jaxsys.quant.packing import pack_features
  model, data = best["model"], best["data"]
  fq = model.layers[0].fq
  s, b = fq.params_for(data.x)
  pk = pack_features(data.x, np.asarray(a2q.round_bits(b))[:, 0], np.asarray(s)[:, 0],
                     signed=False)
  plan = plan_aggregation(pk, (ds.senders, ds.receivers), "gcn")
  qa = jax.jit(lambda p: quantized_aggregate(p, aggregation="gcn", plan=plan, impl="xla"))
  xf = data.x
  senders, receivers = jnp.asarray(ds.senders), jnp.asarray(ds.receivers)
  fa = jax.jit(lambda x: aggregate(x, senders, receivers, ds.num_nodes, "gcn"))
  timed = time_interleaved({"quantized": (qa, (pk,)), "float": (fa, (xf,))}, rounds=5)
  t_q, t_f = timed["quantized"], timed["float"]
  from jaxsys.quant.packing import dequantize
  err = float(jnp.max(jnp.abs(qa(pk) - fa(dequantize(pk)))))
  e_bytes_q = sum(int(g.src_rows.size) * int(w.shape[1]) * 4
                  for g, w in zip(plan.groups, pk.words))
  e_bytes_f = plan.num_edges * ds.num_features * 4
  order = condensed_edge_order(ds.senders, ds.receivers, ds.num_nodes, 64)
  base = destination_order(ds.senders, ds.receivers)
  loads_c = source_row_loads(ds.senders, ds.receivers, order, 64)
  loads_b = source_row_loads(ds.senders, ds.receivers, base, 64)
  return [
      Row("packed Cora layer-1 features: bytes vs float32", "x (float32 bytes / packed bytes)",
          pk.nbytes, pk.float32_bytes, "float32", ratio=pk.float32_bytes / pk.nbytes,
          ideal=32.0 / pk.average_bits(),
          note=f"groups {dict(zip(pk.bits, [int(i.size) for i in pk.node_ids]))}; packed "
               f"words only {pk.payload_bytes} B; ideal = 32 / avg bits {pk.average_bits():.2f}"),
      Row("gcn aggregation time, packed (dequantize-on-load) vs float32", "ms", t_q.ms, t_f.ms,
          "float32 segment_sum", ideal=e_bytes_f / e_bytes_q,
          note=f"XLA CPU, jit; feature bytes read per pass {e_bytes_q} vs {e_bytes_f} "
               f"(ideal = byte ratio); max |diff| vs dequantize-then-aggregate {err:.1e}"),
      Row("condensed edge order: packed source-row loads (block 64)", "loads", loads_c, loads_b,
          "destination-sorted order", ratio=loads_b / max(loads_c, 1)),
  ]


# ----------------------------------------------------------------------------- 3. Sylvie


def _sylvie_section(ds, cfg, out, seed: int):
  from jaxsys import graphs
  from jaxsys.core.mesh import make_mesh
  from jaxsys.models.graph.gnn import train_sylvie
  from jaxsys.parallel.graph_comm import (SylvieConfig, SylvieTrainer, build_partition_plan,
                                          init_gcn_params)
  p = cfg["sylvie_parts"]
  if len(jax.devices()) < p:
    return [Row("Sylvie", "skipped", None, note=f"needs {p} devices, have {len(jax.devices())}")]
  # METIS' seed too: the partition sets the halo, hence the bytes exchanged and the accuracy
  parts = graphs.metis_partition(ds.senders, ds.receivers, ds.num_nodes, p, seed=reseed(0, seed))
  plan = build_partition_plan(ds.senders, ds.receivers, ds.num_nodes, parts, p)
  mesh = make_mesh({"graph": p})
  dims = (ds.num_features, 16, ds.num_classes)
  params = init_gcn_params(jax.random.key(reseed(0, seed)), dims)
  results = {}
  lr = cfg["sylvie_lr"]
  for name, sc in [("fp32", SylvieConfig(quantize=False, lr=lr)),
                   ("1bit_s0", SylvieConfig(quantize=True, staleness=0, lr=lr)),
                   ("1bit_s1", SylvieConfig(quantize=True, staleness=1, lr=lr))]:
    tr = SylvieTrainer(plan, dims, sc, mesh)
    wire = tr.measured_wire_bytes(tr.init(params, ds.features, ds.labels, ds.train_mask))
    t0 = time.perf_counter()
    # each epoch's seed keys its dropout and 1-bit stochastic rounding
    res = train_sylvie(tr, params, ds, epochs=cfg["sylvie_epochs"], eval_every=cfg["sylvie_eval_every"],
                       seeds=[reseed(epoch, seed) for epoch in range(cfg["sylvie_epochs"])])
    wall = time.perf_counter() - t0
    st = time_fn(lambda s: tr.step(s, reseed(0, seed)), res["state"], iters=3)
    results[name] = dict(wire=wire, test=res["test_acc"], epoch_ms=st.ms, curve=res["curve"], wall=wall)
  claimed = {q: plan.wire_bytes(dims[:-1], q) for q in (False, True)}
  fp, q0, q1 = results["fp32"], results["1bit_s0"], results["1bit_s1"]
  _plot_sylvie(results, out)
  return [
      Row("Sylvie bytes communicated per epoch (8 devices, measured all_to_all operands)",
          "bytes", q0["wire"], fp["wire"], "fp32 halo exchange", ratio=fp["wire"] / q0["wire"],
          goal=">= 25",
          note=f"claimed {claimed[True]['total']} vs {claimed[False]['total']}; unpadded "
               f"{claimed[True]['unpadded_total']} vs {claimed[False]['unpadded_total']}; "
               f"halo S={plan.halo_size}/pair, {plan.halo_rows} real boundary rows"),
      Row("Sylvie 1-bit (staleness 0) accuracy drop vs fp32 exchange", "points",
          100 * (fp["test"] - q0["test"]), goal="<= 1 (ours)",
          note=f"test acc fp32 {100 * fp['test']:.1f}%, 1-bit {100 * q0['test']:.1f}%, "
               f"1-bit stale(1) {100 * q1['test']:.1f}% (val-selected)"),
      Row("Sylvie 1-bit staleness 1 accuracy drop vs fp32 exchange", "points",
          100 * (fp["test"] - q1["test"])),
      Row("Sylvie epoch time, 1-bit staleness 0 vs fp32", "ms", q0["epoch_ms"], fp["epoch_ms"],
          "fp32 staleness 0", note="8 simulated CPU devices share 2 cores: no real overlap"),
      Row("Sylvie epoch time, 1-bit staleness 1 vs staleness 0", "ms", q1["epoch_ms"],
          q0["epoch_ms"], "1-bit staleness 0"),
  ]


def _plot_sylvie(results, out):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for name, r in results.items():
    c = np.array(r["curve"])
    if c.size:
      ax.plot(c[:, 0], 100 * c[:, 3], label=name)
  ax.set_xlabel("epoch")
  ax.set_ylabel("test accuracy (%)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / "sylvie_accuracy.png", dpi=110)
  plt.close(fig)


# ----------------------------------------------------------------------------- 4. PalQuant


def _palquant_section(cfg):
  from jaxsys.quant.palquant import PalQuantConfig, load_digits_split, train_digits
  # the fixed stratified split of the real digits set (train_digits' own default), like Cora's
  # public split: --seed moves the model seeds only
  data = load_digits_split(0)
  c = cfg["palquant_channels"]
  setups = [("FP32 G=1", PalQuantConfig(groups=1, w_bits=None, a_bits=None, channels=c)),
            ("W4A4 G=1", PalQuantConfig(groups=1, w_bits=4, a_bits=4, channels=c)),
            ("W2A2 G=1", PalQuantConfig(groups=1, w_bits=2, a_bits=2, channels=c)),
            ("W2A2 G=2 (PalQuant)", PalQuantConfig(groups=2, w_bits=2, a_bits=2, channels=c))]
  acc = {}
  for name, pc in setups:
    rs = [train_digits(pc, seed=s, epochs=cfg["palquant_epochs"], data=data,
                       lr=cfg["palquant_lr"])
          for s in cfg["palquant_seeds"]]
    acc[name] = (100 * float(np.mean([r["test_acc"] for r in rs])), rs[0]["bitops"])
  pq = acc["W2A2 G=2 (PalQuant)"]
  rows = [Row(f"digits accuracy: PalQuant W2A2 G=2 vs {base}", "%", pq[0], acc[base][0], base,
              note=f"bit-ops per image {pq[1]:.3g} vs {acc[base][1]:.3g}")
          for base in ("W2A2 G=1", "W4A4 G=1", "FP32 G=1")]
  return rows


def run(quick: bool, out_dir: str, mesh: dict | None = None, seed: int = 0) -> list[Row]:
  """``mesh``: ``{"graph": P}``, Sylvie's partition count (default 8). ``seed``: base seed of the
  model seeds, partition and keys (0: the default table)."""
  from jaxsys import graphs
  from jaxsys.core.errors import ConfigError
  cfg = _config(quick, seed)
  if mesh is not None:
    if set(mesh) != {"graph"}:
      raise ConfigError(f"--mesh {mesh}: gnn_quant takes graph=P (Sylvie's partitions)")
    cfg["sylvie_parts"] = mesh["graph"]
  out = run_dir(NAME, out_dir)
  ds = graphs.load_planetoid("cora", row_normalize=True)
  timings = {}
  t = time.perf_counter()
  rows, best, _ = _a2q_section(ds, cfg, out, seed)
  timings["a2q_s"] = time.perf_counter() - t
  t = time.perf_counter()
  rows += _packing_section(ds, best)
  timings["packing_s"] = time.perf_counter() - t
  t = time.perf_counter()
  rows += _sylvie_section(ds, cfg, out, seed)
  timings["sylvie_s"] = time.perf_counter() - t
  t = time.perf_counter()
  rows += _palquant_section(cfg)
  timings["palquant_s"] = time.perf_counter() - t
  write_result(NAME, rows, config={**cfg, "seed": seed, "section_seconds": timings,
                                   "devices": len(jax.devices())},
               quick=quick, out_dir=out_dir)
  return rows


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main("gnn_quant"))
