"""Trace loaders, validation and summary statistics."""

import json

import pytest

from jaxsys.cluster import loaders
from jaxsys.cluster.trace import TraceError, load_helios_summary, summarize, validate


def test_alibaba_bundled_trace_loads():
  trace = loaders.load_alibaba()
  assert len(trace) == 8152 and trace.skipped == {}
  assert len(trace.runnable()) == 6203  # GPU tasks that were scheduled
  assert all(j.duration >= 0 for j in trace)
  assert trace.jobs[0].submit == 0.0
  validate(trace.jobs)
  nodes = loaders.load_alibaba_nodes()
  assert len(nodes) == 1213 and sum(g for _, g, _ in nodes) == 6212


def test_summary_has_helios_columns():
  helios = load_helios_summary(loaders.data_path(loaders.HELIOS_SUMMARY))
  assert set(helios) == {"Venus", "Earth", "Saturn", "Uranus", "total"}
  ours = loaders.load_alibaba().summary(gpu_num=6212)
  missing = set(helios["Venus"]) - set(ours)
  assert not missing, missing
  assert ours["gpu_job_num"] + ours["cpu_job_num"] == ours["job_num"] == 8152
  assert ours["med_gpu_num"] == 1.0


def _write(tmp_path, name, text):
  p = tmp_path / name
  p.write_text(text)
  return p


ALI_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def test_malformed_row_names_row_and_column(tmp_path):
  p = _write(tmp_path, "pods.csv", ALI_HEADER + "p0,1000,10,1,1000,,LS,Running,0,100,5\n"
             "p1,1000,10,one,1000,,LS,Running,0,100,5\n")
  with pytest.raises(TraceError, match=r"pods.csv: row 3 column 'num_gpu': is not a number"):
    loaders.load_alibaba(p)


def test_negative_duration_raises_or_skips_with_count(tmp_path):
  p = _write(tmp_path, "pods.csv", ALI_HEADER + "p0,1000,10,1,1000,,LS,Running,0,100,5\n"
             "p1,1000,10,1,1000,,LS,Running,10,20,50\n" "p2,1000,10,1,1000,,LS,Bogus,0,100,5\n")
  with pytest.raises(TraceError, match="row 3 column 'end': negative duration"):
    loaders.load_alibaba(p)
  trace = loaders.load_alibaba(p, on_error="skip")
  assert [j.id for j in trace] == ["p0"]
  assert sum(trace.skipped.values()) == 2
  assert any("negative duration" in k for k in trace.skipped)


def test_helios_csv_with_datetimes(tmp_path):
  p = _write(tmp_path, "cluster_log.csv",
             "job_id,user,vc,jobname,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue\n"
             "j1,u1,vcA,train_bert_lr1,8,32,1,COMPLETED,2020-04-01 00:00:00,2020-04-01 00:01:00,2020-04-01 01:01:00,3600,60\n"
             "j2,u2,vcB,eval,0,4,1,CANCELLED by 42,2020-04-01 00:00:30,2020-04-01 00:00:30,2020-04-01 00:00:40,10,0\n"
             "j3,u1,vcA,train_bert_lr2,4,16,1,FAILED,2020-04-01 00:02:00,,,0,0\n")
  trace = loaders.load_trace(p)
  j1, j2, j3 = trace.jobs
  assert (j1.gpus, j1.duration, j1.queue, j1.state) == (8, 3600.0, 60.0, "completed")
  assert j2.state == "cancelled" and j2.type == "cpu"
  assert j3.start is None and j3.duration == 0
  s = summarize(trace.jobs)
  assert s["gpu_job_num"] == 2 and s["cancel_rate"] == pytest.approx(1 / 3)


def test_acme_csv(tmp_path):
  p = _write(tmp_path, "trace_seren.csv",
             "job_id,user,node_num,gpu_num,cpu_num,mem_per_pod_GB,shared_mem_per_pod,type,state,submit_time,start_time,end_time,fail_time,stop_time,duration,queue,gpu_time\n"
             "a1,u1,2,16,64,512,64,Pretrain,COMPLETED,100,160,1160,,,1000,60,16000\n"
             "a2,u2,1,1,8,64,8,Evaluation,FAILED,200,200,230,230,,30,0,30\n")
  trace = loaders.load_trace(p)
  assert [j.extra["workload"] for j in trace] == ["Pretrain", "Evaluation"]
  assert trace.jobs[0].nodes == 2 and trace.jobs[0].duration == 1000
  assert trace.jobs[1].state == "failed"


def test_philly_json(tmp_path):
  jobs = [{"status": "Pass", "vc": "vc1", "jobid": "application_1", "user": "u1",
           "submitted_time": "2017-10-03 00:00:00",
           "attempts": [{"start_time": "2017-10-03 00:05:00", "end_time": "2017-10-03 00:10:00",
                         "detail": [{"ip": "m1", "gpus": ["gpu0", "gpu1"]}, {"ip": "m2", "gpus": ["gpu0"]}]}]},
          {"status": "Killed", "vc": "vc2", "jobid": "application_2", "user": "u2",
           "submitted_time": "2017-10-03 00:01:00", "attempts": []}]
  p = _write(tmp_path, "cluster_job_log", json.dumps(jobs))
  trace = loaders.load_philly(p)
  a, b = trace.jobs
  assert (a.gpus, a.nodes, a.duration, a.queue) == (3, 2, 300.0, 300.0)
  assert b.state == "cancelled" and b.start is None
  bad = _write(tmp_path, "bad.json", json.dumps([{"status": "Weird", "jobid": "x", "submitted_time": "0"}]))
  with pytest.raises(TraceError, match="column 'status'"):
    loaders.load_philly(bad)
  assert sum(loaders.load_philly(bad, on_error="skip").skipped.values()) == 1


