"""Tiny trained LM: retrieval accuracy vs context length, as trained and with RoPE scaling.

Evaluates the shipped checkpoint (``jaxsys/assets/tiny_lm``; never trains) on multi-query
associative recall (8 key/value pairs in a haystack) and multi-key passkey retrieval at the
training length and 2x / 4x / 8x beyond it (recall: 4 pairs; passkey: 1 needle), three ways:

* as trained (default RoPE, theta 1e4),
* linear position interpolation (Chen et al., 2023): positions divided by ``L / L_train``,
* theta rescale (NTK-aware base change): ``theta * s^(d / (d - 2))`` with ``s = L / L_train``,

plus copy and 2-digit arithmetic at the training length. Exact match is greedy: an example
counts when every answer token is the argmax given the correct prefix (teacher forcing, which
is identical to greedy decoding of the answer); a few are cross-checked with ``generate``.
``--seed S`` draws other evaluation examples (seed 0: the default table); the checkpoint is fixed.
``--dtype bfloat16`` runs the model in bf16 (parameters stay float32).
"""

from __future__ import annotations

import json

import numpy as np

from experiments._cli import reseed, with_compute_dtype
from jaxsys.core.results import Row, run_dir, write_result

NAME = "tiny_lm"


def _variants(model, length: int, train_len: int):
  import jaxsys.models as M
  from jaxsys.nn import RopeConfig
  rope = model.config.rope
  s = length / train_len
  out = {"as trained": model}
  if s > 1:
    d = model.config.head_dim
    out["linear PI"] = M.replace_config(model, rope=RopeConfig(theta=rope.theta, kind="linear", factor=s))
    out["theta rescale"] = M.replace_config(model, rope=RopeConfig(theta=rope.theta * s ** (d / (d - 2))))
  return out


def run(quick: bool, out_dir: str, seed: int = 0, dtype: str = "float32") -> list[Row]:
  """``dtype``: the model's compute dtype (``--dtype``; the checkpoint's parameters stay float32)."""
  import jaxsys.models as M
  from jaxsys.data import synthetic as S
  from jaxsys.serving.generation import generate

  model = with_compute_dtype(M.load_tiny_lm(), dtype)
  train_len = model.config.max_position_embeddings
  meta_path = M.TINY_LM_PATH / "training.json"
  meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
  count = 32 if quick else 200
  lengths = [train_len * m for m in (1, 2, 4, 8)]
  tasks = {"recall": {"n_keys": 4}, "passkey": {"n_needles": 1}}
  acc: dict[str, dict[str, dict[int, float]]] = {t: {} for t in tasks}
  for length in lengths:
    bs = max(2, min(32, 8192 // length))
    for task, kw in tasks.items():
      exs = S.examples(task, seed=reseed(2024, seed), count=count, length=length, **kw)
      for name, m in _variants(model, length, train_len).items():
        acc[task].setdefault(name, {})[length] = M.exact_match(m, exs, batch_size=bs)
  rows = []
  for task in tasks:
    base = acc[task]["as trained"]
    rows.append(Row(metric=f"{task} exact match @ {train_len} (training length)", unit="fraction",
                    ours=base[train_len], goal=">= 0.9 (ours)"))
    for length in lengths[1:]:
      for name in ("linear PI", "theta rescale"):
        rows.append(Row(metric=f"{task} exact match @ {length} ({length // train_len}x), {name}",
                        unit="fraction (ratio: ours - baseline)", ours=acc[task][name][length],
                        baseline=base[length], baseline_name="as trained",
                        ratio=acc[task][name][length] - base[length]))
  for task, kw in (("copy", {}), ("arith", {"max_digits": 2})):
    exs = S.examples(task, seed=reseed(2024, seed), count=count, length=min(train_len, 128), **kw)
    rows.append(Row(metric=f"{task} exact match (as trained)", unit="fraction",
                    ours=M.exact_match(model, exs)))
  # cross-check the teacher-forced score with real greedy decoding on a few recall prompts
  exs = S.examples("recall", seed=reseed(7, seed), count=8, length=train_len, n_keys=4)
  res = generate(model, [list(e.prompt) for e in exs], max_new_tokens=2)
  agree = np.mean([S.reward(e, t) for e, t in zip(exs, res.tokens)])
  tf = M.exact_match(model, exs)
  rows.append(Row(metric="recall: greedy generate reward vs teacher-forced exact match (8 prompts)",
                  unit="fraction", ours=float(agree), baseline=tf, baseline_name="teacher forced"))
  _plot(acc, lengths, train_len, run_dir(NAME, out_dir))
  write_result(NAME, rows, config={"count": count, "lengths": lengths, "train_len": train_len,
                                   "params": model.config.num_params(),
                                   "training": meta.get("command"), "seed": seed, "dtype": dtype},
               quick=quick, out_dir=out_dir, extra={"accuracy": {t: {k: {str(l): a for l, a in v.items()}
                                                                     for k, v in d.items()}
                                                                 for t, d in acc.items()}})
  return rows


def _plot(acc, lengths, train_len, folder):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(acc), figsize=(5 * len(acc), 3.5))
  for ax, (task, d) in zip(np.atleast_1d(axes), acc.items()):
    for name, vals in d.items():
      xs = sorted(vals)
      ax.plot(xs, [vals[x] for x in xs], marker="o", label=name)
    ax.axvline(train_len, color="gray", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("exact match")
    ax.set_title(task)
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
  fig.tight_layout()
  fig.savefig(folder / "recall_vs_length.png", dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main("tiny_lm"))
