"""Duration estimators trained on a chronological split of the real Alibaba trace."""


import numpy as np
import pytest

from jaxsys.cluster import loaders
from jaxsys.cluster.estimators import (BlendEstimator, GBEstimator, HistoryEstimator,
                                       estimator_error, name_template, split_by_time)
from jaxsys.cluster.insight import InsightEstimator, job_text
from jaxsys.cluster.simulator import ClusterSpec, simulate
from jaxsys.cluster.trace import Job


class Median:
  def __init__(self, train):
    self.v = float(np.median([j.duration for j in train]))

  def predict(self, job):
    return self.v


@pytest.fixture(scope="module")
def split():
  jobs = loaders.load_alibaba().runnable()
  train, test = split_by_time(jobs, 0.5)
  return train[-1200:], test[:800]


@pytest.fixture(scope="module")
def baseline(split):
  train, test = split
  return estimator_error(Median(train), test, online=False)


@pytest.fixture(scope="module")
def gb(split):
  return GBEstimator(max_iter=30).fit(split[0])


def test_gb_beats_median_on_real_split(split, baseline, gb):
  train, test = split
  err = estimator_error(gb, test, online=False)
  assert err["n"] == len(test)
  assert err["mae_log"] < baseline["mae_log"]


def test_history_online_and_blend(split, baseline, gb):
  train, test = split
  hist = HistoryEstimator().fit(train)
  err = estimator_error(hist, test, online=True)
  assert err["mae_log"] < baseline["mae_log"]
  blend = BlendEstimator(HistoryEstimator().fit(train), gb)
  assert estimator_error(blend, test)["mae_log"] < baseline["mae_log"]


def test_history_prefers_same_user_and_similar_name():
  def j(i, user, name, d):
    return Job(f"j{i}", user, "vc", name, 1, 1, 1, i, i, i + d, d, "completed", "gpu")
  h = HistoryEstimator().fit([j(0, "a", "bert_lr1", 100), j(1, "a", "bert_lr2", 120),
                              j(2, "b", "bert_lr3", 5000), j(3, "a", "gpt", 9000)])
  assert name_template("bert_lr3") == name_template("bert_lr1")
  pred = h.predict(j(4, "a", "bert_lr9", 0))
  assert 100 <= pred <= 120  # same user, same template, not user b's 5000 s
  assert h.predict(j(5, "c", "gpt", 0)) == pytest.approx(9000, rel=1e-6)  # template fallback


def test_insight_semantic_retrieval_and_qssf():
  # Names and scripts carry the duration signal: resnet jobs are short, llama pretraining long.
  rng = np.random.default_rng(0)
  jobs = []
  for i in range(160):
    kind = ["resnet50_cifar_finetune", "llama7b_pretrain_stage1", "bert_glue_eval"][i % 3]
    dur = {0: 600, 1: 40000, 2: 120}[i % 3] * float(rng.uniform(0.8, 1.25))
    script = {0: "python train.py --model resnet50 --epochs 5", 1: "torchrun pretrain.py --model llama-7b",
              2: "python eval.py --task glue"}[i % 3]
    jobs.append(Job(f"j{i}", f"user{i % 7}", "vc", f"{kind}_{i}", 1, 4, 1, i * 50.0, i * 50.0,
                    i * 50.0 + dur, dur, "completed", "gpu", extra={"script": script}))
  train, test = jobs[:90], jobs[90:]
  assert "resnet50" in job_text(train[0])
  est = InsightEstimator(k=5, refresh=10).fit(train)
  err = estimator_error(est, test)
  base = estimator_error(Median(train), test, online=False)
  assert err["mae_log"] < 0.5 * base["mae_log"]
  assert err["within_2x"] > 0.9
  res_fifo = simulate(test, ClusterSpec((2,)), "fifo")
  res_qssf = simulate(test, ClusterSpec((2,)), "qssf", estimator=InsightEstimator(k=5).fit(train))
  assert res_qssf.jct.mean() < res_fifo.jct.mean()
  assert res_qssf.predictions is not None and np.all(res_qssf.predictions > 0)


def _insight_jobs(n=60):
  rng = np.random.default_rng(1)
  jobs = []
  for i in range(n):
    kind = ["resnet50_cifar_finetune", "llama7b_pretrain_stage1"][i % 2]
    dur = {0: 600, 1: 40000}[i % 2] * float(rng.uniform(0.8, 1.25))
    jobs.append(Job(f"j{i}", f"user{i % 3}", "vc", kind, 1, 4, 1, i * 50.0, i * 50.0,
                    i * 50.0 + dur, dur, "completed", "gpu"))
  return jobs[:40], jobs[40:]


def test_insight_scores_are_cosines_of_the_stored_rows():
  # the dense query against the sparse store gives the sparse x sparse product's similarities
  train, test = _insight_jobs()
  est = InsightEstimator(k=40, min_sim=-1.0).fit(train)
  sims, _ = est.neighbours(test[0])
  full = np.asarray((est.matrix @ est._embed([job_text(test[0])]).T).todense()).ravel()
  np.testing.assert_allclose(np.sort(sims)[::-1], np.sort(full)[::-1][:len(sims)], rtol=1e-12)


def test_insight_with_an_embedder_embeds_each_text_once():
  calls = []

  def embed(texts):  # a bag of hashed tokens: deterministic, dense, 32 dims
    calls.append(len(texts))
    out = np.zeros((len(texts), 32))
    for r, t in enumerate(texts):
      for tok in t.split():
        out[r, sum(map(ord, tok)) % 32] += 1.0
    return out

  train, test = _insight_jobs()
  est = InsightEstimator(k=5, refresh=5, embedder=embed).fit(train)
  assert calls == [len(train)]
  for j in test:  # submit, then finish: one text per job kind and user, embedded once
    assert est.predict(j) > 0
    est.update(j)
  assert sum(calls[1:]) == len({job_text(j) for j in test})
  long_jobs = [j for j in test if j.name.startswith("llama")]
  assert all(est.predict(j) > 10_000 for j in long_jobs)  # retrieves its own kind
