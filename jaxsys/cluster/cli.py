"""``jaxsys cluster`` subcommands.

  jaxsys cluster summary [TRACE] [--format auto|alibaba|helios|acme|philly] [--skip-bad]
  jaxsys cluster simulate [TRACE] --policy qssf --estimator blend --nodes 3 --gpus-per-node 8 [--plot out.png]
  jaxsys cluster sweep [TRACE] --policies fifo sjf srtf las qssf --nodes 2 3 4 [--out sweep.json]
  jaxsys cluster ces [NODE_SEQUENCE] --buffer 5 --hold 30 --horizon 10
  jaxsys cluster diagnose LOGFILE [--exit-code N]
  jaxsys cluster supervise --ckpt-dir DIR [--max-restarts 5] [--log PATH] -- CMD ...

TRACE defaults to the bundled Alibaba v2023 GPU trace. Errors (a missing or malformed file, a
bad option value, a command that does not exist) are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxsys.core.errors import ConfigError, JaxsysError

__all__ = ["COMPARE", "compare_table", "main", "make_estimator", "USER_ERRORS"]

# What a user can get wrong: bad values (ConfigError, InputError, TraceError), missing or
# unreadable files. Anything else is a bug and keeps its traceback.
USER_ERRORS = (JaxsysError, OSError)


def _trace(args):
  from jaxsys.cluster.loaders import load_alibaba, load_trace
  on_error = "skip" if getattr(args, "skip_bad", False) else "raise"
  if args.trace is None:
    return load_alibaba(on_error=on_error)
  return load_trace(args.trace, args.format, on_error=on_error)


def make_estimator(name: str, train):
  from jaxsys.cluster import estimators as E
  from jaxsys.cluster.insight import InsightEstimator
  table = {"history": lambda: E.HistoryEstimator(), "gb": lambda: E.GBEstimator(max_iter=100),
           "blend": lambda: E.BlendEstimator(E.HistoryEstimator(), E.GBEstimator(max_iter=100)),
           "insight": lambda: InsightEstimator(), "oracle": lambda: E.OracleEstimator()}
  if name not in table:
    raise ConfigError(f"--estimator {name!r} must be one of {sorted(table)}")
  return table[name]().fit(train)


def _run(args, policy, nodes, estimator_name):
  from jaxsys.cluster.estimators import split_by_time
  from jaxsys.cluster.simulator import ClusterSpec, SimConfig, simulate
  jobs = _trace(args).runnable()
  train, test = split_by_time(jobs, args.train_frac)
  est = make_estimator(estimator_name, train) if policy == "qssf" else None
  cluster = ClusterSpec.uniform(nodes, args.gpus_per_node)
  return simulate(test, cluster, policy, estimator=est,
                  config=SimConfig(placement=args.placement, seed=args.seed))


COMPARE = ("gpu_job_num", "avg_run_time_gpu", "med_run_time_gpu", "avg_que_time_gpu", "avg_gpu_num",
           "complete_rate_gpu", "fail_rate_gpu")


def compare_table(ours: dict) -> str:
  """Markdown table: this trace's statistics beside the Helios clusters'."""
  from jaxsys.cluster.loaders import HELIOS_SUMMARY, data_path
  from jaxsys.cluster.trace import load_helios_summary
  helios = load_helios_summary(data_path(HELIOS_SUMMARY))
  names = ["this trace"] + list(helios)
  lines = ["| statistic | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  for k in COMPARE:
    vals = [ours.get(k)] + [helios[c].get(k) for c in helios]
    lines.append(f"| {k} | " + " | ".join("-" if v is None else f"{v:.3g}" for v in vals) + " |")
  return "\n".join(lines)


def _common(p):
  p.add_argument("trace", nargs="?", default=None)
  p.add_argument("--format", default="auto")
  p.add_argument("--skip-bad", action="store_true", help="skip malformed rows (counted)")
  p.add_argument("--gpus-per-node", type=int, default=8)
  p.add_argument("--placement", default="consolidate", choices=["consolidate", "random"])
  p.add_argument("--train-frac", type=float, default=0.5,
                 help="first fraction of jobs trains the estimators; the rest is simulated")
  p.add_argument("--seed", type=int, default=0)


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one line (``prog: error: ...``) instead of usage + error."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
  """Runs one subcommand; returns the exit status (2 for a user error, printed as one line)."""
  ap = _parser()
  try:
    args = ap.parse_args(argv)
  except SystemExit as e:  # --help (0) or a usage error (2, already printed)
    return e.code if isinstance(e.code, int) else 2
  try:
    return _dispatch(args)
  except USER_ERRORS as e:
    print(f"jaxsys cluster {args.cmd}: error: {_message(e)}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"jaxsys cluster {args.cmd}: interrupted", file=sys.stderr)
    return 130


def _message(e: BaseException) -> str:
  if isinstance(e, OSError) and e.filename is not None and e.strerror:
    return f"{e.strerror}: {e.filename}"
  return " ".join(str(e).split()) or type(e).__name__  # one line


def _parser() -> argparse.ArgumentParser:
  ap = _Parser(prog="jaxsys cluster", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("summary", help="Helios-style statistics of a trace")
  s.add_argument("trace", nargs="?", default=None)
  s.add_argument("--format", default="auto")
  s.add_argument("--skip-bad", action="store_true")
  s.add_argument("--gpu-num", type=int, default=None)
  s.add_argument("--compare", action="store_true",
                 help="print a table beside the published Helios cluster statistics")
  m = sub.add_parser("simulate", help="replay a trace under one policy")
  _common(m)
  m.add_argument("--policy", default="fifo")
  m.add_argument("--estimator", default="blend")
  m.add_argument("--nodes", type=int, default=3)
  m.add_argument("--plot", default=None)
  w = sub.add_parser("sweep", help="policies x cluster sizes")
  _common(w)
  w.add_argument("--policies", nargs="+", default=["fifo", "sjf", "srtf", "las", "qssf"])
  w.add_argument("--estimator", default="blend")
  w.add_argument("--nodes", type=int, nargs="+", default=[3])
  w.add_argument("--out", default=None)
  c = sub.add_parser("ces", help="Cluster Energy Saving on a node sequence")
  c.add_argument("sequence", nargs="?", default=None)
  c.add_argument("--buffer", type=int, default=5)
  c.add_argument("--hold", type=int, default=30)
  c.add_argument("--horizon", type=int, default=10)
  c.add_argument("--train-frac", type=float, default=0.5)
  d = sub.add_parser("diagnose", help="classify a failure log")
  d.add_argument("log")
  d.add_argument("--exit-code", type=int, default=None)
  d.add_argument("--model", default=None, help="local transformers text-classification model")
  v = sub.add_parser("supervise", help="run a command under the fault-tolerant supervisor")
  v.add_argument("--ckpt-dir", required=True)
  v.add_argument("--max-restarts", type=int, default=5)
  v.add_argument("--heartbeat-timeout", type=float, default=60.0,
                 help="seconds without a heartbeat before the job counts as stalled")
  v.add_argument("--startup-timeout", type=float, default=600.0,
                 help="seconds to the first heartbeat of an attempt")
  v.add_argument("--kill-grace", type=float, default=10.0,
                 help="seconds between SIGTERM and SIGKILL when the job is stopped")
  v.add_argument("--workdir", default=None, help="heartbeat file etc. (default: CKPT_DIR/../supervisor)")
  v.add_argument("--log", default=None, help="the job's output (default: WORKDIR/job.log)")
  v.add_argument("command", nargs=argparse.REMAINDER)
  return ap


def _dispatch(args) -> int:
  if args.cmd == "summary":
    trace = _trace(args)
    out = {k: (None if isinstance(v, float) and v != v else v)
           for k, v in trace.summary(gpu_num=args.gpu_num).items()}
    out["skipped_rows"] = trace.skipped
    if args.compare:
      print(compare_table(out))
    else:
      print(json.dumps(out, indent=1, default=str))
  elif args.cmd == "simulate":
    res = _run(args, args.policy, args.nodes, args.estimator)
    print(json.dumps(res.metrics(), indent=1))
    if args.plot:
      from jaxsys.cluster.plots import plot_run
      print(f"plot: {plot_run(res, args.plot)}")
  elif args.cmd == "sweep":
    rows = []
    for n in args.nodes:
      for pol in args.policies:
        met = _run(args, pol, n, args.estimator).metrics()
        rows.append({"nodes": n, "policy": pol, **met})
        print(f"nodes={n} {pol:5s} avg_jct={met['avg_jct']:.0f}s avg_queue={met['avg_queue']:.0f}s "
              f"p99_jct={met['p99_jct']:.0f}s util={met['utilisation']:.3f}", flush=True)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
  elif args.cmd == "ces":
    from jaxsys.cluster.energy import DemandForecaster, load_node_sequence, simulate_power
    seq = load_node_sequence(args.sequence)
    cut = int(len(seq.active) * args.train_frac)
    fc = DemandForecaster(horizon=args.horizon).fit(seq, cut)
    rep = simulate_power(seq, fc.forecast(seq), start=cut, buffer=args.buffer, hold=args.hold)
    print(json.dumps(rep.to_dict(), indent=1))
  elif args.cmd == "diagnose":
    from jaxsys.cluster.diagnosis import ModelDiagnoser, diagnose
    with open(args.log, errors="replace") as f:
      text = f.read()
    model = ModelDiagnoser(args.model) if args.model else None
    print(json.dumps(diagnose(text, args.exit_code, model).__dict__, indent=1))
  elif args.cmd == "supervise":
    from jaxsys.cluster.supervisor import check_command, job_paths, supervise
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
      raise ConfigError("supervise needs a command after --")
    check_command(cmd)
    workdir, log = job_paths(args.ckpt_dir, args.workdir, args.log)
    print(f"job log: {log}", flush=True)
    rep = supervise(cmd, ckpt_dir=args.ckpt_dir, workdir=workdir, log_path=log,
                    max_restarts=args.max_restarts, heartbeat_timeout=args.heartbeat_timeout,
                    startup_timeout=args.startup_timeout, kill_grace=args.kill_grace)
    print(rep.summary())
    return 0 if rep.success else 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
