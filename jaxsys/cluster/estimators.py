"""Job-duration estimators for QSSF: history-based, gradient-boosted, and their blend.

All estimators share one interface: ``fit(jobs)`` on finished jobs (a training split),
``predict(job) -> seconds`` at submission, and ``update(job)`` when a job finishes during a
simulation (online learning; nothing from the future is used).

* ``HistoryEstimator`` (Helios, Sec. 5): a job's duration is predicted from the same user's
  recent jobs with the same (or a similar, digits-stripped) name; fall back to the user's
  jobs, then the name template across users, then the global median. Predictions are the
  geometric mean of the last ``window`` matching durations (durations are log-normal-ish).
* ``GBEstimator``: scikit-learn ``HistGradientBoostingRegressor`` on log(duration) with job
  features (GPUs, CPUs, nodes, memory, GPU share, VC / user / name template as categories,
  hour and weekday of submission).
* ``BlendEstimator``: log-space mix, weighting history by how many matches it had: w = n/(n+k).
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Sequence

import numpy as np

from jaxsys.cluster.trace import Job
from jaxsys.core.errors import ConfigError, InputError

__all__ = [
    "BlendEstimator", "estimator_error", "GBEstimator", "HistoryEstimator", "name_template",
    "OracleEstimator", "single_thread", "split_by_time",
]

_DIGITS = re.compile(r"[0-9]+")


def name_template(name: str) -> str:
  """Name with digit runs replaced, so 'run_lr0.1_seed3' ~ 'run_lr0.2_seed4'."""
  return _DIGITS.sub("#", name.strip().lower())


def _log(d: float) -> float:
  return math.log1p(max(d, 0.0))


def single_thread():
  """Limits OpenMP/BLAS to one thread: on a shared, oversubscribed CPU the default thread
  pool of gradient boosting spins and runs orders of magnitude slower."""
  from threadpoolctl import threadpool_limits
  return threadpool_limits(limits=1)


def _finished(jobs: Sequence[Job]) -> list[Job]:
  return [j for j in jobs if j.start is not None]


class HistoryEstimator:
  def __init__(self, window: int = 8, default: float | None = None):
    if window <= 0:
      raise ConfigError(f"{window=} must be positive")
    self.window = window
    self.default = default
    self.tables = [collections.defaultdict(lambda: collections.deque(maxlen=window))
                   for _ in range(4)]  # (user, name), (user, template), user, template
    self.all_logs: list[float] = []

  def _keys(self, job: Job):
    tpl = name_template(job.name)
    return ((job.user, job.name), (job.user, tpl), job.user, tpl)

  def fit(self, jobs: Sequence[Job]) -> "HistoryEstimator":
    for j in sorted(_finished(jobs), key=lambda j: j.submit):
      self.update(j)
    return self

  def update(self, job: Job):
    v = _log(job.duration)
    for table, key in zip(self.tables, self._keys(job)):
      table[key].append(v)
    self.all_logs.append(v)

  def matches(self, job: Job) -> tuple[int, float | None]:
    """(number of history entries used, predicted log-duration) from the most specific key."""
    for table, key in zip(self.tables, self._keys(job)):
      hist = table.get(key)
      if hist:
        return len(hist), float(np.mean(hist))
    return 0, None

  def predict(self, job: Job) -> float:
    n, v = self.matches(job)
    if v is None:
      if self.default is not None:
        return self.default
      v = float(np.median(self.all_logs)) if self.all_logs else _log(3600.0)
    return math.expm1(v)


_CATS = ("vc", "user", "template", "qos")


def _features(job: Job, codes: dict[str, dict[str, int]]) -> list[float]:
  ex = job.extra or {}
  cat = {"vc": job.vc, "user": job.user, "template": name_template(job.name),
         "qos": str(ex.get("qos", ""))}
  day = job.submit / 86400.0
  return ([float(job.gpus), float(job.cpus), float(job.nodes), float(ex.get("memory_mib", 0.0)),
           float(ex.get("gpu_milli", 0.0)), (day % 1.0) * 24.0, float(int(day) % 7)]
          + [float(codes[c].get(cat[c], -1)) for c in _CATS])


class GBEstimator:
  """Gradient-boosted trees on job features (``HistGradientBoostingRegressor``, log target)."""

  def __init__(self, max_iter: int = 200, learning_rate: float = 0.1, max_leaf_nodes: int = 31,
               seed: int = 0, min_count: int = 2):
    self.params = dict(max_iter=max_iter, learning_rate=learning_rate, max_leaf_nodes=max_leaf_nodes,
                       random_state=seed)
    self.min_count = min_count
    self.model = None
    self.codes: dict[str, dict[str, int]] = {}
    self.cache: dict[str, float] = {}

  def fit(self, jobs: Sequence[Job]) -> "GBEstimator":
    from sklearn.ensemble import HistGradientBoostingRegressor
    jobs = _finished(jobs)
    if len(jobs) < 10:
      raise InputError(f"GBEstimator.fit needs >= 10 finished jobs, got {len(jobs)}")
    for c in _CATS:  # category codes; rare values share the "unknown" code -1
      values = collections.Counter(
          {"vc": j.vc, "user": j.user, "template": name_template(j.name),
           "qos": str((j.extra or {}).get("qos", ""))}[c] for j in jobs)
      frequent = sorted(v for v, n in values.items() if n >= self.min_count)
      self.codes[c] = {v: i for i, v in enumerate(frequent[:250])}
    x = np.array([_features(j, self.codes) for j in jobs])
    y = np.array([_log(j.duration) for j in jobs])
    ncat = len(_CATS)
    cat_mask = [False] * (x.shape[1] - ncat) + [True] * ncat
    x[:, -ncat:] = np.where(x[:, -ncat:] < 0, np.nan, x[:, -ncat:])
    self.model = HistGradientBoostingRegressor(categorical_features=cat_mask, **self.params)
    with single_thread():
      self.model.fit(x, y)
    return self

  def _x(self, jobs: Sequence[Job]) -> np.ndarray:
    x = np.array([_features(j, self.codes) for j in jobs])
    ncat = len(_CATS)
    x[:, -ncat:] = np.where(x[:, -ncat:] < 0, np.nan, x[:, -ncat:])
    return x

  def precompute(self, jobs: Sequence[Job]):
    """Batch-predicts ``jobs`` (features depend only on the job, so this is not lookahead)."""
    if jobs:
      self.cache.update(zip((j.id for j in jobs), self.predict_log(jobs, use_cache=False)))

  def predict_log(self, jobs: Sequence[Job], use_cache: bool = True) -> np.ndarray:
    if self.model is None:
      raise ConfigError("GBEstimator.predict called before fit")
    if use_cache and all(j.id in self.cache for j in jobs):
      return np.array([self.cache[j.id] for j in jobs])
    with single_thread():
      return self.model.predict(self._x(jobs))

  def predict(self, job: Job) -> float:
    return float(math.expm1(self.predict_log([job])[0]))

  def update(self, job: Job):
    """Trees are trained offline; online updates are left to the history side of a blend."""


class BlendEstimator:
  """exp(w * log hist + (1 - w) * log gb) with w = n / (n + k), n = history matches."""

  def __init__(self, history: HistoryEstimator, gb: GBEstimator, k: float = 2.0):
    if k <= 0:
      raise ConfigError(f"{k=} must be positive")
    self.history, self.gb, self.k = history, gb, k

  def fit(self, jobs: Sequence[Job]) -> "BlendEstimator":
    self.history.fit(jobs)
    self.gb.fit(jobs)
    return self

  def predict(self, job: Job) -> float:
    n, v = self.history.matches(job)
    g = float(self.gb.predict_log([job])[0])
    if v is None:
      return math.expm1(g)
    w = n / (n + self.k)
    return math.expm1(w * v + (1 - w) * g)

  def update(self, job: Job):
    self.history.update(job)

  def precompute(self, jobs: Sequence[Job]):
    self.gb.precompute(jobs)


class OracleEstimator:
  """The true duration (QSSF with it is the oracle shortest-service-first)."""

  def fit(self, jobs):
    return self

  def predict(self, job: Job) -> float:
    return job.duration


def split_by_time(jobs: Sequence[Job], train_frac: float = 0.5) -> tuple[list[Job], list[Job]]:
  """Chronological split: the first ``train_frac`` of jobs (by submit) train, the rest test."""
  if not 0 < train_frac < 1:
    raise ConfigError(f"{train_frac=} must be in (0, 1)")
  jobs = sorted(jobs, key=lambda j: (j.submit, j.id))
  cut = int(len(jobs) * train_frac)
  return jobs[:cut], jobs[cut:]


def estimator_error(estimator, jobs: Sequence[Job], online: bool = True) -> dict[str, float]:
  """Errors on ``jobs`` in submit order (updating online after each job when ``online``).

  Returns mean absolute error of log durations (``mae_log``), median absolute percentage
  error and the fraction of predictions within a factor of 2.
  """
  pred, true = [], []
  jobs = sorted(_finished(jobs), key=lambda j: j.submit)
  if hasattr(estimator, "precompute"):
    estimator.precompute(jobs)  # batch the job-only features (no future information)
  for j in jobs:
    pred.append(max(estimator.predict(j), 0.0))
    true.append(j.duration)
    if online and hasattr(estimator, "update"):
      estimator.update(j)
  p, t = np.array(pred), np.array(true)
  lp, lt = np.log1p(p), np.log1p(t)
  ape = np.abs(p - t) / np.maximum(t, 1.0)
  return {"n": len(t), "mae_log": float(np.mean(np.abs(lp - lt))), "mdape": float(np.median(ape)),
          "within_2x": float(np.mean(np.abs(lp - lt) <= math.log(2.0)))}
