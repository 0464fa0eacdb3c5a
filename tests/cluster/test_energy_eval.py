"""Cluster Energy Saving and decoupled evaluation scheduling."""

import numpy as np
import pytest

from jaxsys.cluster import energy, evalsched
from jaxsys.cluster.trace import TraceError
from jaxsys.core.errors import ConfigError


def synthetic(active, total=100):
  n = len(active)
  minutes = np.arange(n, dtype=float)
  return energy.NodeSequence(minutes, np.asarray(active, float), np.full(n, float(total)),
                             (minutes / 60) % 24, ((minutes // 1440) % 7).astype(int))


def test_power_policy_invariants_and_wakeups():
  act = np.r_[np.full(200, 20), np.full(50, 80), np.full(200, 20)]
  seq = synthetic(act)
  rep = energy.simulate_power(seq, seq.active.copy(), buffer=5, hold=30, wake_latency=5)
  p = rep.powered
  assert np.all(p >= seq.active) and np.all(p <= seq.total)
  assert rep.node_hours_off > 0 and rep.util_after > rep.util_before
  assert rep.wake_events >= 1 and rep.waited_events >= 1  # the spike outran a perfect-now forecast
  # Holding: power-down happens only after `hold` surplus minutes.
  assert p[250 + 29] >= 80 and p[-1] == 25
  # A forecast that sees the spike coming (max over the next 10 minutes) avoids the wait.
  ahead = np.array([act[i:i + 10].max() for i in range(len(act))], float)
  rep2 = energy.simulate_power(seq, ahead, buffer=5, hold=30, wake_latency=5)
  assert rep2.waited_events == 0


def test_philly_sequence_and_forecaster():
  seq = energy.load_node_sequence()
  assert len(seq.active) == 105644 and 420 in set(seq.total.tolist())
  assert np.all(seq.active <= seq.total)
  cut = 4 * 1440
  fc = energy.DemandForecaster(horizon=10, max_iter=20, stride=30).fit(seq, cut)
  mae, mae_last = fc.mae(energy.NodeSequence(*(a[:cut + 1440] for a in (
      seq.minutes, seq.active, seq.total, seq.hour, seq.weekday))), cut)
  assert np.isfinite(mae) and mae < 3 * mae_last


def test_bad_node_sequence(tmp_path):
  p = tmp_path / "seq.csv"
  p.write_text("time,active,total\n2017-10-03 00:00:00,5,10\n2017-10-03 00:01:00,12,10\n")
  with pytest.raises(TraceError, match="row 3 column 'active'"):
    energy.load_node_sequence(p)
  seq = synthetic(np.full(10, 5))
  with pytest.raises(ConfigError, match="buffer"):
    energy.simulate_power(seq, seq.active, buffer=-1)
  with pytest.raises(ConfigError, match="forecast has"):
    energy.simulate_power(seq, seq.active[:3])


def test_decoupled_evaluation_beats_monolithic():
  suite = evalsched.synthetic_suite(20, seed=1)
  models = ["a", "b", "c"]
  costs = evalsched.EvalCosts(devices=4, cpu_workers=8, trial_samples=400)
  mono = evalsched.plan_monolithic(models, suite, costs)
  dec = evalsched.plan_decoupled(models, suite, costs)
  lb = evalsched.lower_bound(models, suite, costs)
  assert lb <= dec.makespan < mono.makespan
  trials = evalsched.trials(models, suite, 400)
  assert sum(n for m, ds, n in trials if m == "a") == sum(ds.samples for ds in suite)
  assert all(n <= 400 for _, _, n in trials) and len(dec.assignments) == len(trials)
  # No device runs two trials at once.
  for d in range(costs.devices):
    spans = sorted((s, e) for dev, _, _, s, e in dec.assignments if dev == d)
    assert all(e1 <= s2 + 1e-9 for (_, e1), (s2, _) in zip(spans, spans[1:]))
  with pytest.raises(ConfigError, match="devices"):
    evalsched.EvalCosts(devices=0)
