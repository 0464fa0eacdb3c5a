"""Block layout of a (reordered) adjacency and Elastic Computation Reformation (TorchGT).

The adjacency ``A[r, s]`` (query r reads key s) is tiled into ``block_size x block_size`` blocks.
``block_layout`` lists the visited blocks with their edge counts and densities
``density = edges / (rows * cols)``. After cluster reordering, edges concentrate in a few dense
diagonal blocks.

Elastic Computation Reformation (ECR, TorchGT section 4.3) splits the attention work: blocks with
``density >= threshold`` run as dense tiles (``q_blk @ k_blk^T`` with the block's adjacency as a
token mask -- regular matmuls), all remaining edges run through the edge (gather/segment) kernel.

* ``mode="exact"`` (default): dense tiles keep the adjacency bits, so the result equals sparse
  attention exactly (the two parts are merged with a log-sum-exp rule).
* ``mode="approximate"``: dense tiles are densified (every pair inside attends, as in the paper's
  approximate ECR) and ``random_blocks`` extra random key blocks per query block row are added
  densified; attention then differs from the topology-only attention.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsys.core.errors import ConfigError, check_min, check_one_of
from jaxsys.graphs.dataset import check_edges

__all__ = ["block_layout", "GraphTileLayout", "MODES", "reform", "ReformConfig", "ReformedGraph"]

MODES = ("exact", "approximate")


@dataclasses.dataclass(frozen=True, eq=False)
class GraphTileLayout:
  """Visited blocks of the adjacency, sorted by (row block, column block)."""
  num_nodes: int
  block_size: int
  rows: np.ndarray  # int32 [K] query (receiver) block
  cols: np.ndarray  # int32 [K] key (sender) block
  counts: np.ndarray  # int64 [K] edges in the block
  density: np.ndarray  # float64 [K]

  @property
  def num_blocks(self) -> int:
    """Blocks per side: ``ceil(num_nodes / block_size)``."""
    return -(-self.num_nodes // self.block_size)

  def dense_edge_fraction(self, threshold: float) -> float:
    """Fraction of edges that lie in blocks with ``density >= threshold``."""
    total = self.counts.sum()
    return float(self.counts[self.density >= threshold].sum() / max(total, 1))

  def layout(self) -> np.ndarray:
    """Boolean ``[num_blocks, num_blocks]`` visited-block matrix (small graphs only)."""
    out = np.zeros((self.num_blocks, self.num_blocks), bool)
    out[self.rows, self.cols] = True
    return out


def _block_sizes(num_nodes, block_size, idx):
  return np.minimum(block_size, num_nodes - idx * block_size)


def block_layout(senders, receivers, num_nodes: int, block_size: int) -> GraphTileLayout:
  """Visited blocks with per-block edge counts and densities."""
  if block_size < 1:
    raise ConfigError(f"{block_size=} must be >= 1")
  check_edges(senders, receivers, num_nodes)
  nb = -(-num_nodes // block_size)
  key = (np.asarray(receivers, np.int64) // block_size) * nb + np.asarray(senders, np.int64) // block_size
  uniq, counts = np.unique(key, return_counts=True)
  rows, cols = (uniq // nb).astype(np.int32), (uniq % nb).astype(np.int32)
  area = _block_sizes(num_nodes, block_size, rows) * _block_sizes(num_nodes, block_size, cols)
  return GraphTileLayout(num_nodes, block_size, rows, cols, counts.astype(np.int64), counts / area)


@dataclasses.dataclass(frozen=True)
class ReformConfig:
  """ECR settings: tile size, density threshold, exact/approximate mode."""
  block_size: int = 64
  threshold: float = 0.05
  mode: str = "exact"
  random_blocks: int = 0  # approximate mode only: extra densified random key blocks per row
  seed: int = 0

  def __post_init__(self):
    check_min(self, 1, "block_size")
    check_min(self, 0.0, "threshold", note=" (use > 1 to disable dense tiles)")
    check_one_of("mode", self.mode, MODES)
    check_min(self, 0, "random_blocks")
    if self.random_blocks and self.mode != "approximate":
      raise ConfigError(f"random_blocks={self.random_blocks} needs mode='approximate' (exact keeps the topology)")


@dataclasses.dataclass(frozen=True, eq=False)
class ReformedGraph:
  """Attention work split into dense tiles and leftover edges.

  ``block_bits[t, i, j]``: query ``rows[t]*B + i`` reads key ``cols[t]*B + j`` (False beyond
  ``num_nodes``). ``senders``/``receivers``: the edges not covered by a tile, sorted by receiver.
  """
  num_nodes: int
  block_size: int
  rows: np.ndarray  # int32 [T]
  cols: np.ndarray  # int32 [T]
  block_bits: np.ndarray  # bool [T, B, B]
  senders: np.ndarray  # int32 [E_rest]
  receivers: np.ndarray  # int32 [E_rest]
  mode: str = "exact"
  num_edges: int = 0  # edges of the original graph

  @property
  def num_blocks(self) -> int:
    return -(-self.num_nodes // self.block_size)

  @property
  def num_tiles(self) -> int:
    return int(self.rows.shape[0])

  @property
  def dense_edge_fraction(self) -> float:
    """Fraction of the original edges computed inside dense tiles."""
    return 1.0 - self.senders.shape[0] / max(self.num_edges, 1)


def reform(senders, receivers, num_nodes: int, config: ReformConfig = ReformConfig()) -> ReformedGraph:
  """Splits edges into dense tiles (density >= threshold) and leftover edges (ECR)."""
  b = config.block_size
  lay = block_layout(senders, receivers, num_nodes, b)
  nb = lay.num_blocks
  dense = lay.density >= config.threshold
  rows, cols = lay.rows[dense], lay.cols[dense]
  if config.mode == "approximate" and config.random_blocks:
    rng = np.random.default_rng(config.seed)
    extra_r = np.repeat(np.arange(nb, dtype=np.int32), config.random_blocks)
    extra_c = rng.integers(0, nb, extra_r.size).astype(np.int32)
    key = np.unique(np.concatenate([rows.astype(np.int64) * nb + cols, extra_r.astype(np.int64) * nb + extra_c]))
    rows, cols = (key // nb).astype(np.int32), (key % nb).astype(np.int32)
  s = np.asarray(senders, np.int64)
  r = np.asarray(receivers, np.int64)
  tile_of = np.full(nb * nb if nb * nb <= 1 << 26 else 0, -1, np.int64)
  tile_keys = rows.astype(np.int64) * nb + cols
  ekey = (r // b) * nb + s // b
  if tile_of.size:
    tile_of[tile_keys] = np.arange(tile_keys.size)
    t = tile_of[ekey]
  else:  # huge block grids: binary search in the sorted tile keys
    pos = np.minimum(np.searchsorted(tile_keys, ekey), max(tile_keys.size - 1, 0))
    t = np.where(tile_keys.size and (tile_keys[pos] == ekey), pos, -1) if tile_keys.size else np.full(ekey.shape, -1)
  inside = t >= 0
  if config.mode == "exact":
    bits = np.zeros((tile_keys.size, b, b), bool)
    bits[t[inside], r[inside] % b, s[inside] % b] = True
  else:
    bits = np.ones((tile_keys.size, b, b), bool)
    real_q = (rows[:, None] * b + np.arange(b)[None]) < num_nodes  # [T, B]
    real_k = (cols[:, None] * b + np.arange(b)[None]) < num_nodes
    bits &= real_q[:, :, None] & real_k[:, None, :]
  return ReformedGraph(num_nodes, b, rows, cols, bits, s[~inside].astype(np.int32),
                       r[~inside].astype(np.int32), config.mode, int(s.size))
