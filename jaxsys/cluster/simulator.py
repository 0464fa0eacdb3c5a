"""Trace-driven, event-driven GPU-cluster scheduler simulator (the Helios simulator's model).

A cluster is a list of nodes with GPU counts, optionally partitioned into virtual clusters
(VCs) with GPU quotas. Jobs arrive at their trace submit time and run for their trace
duration; the policy (``policies.py``) orders the waiting queue, and at every event (arrival,
completion, LAS demotion) the scheduler places jobs in priority order wherever they fit
(later jobs may start ahead of a blocked larger one). Preemptive policies may evict running
jobs whose key is worse than a waiting job's; an evicted job keeps its progress and pays
``restore_overhead`` when it resumes.

Placement: ``consolidate`` (best fit: the node with the fewest free GPUs that holds the job;
jobs larger than a node take whole free nodes) or ``random`` (a random feasible node / random
whole free nodes). Jobs larger than the cluster or their VC quota are skipped and counted in
``SimResult.skipped`` before the run starts, never mid-simulation.

Usage::

  from jaxsys.cluster import load_alibaba, ClusterSpec, simulate
  res = simulate(load_alibaba().runnable(), ClusterSpec.uniform(4, 8), "srtf")
  print(res.metrics())
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import random
from collections.abc import Mapping, Sequence

import numpy as np

from jaxsys.cluster.policies import Policy, make_policy, restore_overhead
from jaxsys.cluster.trace import Job
from jaxsys.core.errors import ConfigError, check_one_of

__all__ = ["ClusterSpec", "prepare", "SimConfig", "SimJob", "SimResult", "simulate"]

_DONE, _CHANGE = 0, 1  # event kinds; completions are processed before demotions at equal times


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """Nodes (GPUs per node) and optional per-VC GPU quotas (jobs of other VCs are skipped)."""
  node_gpus: tuple[int, ...]
  vc_quota: Mapping[str, int] | None = None

  def __post_init__(self):
    if not self.node_gpus or any(g <= 0 for g in self.node_gpus):
      raise ConfigError(f"node_gpus={self.node_gpus!r} must be a non-empty tuple of positive ints")
    if self.vc_quota is not None and any(q <= 0 for q in self.vc_quota.values()):
      raise ConfigError(f"vc_quota={dict(self.vc_quota)} must hold positive GPU counts")

  @classmethod
  def uniform(cls, nodes: int, gpus_per_node: int = 8, vc_quota=None) -> "ClusterSpec":
    if nodes <= 0 or gpus_per_node <= 0:
      raise ConfigError(f"{nodes=} and {gpus_per_node=} must be positive")
    return cls((gpus_per_node,) * nodes, vc_quota)

  @property
  def capacity(self) -> int:
    return sum(self.node_gpus)


@dataclasses.dataclass(frozen=True)
class SimConfig:
  placement: str = "consolidate"
  seed: int = 0
  restore_overheads: tuple[float, float, float] = (7.0, 30.0, 60.0)

  def __post_init__(self):
    check_one_of("placement", self.placement, ("consolidate", "random"))
    if any(o < 0 for o in self.restore_overheads):
      raise ConfigError(f"restore_overheads={self.restore_overheads} must be >= 0")


class SimJob:
  """Run-time state of one job."""
  __slots__ = ("idx", "job", "gpus", "vc", "submit", "duration", "remaining", "attained",
               "run_start", "first_start", "end", "preemptions", "overhead", "alloc", "version",
               "pred", "key")

  def __init__(self, idx: int, job: Job):
    self.idx, self.job, self.gpus, self.vc = idx, job, job.gpus, job.vc
    self.submit, self.duration = float(job.submit), float(job.duration)
    self.remaining, self.attained = self.duration, 0.0
    self.run_start = self.first_start = self.end = None
    self.preemptions, self.overhead, self.alloc, self.version = 0, 0.0, None, 0
    self.pred, self.key = None, None

  def remaining_at(self, now):
    return self.remaining - (now - self.run_start if self.run_start is not None else 0.0)

  def attained_at(self, now):
    return self.attained + (self.gpus * (now - self.run_start) if self.run_start is not None else 0.0)


class _Nodes:
  """Free GPUs per node, with buckets by free count for O(max GPUs) best-fit lookups."""

  def __init__(self, node_gpus: Sequence[int], placement: str, rng: random.Random):
    self.cap = list(node_gpus)
    self.free = list(node_gpus)
    self.total_free = sum(node_gpus)
    self.max_cap = max(node_gpus)
    self.buckets = [set() for _ in range(self.max_cap + 1)]
    for i, g in enumerate(node_gpus):
      self.buckets[g].add(i)
    self.placement, self.rng = placement, rng

  def _set(self, node: int, free: int):
    if free < 0 or free > self.cap[node]:
      raise RuntimeError(f"node {node} would have {free} free of {self.cap[node]} GPUs")
    self.buckets[self.free[node]].discard(node)
    self.total_free += free - self.free[node]
    self.free[node] = free
    self.buckets[free].add(node)

  def find(self, gpus: int) -> list[tuple[int, int]] | None:
    """An allocation [(node, gpus)] for a job, or None if it does not fit now."""
    if gpus > self.total_free:
      return None
    if gpus <= self.max_cap:
      if self.placement == "consolidate":
        for f in range(gpus, self.max_cap + 1):
          if self.buckets[f]:
            return [(min(self.buckets[f]), gpus)]
        return None
      feasible = [n for f in range(gpus, self.max_cap + 1) for n in self.buckets[f]]
      return [(self.rng.choice(sorted(feasible)), gpus)] if feasible else None
    whole = [n for n in range(len(self.cap)) if self.free[n] == self.cap[n]]
    if self.placement == "random":
      self.rng.shuffle(whole)
    else:
      whole.sort(key=lambda n: -self.cap[n])
    alloc, need = [], gpus
    for n in whole:
      take = min(self.cap[n], need)
      alloc.append((n, take))
      need -= take
      if need == 0:
        return alloc
    return None

  def take(self, alloc):
    for n, g in alloc:
      self._set(n, self.free[n] - g)

  def give(self, alloc):
    for n, g in alloc:
      self._set(n, self.free[n] + g)


@dataclasses.dataclass
class SimResult:
  """Per-job outcomes (arrays indexed like ``jobs``), run segments, utilisation timeline."""
  policy: str
  jobs: list[Job]
  submit: np.ndarray
  start: np.ndarray
  end: np.ndarray
  duration: np.ndarray
  gpus: np.ndarray
  preemptions: np.ndarray
  overhead: np.ndarray
  segments: list[tuple[int, float, float, tuple]]  # (job index, start, end, allocation)
  timeline: np.ndarray  # [events, 2]: (time, busy GPUs after the event)
  capacity: int
  skipped: dict[str, int]
  predictions: np.ndarray | None = None

  @property
  def jct(self) -> np.ndarray:
    return self.end - self.submit

  @property
  def queue(self) -> np.ndarray:
    return self.start - self.submit

  def utilisation(self) -> float:
    """Busy GPU-seconds / (capacity x span from first submit to last end)."""
    t, busy = self.timeline[:, 0], self.timeline[:, 1]
    if len(t) < 2:
      return 0.0
    area = float(np.sum(busy[:-1] * np.diff(t)))
    span = float(self.end.max() - self.submit.min())
    return area / (self.capacity * span) if span > 0 else 0.0

  def metrics(self) -> dict[str, float]:
    jct, q = self.jct, self.queue
    return {"jobs": len(self.jobs), "avg_jct": float(jct.mean()), "median_jct": float(np.median(jct)),
            "p99_jct": float(np.percentile(jct, 99)), "avg_queue": float(q.mean()),
            "median_queue": float(np.median(q)), "p99_queue": float(np.percentile(q, 99)),
            "makespan": float(self.end.max() - self.submit.min()),
            "utilisation": self.utilisation(), "preemptions": int(self.preemptions.sum()),
            "overhead_s": float(self.overhead.sum()),
            "skipped": int(sum(self.skipped.values()))}


def prepare(jobs: Sequence[Job], cluster: ClusterSpec) -> tuple[list[Job], dict[str, int]]:
  """Drops (and counts) jobs the cluster can never run: no GPUs, never started in the trace,
  larger than the cluster / their VC quota, or of a VC without a quota."""
  kept, skipped = [], collections.Counter()
  cap = cluster.capacity
  for j in jobs:
    if j.gpus <= 0:
      skipped["no GPUs requested"] += 1
    elif j.start is None and j.state == "pending":
      skipped["never started in the trace"] += 1
    elif j.gpus > cap:
      skipped[f"gpus > cluster capacity {cap}"] += 1
    elif cluster.vc_quota is not None and j.vc not in cluster.vc_quota:
      skipped["vc has no quota"] += 1
    elif cluster.vc_quota is not None and j.gpus > cluster.vc_quota[j.vc]:
      skipped["gpus > vc quota"] += 1
    else:
      kept.append(j)
  return kept, dict(skipped)


class _Sim:
  def __init__(self, jobs, cluster: ClusterSpec, policy: Policy, config: SimConfig):
    self.policy, self.config, self.cluster = policy, config, cluster
    self.sj = [SimJob(i, j) for i, j in enumerate(jobs)]
    self.nodes = _Nodes(cluster.node_gpus, config.placement, random.Random(config.seed))
    self.vc_used = collections.Counter()
    self.waiting: list[tuple[tuple, int]] = []  # sorted by (key, idx)
    self.running: dict[int, SimJob] = {}
    self.events: list = []
    self.seq = 0
    self.segments = []
    self.timeline = [(min((s.submit for s in self.sj), default=0.0), 0)]
    self.busy = 0

  # ---------------------------------------------------------------- bookkeeping
  def push(self, t, kind, sj):
    self.seq += 1
    heapq.heappush(self.events, (t, kind, self.seq, sj.idx, sj.version))

  def enqueue(self, sj, now):
    sj.key = self.policy.key(sj, now)
    bisect.insort(self.waiting, (sj.key, sj.idx))

  def quota_ok(self, sj) -> bool:
    q = self.cluster.vc_quota
    return q is None or self.vc_used[sj.vc] + sj.gpus <= q[sj.vc]

  def start(self, sj, alloc, now):
    self.nodes.take(alloc)
    self.vc_used[sj.vc] += sj.gpus
    self.busy += sj.gpus
    if sj.first_start is None:
      sj.first_start = now
    elif sj.preemptions:  # resuming after eviction: restore from checkpoint first
      oh = restore_overhead(sj.gpus, self.config.restore_overheads)
      sj.remaining += oh
      sj.overhead += oh
    sj.alloc, sj.run_start = alloc, now
    sj.version += 1
    self.running[sj.idx] = sj
    self.push(now + sj.remaining, _DONE, sj)
    change = self.policy.next_change(sj, now) if self.policy.preemptive else None
    if change is not None and change < now + sj.remaining:
      self.push(change, _CHANGE, sj)

  def stop(self, sj, now):
    """Removes a running job from its GPUs, accounting its progress."""
    ran = now - sj.run_start
    sj.remaining = max(sj.remaining - ran, 0.0)
    sj.attained += sj.gpus * ran
    self.segments.append((sj.idx, sj.run_start, now, tuple(sj.alloc)))
    self.nodes.give(sj.alloc)
    self.vc_used[sj.vc] -= sj.gpus
    self.busy -= sj.gpus
    sj.alloc = sj.run_start = None
    sj.version += 1
    del self.running[sj.idx]

  # ---------------------------------------------------------------- scheduling
  def schedule(self, now):
    blocked = {}  # vc -> smallest GPU count that failed to place at this instant (monotone)
    preempt_ok = self.policy.preemptive
    placed = []
    self.evicted = []
    for pos, (key, idx) in enumerate(self.waiting):
      if not preempt_ok and self.nodes.total_free == 0:
        break
      sj = self.sj[idx]
      if not preempt_ok and sj.gpus >= blocked.get(sj.vc, 1 << 30):
        continue
      alloc = self.nodes.find(sj.gpus) if self.quota_ok(sj) else None
      if alloc is None and preempt_ok:
        alloc, preempt_ok = self.try_preempt(sj, key, now)
      if alloc is None:
        blocked[sj.vc] = min(blocked.get(sj.vc, 1 << 30), sj.gpus)
        continue
      placed.append(pos)
      self.start(sj, alloc, now)
    for pos in reversed(placed):
      del self.waiting[pos]
    for r in self.evicted:  # requeued after the pass so the list is not mutated while scanned
      self.enqueue(r, now)
    if self.timeline[-1][1] != self.busy:
      self.timeline.append((now, self.busy))

  def try_preempt(self, sj, key, now):
    """Evicts running jobs with a worse key (worst first) if that lets ``sj`` start.

    Returns (allocation or None, whether later waiting jobs may still preempt).
    """
    worse = sorted(((self.policy.key(r, now), r) for r in self.running.values()
                    if self.policy.key(r, now) > key), key=lambda kr: kr[0], reverse=True)
    if not worse:
      return None, False  # later waiting jobs have even worse keys: nothing to preempt for them
    # Dry run on copies: which victims (worst first) make room for sj, respecting the VC quota?
    free = list(self.nodes.free)
    vc_used = self.vc_used[sj.vc]
    victims = []
    probe = _Nodes(self.nodes.cap, "consolidate", random.Random(0))
    for _, r in worse:
      victims.append(r)
      for n, g in r.alloc:
        free[n] += g
      if r.vc == sj.vc:
        vc_used -= r.gpus
      q = self.cluster.vc_quota
      if q is not None and vc_used + sj.gpus > q[sj.vc]:
        continue
      probe.free = list(free)
      probe.total_free = sum(free)
      probe.buckets = [set() for _ in range(probe.max_cap + 1)]
      for n, f in enumerate(free):
        probe.buckets[f].add(n)
      if probe.find(sj.gpus) is not None:
        break
    else:
      return None, True
    for r in victims:
      self.stop(r, now)
      r.preemptions += 1
      self.evicted.append(r)
    return self.nodes.find(sj.gpus), True

  # ---------------------------------------------------------------- main loop
  def run(self):
    order = sorted(range(len(self.sj)), key=lambda i: (self.sj[i].submit, i))
    ptr, n = 0, len(order)
    while ptr < n or self.events:
      t = min(self.sj[order[ptr]].submit if ptr < n else float("inf"),
              self.events[0][0] if self.events else float("inf"))
      while self.events and self.events[0][0] <= t:
        _, kind, _, idx, version = heapq.heappop(self.events)
        sj = self.sj[idx]
        if version != sj.version or sj.idx not in self.running:
          continue  # stale: the job was preempted or rescheduled since
        if kind == _DONE:
          self.stop(sj, t)
          sj.end = t
          self.policy.on_finish(sj, t)
        else:  # its key changed class (LAS demotion): schedule() below may now evict it
          nxt = self.policy.next_change(sj, t)
          if nxt is not None and nxt < t + sj.remaining_at(t):
            self.push(nxt, _CHANGE, sj)
      while ptr < n and self.sj[order[ptr]].submit <= t:
        sj = self.sj[order[ptr]]
        self.policy.on_submit(sj, t)
        self.enqueue(sj, t)
        ptr += 1
      self.schedule(t)
    if self.waiting or self.running:
      raise RuntimeError(f"simulation ended with {len(self.waiting)} waiting and "
                         f"{len(self.running)} running jobs")


def simulate(jobs: Sequence[Job], cluster: ClusterSpec, policy: str | Policy = "fifo", *,
             estimator=None, config: SimConfig | None = None, strict: bool = False) -> SimResult:
  """Replays ``jobs`` on ``cluster`` under ``policy``; returns per-job outcomes and metrics.

  ``strict=True`` raises instead of skipping jobs the cluster cannot run.
  """
  config = config or SimConfig()
  if isinstance(policy, str):
    policy = make_policy(policy, estimator=estimator)
  kept, skipped = prepare(jobs, cluster)
  if strict and skipped:
    raise ConfigError(f"jobs the cluster cannot run: {skipped}")
  if not kept:
    raise ConfigError(f"no runnable jobs left (skipped: {skipped})")
  if hasattr(policy, "prepare"):
    policy.prepare(kept)
  sim = _Sim(kept, cluster, policy, config)
  sim.run()
  arr = lambda f: np.array([f(s) for s in sim.sj], dtype=np.float64)  # noqa: E731
  preds = arr(lambda s: s.pred) if sim.sj[0].pred is not None else None
  return SimResult(policy=policy.name, jobs=kept, submit=arr(lambda s: s.submit),
                   start=arr(lambda s: s.first_start), end=arr(lambda s: s.end),
                   duration=arr(lambda s: s.duration), gpus=arr(lambda s: s.gpus),
                   preemptions=arr(lambda s: s.preemptions), overhead=arr(lambda s: s.overhead),
                   segments=sim.segments, timeline=np.array(sim.timeline, dtype=np.float64),
                   capacity=cluster.capacity, skipped=skipped, predictions=preds)
