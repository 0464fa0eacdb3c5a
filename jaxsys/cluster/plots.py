"""Plots of simulator runs: GPU utilisation over time and the JCT distribution."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["plot_bars", "plot_run"]


def plot_run(result, path: str | Path, title: str | None = None) -> Path:
  """Two panels: busy GPUs over time (step plot) and the CDF of job completion times."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
  t = result.timeline[:, 0] / 86400
  a.step(t, result.timeline[:, 1] / result.capacity, where="post", lw=0.7)
  a.set(xlabel="time (days)", ylabel="GPU utilisation", ylim=(0, 1.05))
  jct = np.sort(result.jct)
  b.plot(np.maximum(jct, 1), np.arange(1, len(jct) + 1) / len(jct))
  b.set(xscale="log", xlabel="JCT (s)", ylabel="CDF")
  m = result.metrics()
  fig.suptitle(title or f"{result.policy}: avg JCT {m['avg_jct']:.0f}s, avg queue "
               f"{m['avg_queue']:.0f}s, util {m['utilisation']:.2f}")
  fig.tight_layout()
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_bars(names, values, path, ylabel: str, title: str = "") -> Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 3.4))
  ax.bar(names, values)
  ax.set(ylabel=ylabel, title=title)
  ax.tick_params(axis="x", rotation=30)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return Path(path)
