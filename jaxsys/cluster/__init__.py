"""GPU-datacenter systems (Helios, Acme, SchedMate): traces, a scheduler simulator with FIFO /
SJF / SRTF / LAS / QSSF, duration estimators, Cluster Energy Saving, fault-tolerant training
(supervise + diagnose), decoupled evaluation scheduling and semantic job insight.

This package is the JAX-free simulator layer: it sits beside the JAX layer stack (ops, nn,
models, ...), imports no JAX, Flax or optax (numpy, the standard library and
``jaxsys.core.errors``; matplotlib for its plots), and runs where no accelerator stack is
installed. The one exception is ``demo_job``, the small training job the
fault-tolerance supervisor launches as a child process (``tests/cluster/test_jax_free.py`` checks
both).

Usage::

  from jaxsys import cluster
  trace = cluster.load_alibaba()
  res = cluster.simulate(trace.runnable(), cluster.ClusterSpec.uniform(3, 8), "srtf")
  report = cluster.supervise(cmd, ckpt_dir="/tmp/ck")
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Job": "trace", "Trace": "trace", "TraceError": "trace", "summarize": "trace",
    "validate": "trace", "load_helios_summary": "trace",
    "load_alibaba": "loaders", "load_alibaba_nodes": "loaders", "load_helios": "loaders",
    "load_acme": "loaders", "load_philly": "loaders", "load_trace": "loaders", "data_path": "loaders",
    "ClusterSpec": "simulator", "SimConfig": "simulator", "SimResult": "simulator",
    "simulate": "simulator",
    "make_policy": "policies", "FIFO": "policies", "SJF": "policies", "SRTF": "policies",
    "LAS": "policies", "QSSF": "policies",
    "HistoryEstimator": "estimators", "GBEstimator": "estimators", "BlendEstimator": "estimators",
    "OracleEstimator": "estimators", "split_by_time": "estimators", "estimator_error": "estimators",
    "InsightEstimator": "insight", "job_text": "insight", "hf_embedder": "insight",
    "load_node_sequence": "energy", "DemandForecaster": "energy", "simulate_power": "energy",
    "supervise": "supervisor", "SupervisorReport": "supervisor",
    "diagnose": "diagnosis", "Diagnosis": "diagnosis", "ModelDiagnoser": "diagnosis",
    "FailureInjector": "demo_job", "DemoConfig": "demo_job",
    "plan_monolithic": "evalsched", "plan_decoupled": "evalsched", "synthetic_suite": "evalsched",
    "EvalCosts": "evalsched",
    "plot_run": "plots",
})
