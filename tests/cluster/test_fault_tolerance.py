"""Failure diagnosis on realistic logs, and the supervisor recovering a real JAX training run."""

import sys

import numpy as np
import pytest

from jaxsys.cluster.demo_job import FAILURE_MESSAGES, DemoConfig, FailureInjector, parse_inject, train
from jaxsys.cluster.diagnosis import diagnose
from jaxsys.cluster.supervisor import prune_checkpoints, supervise
from jaxsys.core.errors import ConfigError

LOGS = {
    ("infrastructure", "nccl"): """[E ProcessGroupNCCL.cpp:828] [Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=21807, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800943 milliseconds before timing out.
terminate called after throwing an instance of 'std::runtime_error'""",
    ("infrastructure", "cuda"): """  File "train.py", line 301, in <module>
    loss.backward()
RuntimeError: CUDA error: an illegal memory access was encountered
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.""",
    ("infrastructure", "ecc"): """NVRM: Xid (PCI:0000:3b:00): 48, pid=1742, An uncorrectable double bit error (DBE) has been detected on GPU
RuntimeError: CUDA error: uncorrectable ECC error encountered""",
    ("framework", "oom"): """jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8589934592 bytes.
BufferAssignment OOM Debugging.""",
    ("framework", "oom "): """torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)""",
    ("framework", "dataloader"): """Traceback (most recent call last):
RuntimeError: DataLoader worker (pid 91522) is killed by signal: Killed.""",
    ("script", "import"): """Traceback (most recent call last):
  File "/mnt/job/train.py", line 3, in <module>
    import deepspeed
ModuleNotFoundError: No module named 'deepspeed'""",
    ("script", "syntax"): """  File "/mnt/job/train.py", line 42
    print("epoch", epoch
                       ^
SyntaxError: '(' was never closed""",
    ("script", "type"): """TypeError: LlamaForCausalLM.forward() got an unexpected keyword argument 'labels_mask'""",
    ("script", "key"): """  File "/mnt/job/data.py", line 77, in __getitem__
    return sample["input_ids"]
KeyError: 'input_ids'""",
    ("script", "file"): """FileNotFoundError: [Errno 2] No such file or directory: '/mnt/data/wiki/shard-00017.jsonl'""",
    ("infrastructure", "node"): """srun: error: node-0173: task 0: Exited with exit code 1
slurmstepd: error: *** JOB 441826 ON node-0173 CANCELLED AT 2023-06-02T10:11:12 DUE TO NODE FAILURE ***""",
    ("infrastructure", "node "): """[heartbeat] lost connection to node 10.140.24.17; heartbeat timeout after 600 s""",
}


@pytest.mark.parametrize("expected", list(LOGS), ids=[k[1].strip() + str(i) for i, k in enumerate(LOGS)])
def test_diagnosis_on_realistic_logs(expected):
  d = diagnose("INFO step 100 loss 2.31\nWARNING some noise\n" + LOGS[expected], exit_code=1)
  assert (d.category, d.kind) == (expected[0], expected[1].strip())
  assert d.retryable == (expected[0] == "infrastructure" or d.kind == "dataloader")
  assert d.evidence


