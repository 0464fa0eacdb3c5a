"""Semantic job insight (SchedMate): text features from job names, scripts and logs retrieve
similar past jobs, whose durations predict a new job's duration.

A job becomes a short document: its name split into tokens, user, VC, requested resources, and
any ``extra["script"]`` / ``extra["log"]`` text. Documents are embedded with TF-IDF (word and
character n-grams; scikit-learn) or with a local embedding model (``hf_embedder(path)``: mean-
pooled hidden states of a transformers encoder; nothing is downloaded). Prediction is the
similarity-weighted mean log-duration of the ``k`` most similar finished jobs (cosine), with a
fallback to the median. ``InsightEstimator`` has the estimator interface (fit / predict /
update) and plugs into QSSF.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import numpy as np

from jaxsys.cluster.trace import Job
from jaxsys.core.errors import ConfigError, InputError

__all__ = ["hf_embedder", "InsightEstimator", "job_text"]

_SPLIT = re.compile(r"[^0-9A-Za-z]+")


def job_text(job: Job) -> str:
  """The job as a document: name tokens, user, vc, resources, script and log snippets."""
  ex = job.extra or {}
  parts = [" ".join(t for t in _SPLIT.split(job.name) if t), f"user_{job.user}", f"vc_{job.vc}",
           f"gpus_{job.gpus}", f"nodes_{job.nodes}", f"cpus_{int(job.cpus)}"]
  if "qos" in ex:
    parts.append(f"qos_{ex['qos']}")
  if ex.get("gpu_milli"):
    parts.append(f"gpushare_{int(ex['gpu_milli'])}")
  for key in ("script", "log", "workload"):
    if ex.get(key):
      parts.append(str(ex[key])[-2000:])
  return " ".join(parts)


def hf_embedder(path: str, max_length: int = 128, batch: int = 32) -> Callable[[list[str]], np.ndarray]:
  """Mean-pooled last hidden states of a local transformers encoder (no download)."""
  import torch
  from transformers import AutoModel, AutoTokenizer
  tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
  model = AutoModel.from_pretrained(path, local_files_only=True).eval()

  def embed(texts: list[str]) -> np.ndarray:
    outs = []
    with torch.no_grad():
      for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], padding=True, truncation=True, max_length=max_length,
                  return_tensors="pt")
        h = model(**enc).last_hidden_state  # [batch, seq, hidden]
        m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
        outs.append(((h * m).sum(1) / m.sum(1).clamp(min=1)).numpy())
    return np.concatenate(outs)
  return embed


class InsightEstimator:
  """k-nearest finished jobs by text similarity; similarity-weighted mean log duration."""

  def __init__(self, k: int = 10, min_sim: float = 0.2, refresh: int = 50,
               embedder: Callable[[list[str]], np.ndarray] | None = None):
    if k <= 0 or refresh <= 0:
      raise ConfigError(f"{k=} and {refresh=} must be positive")
    self.k, self.min_sim, self.refresh, self.embedder = k, min_sim, refresh, embedder
    self.vectorizer = None
    self.rows, self.logs = [], []
    self.matrix, self.matrix_logs = None, None
    self.pending = 0
    self._memo = {}  # text -> its embedded row: a job is embedded at submit and again at finish

  def _embed(self, texts: list[str]):
    if self.embedder is not None:
      e = np.asarray(self.embedder(texts), dtype=np.float64)
      return e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    return self.vectorizer.transform(texts)  # rows are L2-normalised

  def _embed_one(self, job: Job):
    """``job``'s row (1 x features), memoised by text: traces repeat names, users and resources,
    and scikit-learn's per-call overhead (~2 ms) dominated the simulator's QSSF replays."""
    text = job_text(job)
    row = self._memo.get(text)
    if row is None:
      row = self._memo[text] = self._embed([text])
    return row

  def fit(self, jobs: Sequence[Job]) -> "InsightEstimator":
    jobs = [j for j in jobs if j.start is not None]
    if not jobs:
      raise InputError("InsightEstimator.fit needs finished jobs")
    texts = [job_text(j) for j in jobs]
    if self.embedder is None:
      from sklearn.feature_extraction.text import TfidfVectorizer
      self.vectorizer = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True,
                                        min_df=1)
      self.vectorizer.fit(texts)
    self._memo = {}
    self.rows = [self._embed(texts)]
    self.logs = [math.log1p(j.duration) for j in jobs]
    self._rebuild()
    return self

  def _rebuild(self):
    import scipy.sparse as sp
    mats = self.rows
    self.matrix = sp.vstack(mats).tocsr() if sp.issparse(mats[0]) else np.vstack(mats)
    self.rows = [self.matrix]
    self.matrix_logs = np.array(self.logs)
    self.pending = 0

  def neighbours(self, job: Job) -> tuple[np.ndarray, np.ndarray]:
    """(similarities, log durations) of the k most similar stored jobs above ``min_sim``."""
    if self.matrix is None:
      raise ConfigError("InsightEstimator used before fit")
    q = self._embed_one(job)
    # a dense query vector: sparse x dense is one pass over the stored rows (csr_matvec), where
    # sparse x sparse also sized and built a sparse result per query
    q = np.asarray(q.toarray() if hasattr(q, "toarray") else q).ravel()
    sims = np.asarray(self.matrix @ q).ravel()  # [stored jobs] cosine similarities
    top = np.argsort(-sims)[:self.k]
    top = top[sims[top] >= self.min_sim]
    return sims[top], self.matrix_logs[top]

  def predict(self, job: Job) -> float:
    sims, logs = self.neighbours(job)
    if len(sims) == 0:
      return math.expm1(float(np.median(self.matrix_logs)))
    return math.expm1(float(np.sum(sims * logs) / np.sum(sims)))

  def update(self, job: Job):
    """Adds a finished job (visible to predictions after every ``refresh`` updates)."""
    self.rows.append(self._embed_one(job))
    self.logs.append(math.log1p(job.duration))
    self.pending += 1
    if self.pending >= self.refresh:
      self._rebuild()
