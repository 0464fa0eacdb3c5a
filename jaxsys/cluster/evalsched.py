"""Decoupled evaluation scheduling (Acme, NSDI'24, Sec. 6.2).

Evaluating a model checkpoint on many datasets as one monolithic job holds a device for the
model load, every dataset's inference, and the CPU-side metric computation in between. The
decoupled scheduler instead

1. loads each model once on the host (overlapped with other work) and pays only a host->device
   transfer when a device switches model;
2. splits every dataset into trials of at most ``trial_samples`` samples (device work only);
3. sends metric computation to a CPU worker pool, which runs after each trial's inference;
4. packs trials onto devices longest-processing-time first (LPT: a 4/3-approximation of the
   optimal makespan), preferring a device that already holds the trial's model on ties.

``plan_monolithic`` and ``plan_decoupled`` return a :class:`Plan` with its makespan, so the two
are compared on the same workload.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random

from jaxsys.core.errors import check_min, check_positive

__all__ = [
    "Dataset", "EvalCosts", "lower_bound", "Plan", "plan_decoupled", "plan_monolithic", "synthetic_suite",
    "trials",
]


@dataclasses.dataclass(frozen=True)
class Dataset:
  name: str
  samples: int
  device_s_per_sample: float
  cpu_s_per_sample: float

  def __post_init__(self):
    where = f"dataset {self.name!r}: "
    check_positive(self, "samples", where=where)
    check_min(self, 0, "device_s_per_sample", "cpu_s_per_sample", where=where)


@dataclasses.dataclass(frozen=True)
class EvalCosts:
  load_s: float = 120.0      # read a checkpoint from storage into host memory
  transfer_s: float = 10.0   # host -> device copy of the weights
  devices: int = 8
  cpu_workers: int = 16
  trial_samples: int = 500

  def __post_init__(self):
    check_positive(self, "devices", "cpu_workers", "trial_samples")
    check_min(self, 0, "load_s", "transfer_s")


@dataclasses.dataclass
class Plan:
  makespan: float
  device_busy: float          # device-seconds spent (load/transfer + inference + held idle)
  assignments: list[tuple]    # (device, model, dataset, start, end)


def synthetic_suite(n_datasets: int = 40, seed: int = 0) -> list[Dataset]:
  """A heavy-tailed suite: sizes log-uniform in [50, 20000] samples, mixed metric costs."""
  rng = random.Random(seed)
  out = []
  for i in range(n_datasets):
    n = int(math.exp(rng.uniform(math.log(50), math.log(20000))))
    dev = rng.uniform(0.005, 0.05)
    cpu = dev * rng.choice([0.1, 0.5, 2.0])  # e.g. exact match vs code execution metrics
    out.append(Dataset(f"ds{i:02d}", n, dev, cpu))
  return out


def plan_monolithic(models: list[str], suite: list[Dataset], costs: EvalCosts) -> Plan:
  """One job per model: load, then each dataset's inference followed by its metrics, on one
  device; jobs start FIFO on the first free device."""
  free = [(0.0, d) for d in range(costs.devices)]
  heapq.heapify(free)
  out, busy, makespan = [], 0.0, 0.0
  for m in models:
    t0, dev = heapq.heappop(free)
    t = t0 + costs.load_s + costs.transfer_s
    for ds in suite:
      start = t
      t += ds.samples * (ds.device_s_per_sample + ds.cpu_s_per_sample)
      out.append((dev, m, ds.name, start, t))
    busy += t - t0
    makespan = max(makespan, t)
    heapq.heappush(free, (t, dev))
  return Plan(makespan, busy, out)


def trials(models: list[str], suite: list[Dataset], trial_samples: int) -> list[tuple]:
  """(model, dataset, samples) pieces of at most ``trial_samples`` samples."""
  out = []
  for m in models:
    for ds in suite:
      k = math.ceil(ds.samples / trial_samples)
      base, extra = divmod(ds.samples, k)
      out += [(m, ds, base + (1 if i < extra else 0)) for i in range(k)]
  return out


def plan_decoupled(models: list[str], suite: list[Dataset], costs: EvalCosts) -> Plan:
  """LPT packing of trials onto devices, host loading overlapped, metrics on a CPU pool."""
  work = trials(models, suite, costs.trial_samples)
  work.sort(key=lambda w: -w[2] * w[1].device_s_per_sample)
  host_ready = {m: (i // costs.cpu_workers + 1) * costs.load_s for i, m in enumerate(models)}
  dev_free = [0.0] * costs.devices
  dev_model: list[str | None] = [None] * costs.devices
  cpu = [0.0] * costs.cpu_workers
  heapq.heapify(cpu)
  out, busy, makespan = [], 0.0, 0.0
  for m, ds, n in work:
    infer = n * ds.device_s_per_sample

    def finish(d):
      switch = dev_model[d] != m
      start = max(dev_free[d], host_ready[m] if switch else 0.0)
      return start + (costs.transfer_s if switch else 0.0) + infer, switch, start

    d = min(range(costs.devices), key=lambda d: (finish(d)[0], dev_model[d] != m))
    end, switch, start = finish(d)
    busy += end - start
    dev_free[d], dev_model[d] = end, m
    out.append((d, m, ds.name, start, end))
    c = heapq.heappop(cpu)  # metrics run on the first free CPU worker after inference
    c_end = max(c, end) + n * ds.cpu_s_per_sample
    heapq.heappush(cpu, c_end)
    makespan = max(makespan, end, c_end)
  return Plan(makespan, busy, out)


def lower_bound(models: list[str], suite: list[Dataset], costs: EvalCosts) -> float:
  """Makespan lower bound of any device schedule: total inference / devices."""
  total = sum(ds.samples * ds.device_s_per_sample for ds in suite) * len(models)
  return total / costs.devices
