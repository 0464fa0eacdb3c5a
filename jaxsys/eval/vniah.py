"""Video needle-in-a-haystack (V-NIAH, LongVILA): exact match over a frames x depth grid.

A haystack of ``N`` frames hides one needle frame at depth ``d`` (fraction of the video); the
question after the video asks for the needle's two-digit code. The model answers greedily
(one full sequence-parallel forward per answer token: the prediction of token ``j`` is written
into the input before predicting ``j+1``) and a cell scores the fraction of exact matches.

Usage::

  grid = vniah_grid(model, spec, frames=[8, 16, 32], depths=[0, .25, .5, .75, 1], samples=8)
  plot_heatmap(grid, "runs/vniah/heatmap.png", title="after extension")
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.data import video
from jaxsys.parallel import api
from jaxsys.parallel import zigzag as zz

__all__ = ["answer_greedy", "Grid", "plot_heatmap", "seq_bucket", "vniah_grid"]


@dataclasses.dataclass
class Grid:
  frames: list[int]
  depths: list[float]
  accuracy: np.ndarray  # [len(frames), len(depths)] exact-match rate

  @property
  def mean(self) -> float:
    return float(self.accuracy.mean())

  def up_to(self, max_frames: int) -> float:
    rows = [i for i, f in enumerate(self.frames) if f <= max_frames]
    return float(self.accuracy[rows].mean()) if rows else float("nan")

  def to_json(self) -> dict:
    return {"frames": self.frames, "depths": self.depths, "accuracy": self.accuracy.tolist()}


def seq_bucket(n_frames: int, spec: video.VideoSpec, multiple: int) -> int:
  """Padded row length (inputs + 1) for ``n_frames``: inputs a multiple of ``multiple``."""
  need = video.seq_len_for(n_frames, spec) - 1
  return zz.pad_len(max(need, 1), multiple) + 1


def _frames_bucket(n_frames: int, degree: int) -> int:
  return zz.pad_len(n_frames, degree)


_JITTED: dict = {}  # graphdef -> jitted argmax-logits program (shapes cached by jit)


def _logits_fn(model):
  from flax import nnx
  graphdef, state = nnx.split(model)
  if graphdef not in _JITTED:
    @jax.jit
    def fn(state, batch, rows, cols):
      m = nnx.merge(graphdef, state)
      logits = m(batch["inputs"], batch["frames"], positions=batch["positions"],
                 segment_ids=batch.get("segment_ids"), frame_slot=batch.get("frame_slot"),
                 send_idx=batch.get("send_idx"), recv_pos=batch.get("recv_pos"))
      return jnp.argmax(logits[rows, cols], -1)  # [b] predicted token at the asked positions
    _JITTED[graphdef] = fn
  fn = _JITTED[graphdef]
  return lambda batch, rows, cols: fn(state, batch, rows, cols)


def answer_greedy(model, raw: dict, plan: api.SPPlan, num_frame_tokens: int, logits_fn=None):
  """Greedy two-digit answers ``int[b, 2]`` for rows from ``video_qa_batch``."""
  from jaxsys.parallel.multimodal import prepare_mm_batch
  logits_fn = logits_fn or _logits_fn(model)
  raw = dict(raw)
  tokens = raw["tokens"].copy()
  b, t = tokens.shape
  L = t - 1
  perm = (zz.zigzag_indices(L, plan.ring_size) if plan.layout == "zigzag" and plan.ring_size > 1
          else np.arange(L))
  where = np.argsort(perm)  # natural input position -> position in the reordered sequence
  start = raw["answer_start"]
  preds = np.zeros((b, 2), np.int32)
  for j in range(2):
    tokens[np.arange(b), start + j] = video.PAD  # hide the gold answer from the model
    raw["tokens"] = tokens
    batch = prepare_mm_batch(raw, plan, num_frame_tokens)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    pos = where[start - 1 + j]  # logits at input position i predict token i+1
    preds[:, j] = np.asarray(logits_fn(batch, jnp.arange(b), jnp.asarray(pos)))
    tokens[np.arange(b), start + j] = preds[:, j]
  return preds


def vniah_grid(model, spec: video.VideoSpec, *, frames, depths, samples: int = 8, seed: int = 7,
               plan: api.SPPlan | None = None) -> Grid:
  """Exact-match rate for every (frames, depth) cell, ``samples`` videos per cell.

  All depths of one frame count go in one batch (one compiled program per frame count).
  """
  plan = plan or model.plan or api.SPPlan("ring", (), (), 1, 1, "contiguous")
  acc = np.zeros((len(frames), len(depths)))
  row_depth = np.repeat(np.asarray(depths, float), samples)
  for i, n in enumerate(frames):
    max_frames = _frames_bucket(n, plan.degree)
    seq = seq_bucket(n, spec, plan.chunk_multiple())
    raw = video.video_qa_batch(spec, seed=seed, step=i, batch_size=len(row_depth), n_frames=n,
                               seq_len=seq, max_frames=max_frames, depths=row_depth)
    with _mesh_ctx(model):
      preds = answer_greedy(model, raw, plan, model.cfg.num_frame_tokens(max_frames))
    hit = np.all(preds == raw["codes"], axis=1).reshape(len(depths), samples)
    acc[i] = hit.mean(1)
  return Grid(list(frames), list(depths), acc)


class _mesh_ctx:
  def __init__(self, model):
    self.ctx = jax.set_mesh(model.mesh) if getattr(model, "mesh", None) is not None else None

  def __enter__(self):
    return self.ctx.__enter__() if self.ctx is not None else None

  def __exit__(self, *exc):
    return self.ctx.__exit__(*exc) if self.ctx is not None else False


def plot_heatmap(grid: Grid, path, *, title: str = ""):
  """Saves a frames x depth heatmap of exact-match accuracy (green = found)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(grid.depths), 1.0 + 0.5 * len(grid.frames)))
  im = ax.imshow(grid.accuracy, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
  ax.set_xticks(range(len(grid.depths)), [f"{d:.2f}" for d in grid.depths])
  ax.set_yticks(range(len(grid.frames)), [str(f) for f in grid.frames])
  ax.set_xlabel("needle depth")
  ax.set_ylabel("frames")
  for i in range(len(grid.frames)):
    for j in range(len(grid.depths)):
      ax.text(j, i, f"{grid.accuracy[i, j]:.2f}", ha="center", va="center", fontsize=7)
  ax.set_title(title, fontsize=9)
  fig.colorbar(im, ax=ax, fraction=0.046)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