def test_validate_reports_field():
  trace = loaders.load_alibaba()
  with pytest.raises(TraceError, match="column 'gpus'=8 exceeds"):
    validate(trace.jobs, max_gpus=4)
  with pytest.raises(TraceError, match="duplicates"):
    validate([trace.jobs[0], trace.jobs[0]])


HELIOS_HEADER = "job_id,user,vc,jobname,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time\n"
PHILLY_JOB = {"status": "Pass", "jobid": "application_1", "submitted_time": "2017-10-03 00:00:00",
              "attempts": [{"start_time": "2017-10-03 00:05:00", "end_time": "2017-10-03 00:10:00",
                            "detail": [{"ip": "m1", "gpus": ["gpu0", "gpu1"]}]}]}


def test_utf8_byte_order_mark_is_accepted(tmp_path):
  bom = b"\xef\xbb\xbf"
  p = tmp_path / "pods.csv"
  p.write_bytes(bom + (ALI_HEADER + "p0,1000,10,1,1000,,LS,Running,0,100,5\n").encode())
  assert [j.id for j in loaders.load_trace(p)] == ["p0"]  # 'name' is the first column
  h = tmp_path / "cluster_log.csv"
  h.write_bytes(bom + (HELIOS_HEADER + "j1,u1,vcA,x,8,32,1,COMPLETED,0,60,3660\n").encode())
  assert [j.id for j in loaders.load_trace(h)] == ["j1"]
  j = tmp_path / "cluster_job_log.json"
  j.write_bytes(bom + json.dumps([PHILLY_JOB]).encode())
  assert loaders.load_trace(j).jobs[0].gpus == 2


def test_undecodable_rows_raise_trace_error_or_are_skipped(tmp_path):
  import gzip
  body = (ALI_HEADER + "p0,1000,10,1,1000,,LS,Running,0,100,5\n").encode() + \
      b"p\xff1,1000,10,1,1000,,LS,Running,0,100,5\n" + b"p2,1000,10,1,1000,,LS,Running,0,100,5\n"
  p, gz = tmp_path / "pods.csv", tmp_path / "pods.csv.gz"
  p.write_bytes(body)
  gz.write_bytes(gzip.compress(body))
  for path in (p, gz):
    with pytest.raises(TraceError, match=r"row 3 column 'name': is not valid UTF-8"):
      loaders.load_alibaba(path)
    trace = loaders.load_alibaba(path, on_error="skip")
    assert [j.id for j in trace] == ["p0", "p2"]
    assert trace.skipped == {"column 'name': is not valid UTF-8": 1}
  j = tmp_path / "log.json"
  j.write_bytes(b'[{"status": "Pass", "jobid": "a\xfe", "submitted_time": "0"}, '
                + json.dumps(PHILLY_JOB).encode() + b"]")
  with pytest.raises(TraceError, match="row 0 column 'jobid': is not valid UTF-8"):
    loaders.load_philly(j)
  trace = loaders.load_philly(j, on_error="skip")
  assert len(trace) == 1 and sum(trace.skipped.values()) == 1


def test_philly_fields_of_the_wrong_type_name_the_row(tmp_path):
  bad_attempts = [{"start_time": "1"}, "attempt-1", {}, ["attempt-1"], [{"detail": {"ip": "m1"}}],
                  [{"detail": ["m1"]}], [{"detail": [{"ip": "m1", "gpus": "gpu0"}]}]]
  for k, attempts in enumerate(bad_attempts):
    p = tmp_path / f"log{k}.json"
    p.write_text(json.dumps([PHILLY_JOB, {**PHILLY_JOB, "jobid": "x", "attempts": attempts}]))
    with pytest.raises(TraceError, match=r"row 1 column 'attempts': .*must be a"):
      loaders.load_philly(p)
    trace = loaders.load_philly(p, on_error="skip")
    assert [j.id for j in trace] == ["application_1"] and sum(trace.skipped.values()) == 1, attempts
  p = tmp_path / "rows.json"
  p.write_text(json.dumps([PHILLY_JOB, "application_2", None]))
  with pytest.raises(TraceError, match="row 1: must be a JSON object, got str"):
    loaders.load_philly(p)
  assert loaders.load_philly(p, on_error="skip").skipped == {"must be a JSON object, got str": 1,
                                                             "must be a JSON object, got NoneType": 1}


def test_duplicate_job_ids_raise_or_skip_with_count(tmp_path):
  """A second record with a job's id was accepted silently; it is a TraceError naming both rows,
  or (on_error="skip") skipped and counted."""
  p = _write(tmp_path, "pods.csv", ALI_HEADER + "p0,1000,10,1,1000,,LS,Running,0,100,5\n"
             "p1,1000,10,1,1000,,LS,Running,0,100,5\n" "p0,1000,10,2,1000,,LS,Running,3,90,8\n")
  with pytest.raises(TraceError, match=r"row 4: job id 'p0' duplicates row 2"):
    loaders.load_alibaba(p)
  trace = loaders.load_alibaba(p, on_error="skip")
  assert sorted(j.id for j in trace) == ["p0", "p1"] and sum(trace.skipped.values()) == 1
