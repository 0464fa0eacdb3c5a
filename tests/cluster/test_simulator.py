"""Simulator invariants on the real trace and policy-order unit tests."""

import collections

import numpy as np
import pytest

from jaxsys.cluster import loaders
from jaxsys.cluster.estimators import OracleEstimator
from jaxsys.cluster.policies import LAS
from jaxsys.cluster.simulator import ClusterSpec, SimConfig, simulate
from jaxsys.cluster.trace import Job
from jaxsys.core.errors import ConfigError


def job(i, submit, duration, gpus=1, vc="default", user="u", name="j"):
  return Job(id=f"j{i}", user=user, vc=vc, name=name, gpus=gpus, cpus=1, nodes=1, submit=submit,
             start=submit, end=submit + duration, duration=duration, state="completed", type="gpu")


@pytest.fixture(scope="module")
def real_jobs():
  jobs = loaders.load_alibaba().runnable()
  # A contended slice of the real trace (busy weeks), shortened heavy tail kept as is.
  return [j for j in jobs if j.submit >= 11_500_000][:700]


def check_invariants(res, cluster):
  # Every job finished exactly once, after it was submitted, and JCT >= duration.
  assert np.all(np.isfinite(res.end)) and np.all(np.isfinite(res.start))
  assert np.all(res.start >= res.submit - 1e-9)
  assert np.all(res.jct >= res.duration - 1e-6)
  # Run segments: one per start; GPU-time executed = duration + restore overhead.
  per_job = collections.defaultdict(list)
  for idx, s, e, alloc in res.segments:
    per_job[idx].append((s, e, alloc))
    assert sum(g for _, g in alloc) == res.gpus[idx]
  assert sorted(per_job) == list(range(len(res.jobs)))
  for idx, segs in per_job.items():
    assert len(segs) == res.preemptions[idx] + 1
    ran = sum(e - s for s, e, _ in segs)
    assert ran == pytest.approx(res.duration[idx] + res.overhead[idx], abs=1e-3)
    assert max(e for _, e, _ in segs) == pytest.approx(res.end[idx])
  # No GPU over-allocation on any node at any time (sweep over segment boundaries).
  events = []
  for idx, s, e, alloc in res.segments:
    for n, g in alloc:
      events += [(s, 1, n, g), (e, 0, n, -g)]  # releases before allocations at equal times
  used = collections.Counter()
  for t, _, n, g in sorted(events):
    used[n] += g
    assert 0 <= used[n] <= cluster.node_gpus[n], (t, n, used[n])
  assert all(v == 0 for v in used.values())
  util = res.utilisation()
  assert 0 < util <= 1


@pytest.mark.parametrize("policy", ["fifo", "sjf", "srtf", "las", "qssf"])
@pytest.mark.parametrize("placement", ["consolidate", "random"])
def test_invariants_on_real_trace(real_jobs, policy, placement):
  cluster = ClusterSpec((8, 8, 4, 2))
  res = simulate(real_jobs, cluster, policy, estimator=OracleEstimator(),
                 config=SimConfig(placement=placement, seed=1))
  assert len(res.jobs) == len(real_jobs)
  check_invariants(res, cluster)
  if policy in ("srtf", "las"):
    assert res.preemptions.sum() > 0
    assert res.overhead.sum() > 0
  else:
    assert res.preemptions.sum() == 0


def order(res):
  return [res.jobs[i].id for i in np.argsort(res.start, kind="stable")]


