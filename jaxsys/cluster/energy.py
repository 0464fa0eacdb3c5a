"""Cluster Energy Saving (Helios CES, Hu et al., SC'21, Sec. 5.2).

1. Forecast active-node demand ``h`` minutes ahead with gradient-boosted trees over lag,
   rolling-window and calendar features of the per-minute active-node series.
2. Power policy: target ``min(total, ceil(max(forecast, active now)) + buffer)`` nodes on;
   nodes are woken as soon as the target rises (taking ``wake_latency`` minutes) and powered down
   only after the target stayed below the powered-on count for ``hold`` minutes (no flapping);
   demand above the powered-on nodes waits for a wake-up.
3. Report node-hours powered off, utilisation of powered-on nodes before/after, wake-up events,
   and node-minutes of demand that would have waited for a wake-up.

Usage::

  seq = load_node_sequence()
  fc = DemandForecaster(horizon=10).fit(seq.active[:n_train])
  report = simulate_power(seq, fc.forecast(seq.active), start=n_train, buffer=5, hold=30)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import numpy as np

from jaxsys.cluster.loaders import PHILLY_NODES, data_path
from jaxsys.cluster.trace import RowReader, TraceError, read_csv_rows
from jaxsys.core.errors import ConfigError

__all__ = [
    "DemandForecaster", "features", "LAGS", "load_node_sequence", "NodeSequence", "PowerReport",
    "simulate_power", "WINDOWS",
]


@dataclasses.dataclass
class NodeSequence:
  minutes: np.ndarray   # minutes since the first sample
  active: np.ndarray    # active nodes per minute
  total: np.ndarray     # total nodes per minute
  hour: np.ndarray      # hour of day of each sample
  weekday: np.ndarray   # 0 = Monday


def load_node_sequence(path: str | Path | None = None) -> NodeSequence:
  """``time,active,total`` per minute (Helios/Philly ``*_node_sequence.csv``)."""
  path = Path(path) if path else data_path(PHILLY_NODES)
  header, rows = read_csv_rows(path)
  if not {"time", "active", "total"} <= set(header):
    raise TraceError(f"{path.name}: header {header} must contain time, active, total")
  ts, act, tot = [], [], []
  for i, row in rows:
    r = RowReader(path.name, i, row)
    try:
      ts.append(dt.datetime.fromisoformat(row["time"]))
    except (TypeError, ValueError):
      r.fail("time", "is not an ISO date-time")
    a, t = r.number("active", minimum=0), r.number("total", minimum=0)
    if a > t:
      r.fail("active", f"active {a} exceeds total {t}")
    act.append(a)
    tot.append(t)
  t0 = ts[0]
  minutes = np.array([(t - t0).total_seconds() / 60 for t in ts])
  if np.any(np.diff(minutes) <= 0):
    raise TraceError(f"{path.name}: column 'time' must be strictly increasing")
  return NodeSequence(minutes, np.array(act, float), np.array(tot, float),
                      np.array([t.hour + t.minute / 60 for t in ts]), np.array([t.weekday() for t in ts]))


LAGS = (0, 1, 2, 5, 10, 30, 60, 1440)
WINDOWS = (10, 60, 360)


def features(active: np.ndarray, hour: np.ndarray, weekday: np.ndarray) -> np.ndarray:
  """Per-minute features known at time t: lags, rolling mean/max, hour and weekday."""
  n = len(active)
  cols = []
  for lag in LAGS:
    cols.append(np.concatenate([np.full(lag, active[0]), active[:n - lag]]) if lag else active)
  csum = np.concatenate([[0.0], np.cumsum(active)])
  for w in WINDOWS:
    lo = np.maximum(np.arange(n) - w + 1, 0)
    cols.append((csum[np.arange(n) + 1] - csum[lo]) / (np.arange(n) + 1 - lo))
    # Rolling max via a strided maximum over the window (small windows; numpy only).
    cols.append(np.array([active[max(i - w + 1, 0):i + 1].max() for i in range(n)])
                if w <= 60 else cols[-1])
  cols += [hour, weekday.astype(float), np.sin(2 * np.pi * hour / 24), np.cos(2 * np.pi * hour / 24)]
  return np.stack(cols, axis=1)  # [minutes, features]


class DemandForecaster:
  """Predicts the max active nodes over the next ``horizon`` minutes (HistGradientBoosting
  on the rise above the current level, so the forecast follows level shifts)."""

  def __init__(self, horizon: int = 10, max_iter: int = 100, stride: int = 5, seed: int = 0):
    if horizon <= 0 or stride <= 0:
      raise ConfigError(f"{horizon=} and {stride=} must be positive")
    self.horizon, self.max_iter, self.stride, self.seed = horizon, max_iter, stride, seed
    self.model = None

  def _target(self, active):
    n, h = len(active), self.horizon
    padded = np.concatenate([active, np.full(h, active[-1])])
    return np.max(np.stack([padded[i + 1:i + 1 + n] for i in range(h)]), axis=0)

  def fit(self, seq: NodeSequence, end: int) -> "DemandForecaster":
    from sklearn.ensemble import HistGradientBoostingRegressor
    from jaxsys.cluster.estimators import single_thread
    x = features(seq.active[:end], seq.hour[:end], seq.weekday[:end])
    y = self._target(seq.active[:end])
    idx = np.arange(1440, end - self.horizon, self.stride)  # skip the warm-up day
    if len(idx) < 100:
      raise ConfigError(f"training range end={end} is too short for horizon {self.horizon}")
    self.model = HistGradientBoostingRegressor(max_iter=self.max_iter, random_state=self.seed)
    with single_thread():  # target: rise over the current level (trees cannot extrapolate levels)
      self.model.fit(x[idx], y[idx] - seq.active[:end][idx])
    return self

  def forecast(self, seq: NodeSequence) -> np.ndarray:
    if self.model is None:
      raise ConfigError("DemandForecaster.forecast called before fit")
    from jaxsys.cluster.estimators import single_thread
    with single_thread():
      return seq.active + self.model.predict(features(seq.active, seq.hour, seq.weekday))

  def mae(self, seq: NodeSequence, start: int) -> tuple[float, float]:
    """(model MAE, last-value MAE) of the horizon-max target from ``start`` on."""
    y = self._target(seq.active)[start:-self.horizon]
    pred = self.forecast(seq)[start:-self.horizon]
    return float(np.mean(np.abs(pred - y))), float(np.mean(np.abs(seq.active[start:-self.horizon] - y)))


@dataclasses.dataclass(frozen=True)
class PowerReport:
  minutes: int
  node_hours_off: float
  node_hours_total: float
  util_before: float        # active / total
  util_after: float         # active / powered-on
  wake_events: int
  waited_node_minutes: float  # demand above powered-on nodes while waking, in node-minutes
  waited_events: int           # minutes in which some demand had to wait
  powered: np.ndarray = dataclasses.field(repr=False, default=None)

  @property
  def util_gain(self) -> float:
    return self.util_after - self.util_before

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d.pop("powered")
    d["util_gain"] = self.util_gain
    return d


def simulate_power(seq: NodeSequence, forecast: np.ndarray, *, start: int = 0, end: int | None = None,
                   buffer: int = 5, hold: int = 30, wake_latency: int = 5) -> PowerReport:
  """Replays the power-down policy over minutes [start, end) with per-minute forecasts."""
  if buffer < 0 or hold < 0 or wake_latency < 0:
    raise ConfigError(f"{buffer=}, {hold=}, {wake_latency=} must be >= 0")
  end = len(seq.active) if end is None else end
  if not 0 <= start < end <= len(seq.active):
    raise ConfigError(f"{start=}, {end=} must satisfy 0 <= start < end <= {len(seq.active)}")
  if len(forecast) != len(seq.active):
    raise ConfigError(f"forecast has {len(forecast)} entries for {len(seq.active)} minutes")
  active, total = seq.active[start:end], seq.total[start:end]
  fc = np.asarray(forecast[start:end], float)
  powered = np.empty_like(active)
  on = total[0]
  surplus_since = None
  wake_events = waited_events = 0
  waited = 0.0
  waking = []  # (ready minute, nodes)
  for t in range(len(active)):
    # Nodes whose wake-up finished come online.
    on += sum(n for ready, n in waking if ready == t)
    waking = [(r, n) for r, n in waking if r > t]
    pending = sum(n for _, n in waking)
    if active[t] > on + pending:  # demand above what is on or waking: wake the difference
      need = active[t] - on - pending + buffer
      need = min(need, total[t] - on - pending)
      if need > 0:
        wake_events += 1
        if wake_latency == 0:
          on += need
        else:
          waking.append((t + wake_latency, need))
    if active[t] > on:
      waited += active[t] - on
      waited_events += 1
    target = min(total[t], np.ceil(max(fc[t], active[t])) + buffer)
    pending = sum(n for _, n in waking)
    if target > on + pending:  # forecast rises: wake nodes ahead of the demand
      wake_events += 1
      if wake_latency == 0:
        on = target
      else:
        waking.append((t + wake_latency, target - on - pending))
    if target < on:
      surplus_since = t if surplus_since is None else surplus_since
      if t - surplus_since >= hold:
        on = max(target, active[t])
        surplus_since = None
    else:
      surplus_since = None
    on = min(on, total[t])
    powered[t] = max(on, active[t])  # nodes still running work are never powered down
  off = total - powered
  return PowerReport(minutes=len(active), node_hours_off=float(off.sum() / 60),
                     node_hours_total=float(total.sum() / 60),
                     util_before=float(active.sum() / total.sum()),
                     util_after=float(active.sum() / powered.sum()), wake_events=wake_events,
                     waited_node_minutes=float(waited), waited_events=waited_events, powered=powered)
