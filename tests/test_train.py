"""Training loop: loss goes down, exact gradient accumulation, checkpoint resume, mesh."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsys.models as M
from jaxsys import train as T
from jaxsys.core.checkpoint import Checkpointer
from jaxsys.core.errors import ConfigError
from jaxsys.data import synthetic as S

CFG = M.DecoderConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2)


def batches(step, batch_size=8):
  return S.training_batch({"copy": 1.0}, seed=0, step=step, batch_size=batch_size, length=24)


def test_loss_decreases_and_model_updated():
  model = M.random_model(CFG, seed=0)
  before = np.asarray(model.layers[0].mlp.up[...]).copy()
  res = T.train(model, batches, T.TrainConfig(learning_rate=3e-3, warmup_steps=2, total_steps=30,
                                             log_every=5), progress=False)
  losses = [r["loss"] for r in res.history]
  assert losses[-1] < losses[0] - 0.3
  assert not np.allclose(np.asarray(model.layers[0].mlp.up[...]), before)


def test_grad_accumulation_is_exact_and_mesh_matches():
  from jaxsys.core import make_mesh
  cfg = T.TrainConfig(learning_rate=1e-3, warmup_steps=0, total_steps=2, log_every=1)
  m1, m2 = M.random_model(CFG, seed=1), M.random_model(CFG, seed=1)
  r1 = T.train(m1, batches, cfg, progress=False)
  r2 = T.train(m2, batches, T.TrainConfig(**{**cfg.__dict__, "accum_steps": 4}), progress=False)
  np.testing.assert_allclose([r["loss"] for r in r1.history], [r["loss"] for r in r2.history], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(m1.layers[0].attn.wq[...]), np.asarray(m2.layers[0].attn.wq[...]),
                             atol=1e-6)
  # the same run with parameters and batches sharded on a (data=2, model=2) mesh
  mesh = make_mesh({"data": 2, "model": 2}, jax.devices()[:4])
  r3 = T.train(M.random_model(CFG, seed=1), batches, cfg, mesh=mesh, progress=False)
  np.testing.assert_allclose([r["loss"] for r in r1.history], [r["loss"] for r in r3.history], rtol=1e-5)


def test_resume_reproduces_loss_curve(tmp_path):
  cfg = T.TrainConfig(learning_rate=3e-3, warmup_steps=2, total_steps=8, log_every=1,
                      checkpoint_every=2)
  full = T.train(M.random_model(CFG, seed=2), batches, cfg, progress=False)
  T.train(M.random_model(CFG, seed=2), batches, cfg, workdir=tmp_path, stop_at=4, progress=False)
  resumed = T.train(M.random_model(CFG, seed=9), batches, cfg, workdir=tmp_path, progress=False)
  assert [r["step"] for r in resumed.history] == [5, 6, 7, 8]
  np.testing.assert_allclose([r["loss"] for r in resumed.history],
                             [r["loss"] for r in full.history[4:]], rtol=1e-6)
  assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 8


def test_loss_mask_and_bad_config():
  model = M.random_model(CFG, seed=4)
  b = {k: jnp.asarray(v) for k, v in batches(0).items()}
  total, count, _ = T.causal_lm_loss(model, b)
  assert float(count) == float(b["loss_mask"][:, 1:].sum())
  with pytest.raises(ConfigError, match="accum_steps"):
    T.TrainConfig(accum_steps=0)
  with pytest.raises(Exception, match="accum_steps"):
    T.train(model, lambda s: batches(s, 6), T.TrainConfig(accum_steps=4, total_steps=1), progress=False)


def test_sgd_optimizer_is_momentum_sgd_with_decoupled_decay():
  """``optimizer="sgd"``: update = -lr(t) * (momentum trace of grad + weight_decay * param)."""
  cfg = T.TrainConfig(optimizer="sgd", learning_rate=0.1, warmup_steps=0, total_steps=1000, b1=0.9,
                      weight_decay=0.5, grad_clip=None, min_lr_ratio=1.0)
  tx = T.make_optimizer(cfg)
  p, g = {"w": jnp.asarray([2.0, -1.0])}, {"w": jnp.asarray([1.0, 3.0])}
  state = tx.init(p)
  want_trace = np.zeros(2)
  for t in range(3):
    lr = 0.0 if t == 0 else 0.1  # a one-step warm-up, then flat (min_lr_ratio=1)
    upd, state = tx.update(g, state, p)
    want_trace = 0.9 * want_trace + (np.asarray(g["w"]) + 0.5 * np.asarray(p["w"]))
    np.testing.assert_allclose(np.asarray(upd["w"]), -lr * want_trace, rtol=1e-6)
    p = {"w": p["w"] + upd["w"]}
  with pytest.raises(ConfigError, match="optimizer='lion' must be one of"):
    T.TrainConfig(optimizer="lion")
  assert "optimizer" in T.MATH_FIELDS  # a resume may not switch optimizers silently


def _tiny_job():
  """tests/_train_job.py: a tiny NNX regression model, its loss and batches (fast to compile)."""
  spec = importlib.util.spec_from_file_location("_train_job", Path(__file__).with_name("_train_job.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _finite(tree):
  return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree)
             if np.issubdtype(np.asarray(x).dtype, np.inexact))


def test_nonfinite_step_stops_the_run_and_is_never_checkpointed(tmp_path):
  job = _tiny_job()
  # lr=1e6 diverges: the loss overflows at step 6. It must stop there, not train on NaN.
  cfg = dataclasses.replace(job.CFG, learning_rate=1e6, total_steps=12, log_every=4,
                            checkpoint_every=2, max_to_keep=2)
  model = job.Tiny()
  with pytest.raises(FloatingPointError, match="non-finite loss or gradient at step 6"):
    T.train(model, job.batches, cfg, workdir=tmp_path, loss_fn=job.loss_fn, progress=False)
  assert _finite(job.params(model))  # left at step 5, the last finite update
  ck = Checkpointer(tmp_path / "checkpoints", max_to_keep=2)
  assert ck.intact_steps() == [2, 4]  # rotation kept the last good ones; 6 was never saved
  p = nnx.to_pure_dict(nnx.state(job.Tiny(), nnx.Param))
  like = {"params": p, "opt_state": T.make_optimizer(cfg).init(p), "step": 0}
  assert all(_finite(ck.restore(s, like=like)) for s in ck.all_steps())
  ck.close()
  # on_nonfinite="skip": NaN batches at steps 4 and 7 are dropped updates, the rest trains on
  skip = dataclasses.replace(job.CFG, total_steps=8, on_nonfinite="skip", checkpoint_every=None)
  bad = lambda s: job.batches(s, nan_at=(3, 6))  # noqa: E731
  res = T.train(m := job.Tiny(), bad, skip, loss_fn=job.loss_fn, progress=False)
  assert res.skipped == 2 and [r["skipped"] for r in res.history] == [0, 0, 0, 1, 1, 1, 2, 2]
  assert _finite(job.params(m))
  at3 = job.params(T.train(job.Tiny(), bad, skip, loss_fn=job.loss_fn, stop_at=3,
                           progress=False).model)
  at4 = job.params(T.train(job.Tiny(), bad, skip, loss_fn=job.loss_fn, stop_at=4,
                           progress=False).model)
  for k in at3:
    np.testing.assert_array_equal(at3[k], at4[k])  # the skipped step changed nothing


def _tiny_run(job, workdir, cfg):
  return lambda c=cfg, model=None, **kw: T.train(
      model or job.Tiny(), job.batches, c, workdir=workdir, loss_fn=job.loss_fn,
      progress=False, **kw)


def test_resume_skips_a_corrupt_checkpoint_and_dedupes_the_log(tmp_path):
  job = _tiny_job()
  cfg = dataclasses.replace(job.CFG, total_steps=8, checkpoint_every=2)
  full = job.params(T.train(job.Tiny(), job.batches, cfg, loss_fn=job.loss_fn,
                            progress=False).model)
  run = _tiny_run(job, tmp_path, cfg)
  run(stop_at=6)
  # bytes overwritten inside the newest checkpoint: resume must use step 4, not this one
  f = max((tmp_path / "checkpoints" / "6").rglob("d/*"), key=lambda p: p.stat().st_size)
  data = bytearray(f.read_bytes())
  data[len(data) // 2:len(data) // 2 + 16] = b"\xff" * 16
  f.write_bytes(bytes(data))
  res = run()
  assert [r["step"] for r in res.history] == [5, 6, 7, 8]
  for k, v in job.params(res.model).items():
    np.testing.assert_array_equal(v, full[k])  # bit for bit through the corrupt checkpoint
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  rows = [json.loads(line)["step"] for line in lines]
  assert rows == list(range(1, 9))  # rows 5, 6 of the first run were dropped, not duplicated


def test_resume_refuses_config_changes_unless_allowed(tmp_path):
  job = _tiny_job()
  cfg = dataclasses.replace(job.CFG, total_steps=8, checkpoint_every=2)
  run = _tiny_run(job, tmp_path, cfg)
  run(stop_at=4)
  with pytest.raises(ConfigError, match="total_steps=3 is smaller than the restored step=4"):
    run(dataclasses.replace(cfg, total_steps=3))
  with pytest.raises(ConfigError, match="learning_rate=0.1 .*checkpoint: 0.05"):
    run(dataclasses.replace(cfg, learning_rate=0.1))
  with pytest.raises(ConfigError, match="accum_steps=2 .*checkpoint: 1"):
    run(dataclasses.replace(cfg, accum_steps=2))
  with pytest.raises(ValueError, match="l1/kernel with shape \\(4, 16\\).*\\(4, 8\\)"):
    run(model=job.Tiny(hidden=8))
  with pytest.raises(ConfigError, match="log_every"):
    run(allow_config_change=("log_every",))
  # an explicitly allowed change trains on (and is what the new checkpoints record)
  longer = dataclasses.replace(cfg, total_steps=10)
  res = run(longer, allow_config_change=("total_steps",))
  assert [r["step"] for r in res.history] == [5, 6, 7, 8, 9, 10]
  assert run(longer).step == 10 and run(longer).history == []