def test_fifo_sjf_qssf_order():
  # One GPU; j0 runs first (alone at t=0); the rest wait and are ordered by the policy.
  jobs = [job(0, 0, 100), job(1, 1, 50, ), job(2, 2, 10), job(3, 3, 30)]
  one = ClusterSpec((1,))
  assert order(simulate(jobs, one, "fifo")) == ["j0", "j1", "j2", "j3"]
  assert order(simulate(jobs, one, "sjf")) == ["j0", "j2", "j3", "j1"]
  # QSSF ranks by predicted duration x GPUs: a 2-GPU 10 s job ranks like a 20 s 1-GPU one.
  jobs2 = [job(0, 0, 100, gpus=2), job(1, 1, 25), job(2, 2, 15, gpus=2), job(3, 3, 28)]
  res = simulate(jobs2, ClusterSpec((2,)), "qssf", estimator=OracleEstimator())
  assert res.start.tolist() == [0, 100, 128, 100]  # keys: j1 25, j3 28, j2 15 x 2 = 30
  assert simulate(jobs2, ClusterSpec((2,)), "sjf").start.tolist() == [0, 115, 100, 115]


def test_srtf_preempts_and_pays_overhead():
  jobs = [job(0, 0, 100), job(1, 10, 20)]
  res = simulate(jobs, ClusterSpec((1,)), "srtf")
  assert res.preemptions.tolist() == [1, 0]
  assert res.end[1] == 30  # the short job ran at once
  assert res.overhead[0] == 7  # 1-GPU restore overhead
  assert res.end[0] == 30 + 90 + 7
  big = [job(0, 0, 100, gpus=8), job(1, 10, 20, gpus=8)]
  assert simulate(big, ClusterSpec((8,)), "srtf").overhead[0] == 30


def test_las_demotes_by_attained_service():
  # Threshold 50 GPU-s: j0 runs alone until it attains 50, then j1 (level 0) preempts it.
  jobs = [job(0, 0, 200), job(1, 10, 100)]
  res = simulate(jobs, ClusterSpec((1,)), LAS(thresholds=(50.0,)))
  assert res.start[1] == pytest.approx(50, abs=1e-3)
  assert res.preemptions[0] >= 1
  # Without a threshold crossing nothing is preempted: both stay in queue 0, FIFO inside it.
  res = simulate(jobs, ClusterSpec((1,)), LAS(thresholds=(1e9,)))
  assert res.preemptions.sum() == 0 and order(res) == ["j0", "j1"]


def test_vc_quota_limits_concurrency():
  jobs = [job(i, 0, 100, vc="a") for i in range(3)] + [job(3, 0, 100, vc="b")]
  res = simulate(jobs, ClusterSpec((8,), vc_quota={"a": 2, "b": 6}), "fifo")
  assert sorted(res.start.tolist()) == [0, 0, 0, 100]
  check_invariants(res, ClusterSpec((8,)))


def test_oversized_and_invalid_jobs_are_skipped_with_counts():
  jobs = [job(0, 0, 10, gpus=16), job(1, 0, 10), job(2, 0, 10, vc="nope")]
  res = simulate(jobs, ClusterSpec((8,), vc_quota={"default": 8}), "fifo")
  assert len(res.jobs) == 1
  assert res.skipped == {"gpus > cluster capacity 8": 1, "vc has no quota": 1}
  with pytest.raises(ConfigError, match="cannot run"):
    simulate(jobs, ClusterSpec((8,), vc_quota={"default": 8}), "fifo", strict=True)
  with pytest.raises(ConfigError, match="no runnable jobs"):
    simulate([job(0, 0, 10, gpus=16)], ClusterSpec((8,)), "fifo")


def test_multi_node_job_takes_whole_nodes():
  jobs = [job(0, 0, 10, gpus=1), job(1, 0, 10, gpus=16)]
  cluster = ClusterSpec((8, 8, 8))
  res = simulate(jobs, cluster, "fifo")
  alloc = {idx: a for idx, _, _, a in res.segments}
  assert len(alloc[1]) == 2 and all(g == 8 for _, g in alloc[1])
  check_invariants(res, cluster)


def test_config_errors():
  with pytest.raises(ConfigError, match="placement"):
    SimConfig(placement="spread")
  with pytest.raises(ConfigError, match="node_gpus"):
    ClusterSpec((8, 0))
  with pytest.raises(ConfigError, match="policy"):
    simulate([job(0, 0, 1)], ClusterSpec((1,)), "lottery")