def test_diagnosis_fallbacks():
  assert diagnose("", exit_code=137).kind == "killed"
  assert diagnose("all good then silence", exit_code=3).kind == "unknown"
  for kind, msg in FAILURE_MESSAGES.items():  # the injector's own messages classify as injected
    assert diagnose(msg).kind == kind.replace("nccl_timeout", "nccl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  cfg = DemoConfig(ckpt_dir=str(tmp_path_factory.mktemp("ref") / "ck"), steps=24, ckpt_every=4)
  return train(cfg, log=lambda m: None)


def test_supervisor_recovers_bit_for_bit(tmp_path, reference):
  inj = FailureInjector.random(steps=24, n=3, kinds=("nccl", "cuda", "nan", "ecc"), seed=3)
  fn = lambda ctx: train(DemoConfig(ckpt_dir=ctx.ckpt_dir, steps=24, ckpt_every=4),  # noqa: E731
                         heartbeat=ctx.heartbeat, injector=inj, log=ctx.log)
  rep = supervise(fn, ckpt_dir=tmp_path / "ck", heartbeat_timeout=120)
  assert rep.success, rep.summary()
  assert len(rep.failures) == 3
  assert all(a.diagnosis.retryable for a in rep.failures)
  assert {a.diagnosis.kind for a in rep.failures} <= {"nccl", "cuda", "nan_loss", "ecc"}
  for a, nxt in zip(rep.failures, rep.attempts[1:]):
    assert nxt.restored_step % 4 == 0 and nxt.restored_step <= a.last_step
    assert a.lost_steps == a.last_step - nxt.restored_step and a.recovery_s > 0
  for k, v in reference["params"].items():
    np.testing.assert_array_equal(rep.result["params"][k], v)  # bit-for-bit
  assert rep.result["losses"][24] == reference["losses"][24]


def test_supervisor_gives_up_on_script_error(tmp_path):
  inj = FailureInjector({5: "import"})
  fn = lambda ctx: train(DemoConfig(ckpt_dir=ctx.ckpt_dir, steps=10, ckpt_every=4),  # noqa: E731
                         heartbeat=ctx.heartbeat, injector=inj, log=ctx.log)
  rep = supervise(fn, ckpt_dir=tmp_path / "ck", heartbeat_timeout=120)
  assert not rep.success and len(rep.attempts) == 1
  assert rep.attempts[0].diagnosis.kind == "import"
  assert "non-retryable script failure" in rep.reason


def test_supervisor_runs_a_subprocess_command(tmp_path, reference):
  out = tmp_path / "final.npz"
  cmd = [sys.executable, "-m", "jaxsys.cluster.demo_job", "--steps", "24", "--ckpt-every", "4",
         "--inject", "6:nccl,15:nan", "--inject-state", str(tmp_path / "inj"), "--out", str(out)]
  rep = supervise(cmd, ckpt_dir=tmp_path / "ck", heartbeat_timeout=120, poll=0.05)
  assert rep.success, rep.summary() + (tmp_path / "supervisor" / "job.log").read_text()[-2000:]
  kinds = [a.diagnosis.kind for a in rep.failures]
  assert kinds == ["nccl", "nan_loss"]
  assert rep.failures[0].exit_code == 1 and rep.failures[1].detected == "nan"
  final = np.load(out)
  for k, v in reference["params"].items():
    np.testing.assert_array_equal(final[k], v)


def test_injector_and_prune(tmp_path):
  assert parse_inject("3:nccl, 9:nan") == {3: "nccl", 9: "nan"}
  with pytest.raises(ConfigError, match="STEP:KIND"):
    parse_inject("nccl")
  with pytest.raises(ConfigError, match="kind"):
    parse_inject("3:gremlins")
  inj = FailureInjector({3: "nccl"}, tmp_path / "state")
  assert inj.due(3) == "nccl" and inj.due(3) is None
  assert FailureInjector({3: "nccl"}, tmp_path / "state").due(3) is None  # remembered on disk
  for s in (4, 8, 12):
    (tmp_path / "ck" / str(s)).mkdir(parents=True)
  assert prune_checkpoints(tmp_path / "ck", 8) == [12]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, reference, damage):
  ck = tmp_path / "ck"
  train(DemoConfig(ckpt_dir=str(ck), steps=8, ckpt_every=4), log=lambda m: None)
  biggest = max((p for p in (ck / "8").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  data = bytearray(biggest.read_bytes())
  if damage == "flip":
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only a content check sees it
  else:
    del data[len(data) // 2:]  # a half-written file
  biggest.write_bytes(bytes(data))
  fn = lambda ctx: train(DemoConfig(ckpt_dir=ctx.ckpt_dir, steps=24, ckpt_every=4),  # noqa: E731
                         heartbeat=ctx.heartbeat, log=ctx.log)
  rep = supervise(fn, ckpt_dir=ck, heartbeat_timeout=120)
  assert rep.success and len(rep.attempts) == 1, rep.summary()
  assert rep.attempts[0].restored_step == 4
  for k, v in reference["params"].items():
    np.testing.assert_array_equal(rep.result["params"][k], v)  # resumed from step 4, bit for bit
