"""Communication and work accounting for sequence-parallel attention.

* ``hlo_collective_bytes(compiled_text)``: bytes each device sends, read from a compiled HLO
  module's collectives (``all-to-all``, ``collective-permute``, ``all-gather``, ``all-reduce``,
  ``reduce-scatter``), multiplying ops inside ``while`` bodies by the loop's known trip count.
* ``analytic_comm_bytes(...)``: the same from the closed-form formula of each strategy.
* ``rank_work(...)``: attention work per rank (executed dense blocks and visible query-key pairs).

Per-device bytes sent by one collective over a group of ``G``: collective-permute = its buffer;
all-to-all and all-gather = ``(G-1)/G`` of the full result; reduce-scatter = ``(G-1)`` results;
all-reduce (ring algorithm) = ``2 (G-1)/G`` of the buffer.
"""

from __future__ import annotations

import math
import re

import numpy as np

from jaxsys.ops import masks as masks_lib
from jaxsys.parallel import ring as ring_lib
from jaxsys.parallel import zigzag as zz

__all__ = ["analytic_comm_bytes", "hlo_collective_bytes", "rank_work"]

_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "s32": 4, "u32": 4,
                "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_KINDS = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(_KINDS) + r")(-start)?\(")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    n = math.prod(int(x) for x in dims.split(",") if x) if dims else 1
    total += n * _DTYPE_BYTES[dtype]
  return total


def _group_size(line: str) -> int:
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    sizes = dict((k.strip("'"), int(v)) for k, v in re.findall(r"('?[\w]+'?)=(\d+)", m.group(1)))
    return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
  return 1


def _op_bytes(kind: str, result_bytes: int, group: int) -> float:
  if kind == "collective-permute":
    return float(result_bytes)
  if kind in ("all-to-all", "all-gather"):
    return result_bytes * (group - 1) / group
  if kind == "reduce-scatter":
    return float(result_bytes * (group - 1))
  return 2.0 * result_bytes * (group - 1) / group  # all-reduce


def hlo_collective_bytes(hlo_text: str) -> dict[str, float]:
  """Per-device bytes sent, by collective kind, for one execution of a compiled HLO module."""
  comps: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line.strip()) if not line.startswith(" ") else None
    if m:
      current = m.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is not None:
      comps[current].append(line)
  totals = {k: 0.0 for k in _KINDS}

  def visit(name: str, mult: float, depth: int = 0):
    if depth > 50 or name not in comps:
      return
    for line in comps[name]:
      m = _OP.search(line)
      if m:
        kind = m.group(2)
        totals[kind] += mult * _op_bytes(kind, _shape_bytes(m.group(1)), _group_size(line))
        continue
      if " while(" in line:
        body = re.search(r"body=%?([\w.\-]+)", line).group(1)
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        visit(body, mult * (int(trip.group(1)) if trip else 1), depth + 1)
      for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
        if " call(" in line or " async-start(" in line:
          visit(callee, mult, depth + 1)
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      if branches:  # count the costliest branch
        before = dict(totals)
        best = None
        for br in branches.group(1).split(","):
          snapshot = dict(totals)
          visit(br.strip().lstrip("%"), mult, depth + 1)
          gained = {k: totals[k] - snapshot[k] for k in totals}
          totals.update(snapshot)
          if best is None or sum(gained.values()) > sum(best.values()):
            best = gained
        totals.update({k: before[k] + best[k] for k in totals})

  visit(entry, 1.0)
  return {k: v for k, v in totals.items() if v}


def analytic_comm_bytes(strategy: str, *, batch: int, seq: int, heads: int, kv_heads: int,
                        dim: int, ring_size: int, ulysses_size: int, itemsize: int = 4,
                        backward: bool = False) -> dict[str, float]:
  """Closed-form per-device bytes per attention layer (forward, or forward + backward).

  ``ring_size``/``ulysses_size`` are the plan's degrees (a pure ring has ``ulysses_size=1``).
  Backward: all-to-alls and all-gathers are transposed once more (x2); the ring re-circulates
  K/V (``R-1`` hops) and sends the float32 dK/dV accumulators ``R`` hops.
  """
  out: dict[str, float] = {}
  u, r = ulysses_size, ring_size
  hk = kv_heads if kv_heads % u == 0 else max(kv_heads, u)
  if u > 1:
    n = seq // (r * u)
    a2a = batch * n * dim * (u - 1) / u * (2 * heads + 2 * hk) * itemsize
    out["all-to-all"] = a2a * (2 if backward else 1)
  if strategy == "allgather":
    p = r * u
    ag = 2 * batch * seq * kv_heads * dim * (p - 1) / p * itemsize
    out["all-gather"] = ag
    if backward:
      out["reduce-scatter"] = ag
    return out
  if r > 1:
    block = batch * (seq // r) * (hk // u) * dim  # one K (or V) block after the all-to-all
    cp = (r - 1) * 2 * block * itemsize
    if backward:
      cp += (r - 1) * 2 * block * itemsize + r * 2 * block * 4
    out["collective-permute"] = cp
  return out


def rank_work(strategy: str, *, seq: int, ring_size: int, ulysses_size: int, causal: bool,
              heads: int = 1) -> dict[str, np.ndarray]:
  """Attention work per device (query-key pairs x heads): executed blocks and visible pairs."""
  layout = "zigzag" if strategy in ("zigzag", "hybrid") else "contiguous"
  mask = masks_lib.Causal() if causal else None
  r, u = ring_size, ulysses_size
  h_local = heads / u
  if strategy == "ulysses":
    n_pairs = seq * (seq + 1) / 2 if causal else seq * seq
    ones = np.ones(r * u)
    return {"executed": ones * seq * seq * h_local, "visible": ones * n_pairs * h_local}
  if strategy == "allgather":
    p = r * u
    n = seq // p
    vis = np.array([sum(min(i + 1, seq) if causal else seq for i in range(k * n, (k + 1) * n))
                    for k in range(p)], float)
    return {"executed": np.full(p, n * seq * heads, float), "visible": vis * heads}
  local = seq // r
  executed = ring_lib.schedule_work(layout, r, local, mask).astype(float)
  visible = np.zeros(r)
  for rank in range(r):
    for start in zz.chunk_starts(layout, rank, r, local, xp=np):
      c = local // zz.num_chunks(layout)
      rows = np.arange(start, start + c)
      visible[rank] += np.sum(rows + 1) if causal else c * seq
  rep = lambda x: np.repeat(x * h_local, u)  # noqa: E731  (each Ulysses rank: h/U heads)
  return {"executed": rep(executed), "visible": rep(visible)}
