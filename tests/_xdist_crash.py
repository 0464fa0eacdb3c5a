"""pytest-xdist hooks: a test whose worker process dies is rerun once, on a fresh worker.

Why: XLA:CPU's compiler has segfaulted inside a worker about once in three full runs of this
suite, each time in a different speculative-decoding test and never when that test ran again. A
dead worker fails its test, and under ``--dist loadgroup`` the replacement worker can also hang
the whole run (pytest-xdist #1323, #1378), so one crash in a compiler the project does not own
cost a CI run its 90 minutes. With these hooks:

- only a *crash* is retried (the worker's process died: a segfault, an abort, or pytest's
  ``faulthandler_exit_on_timeout`` ending a hung test); an ordinary failure fails at once;
- a test is retried ``CRASH_RERUNS`` times; a test that crashes again fails, with xdist's own
  message naming the worker and the test;
- every retry is listed at the end of the run ("crashed and rerun"), so it is never silent.

It needs a scheduler that can put one test back in the queue: ``--dist load`` or ``worksteal``
(``loadscope``/``loadgroup`` cannot). This module imports neither jax nor the project, so that
tests/test_xdist_crash.py can load it into a bare pytest run.
"""

from __future__ import annotations

import pytest

CRASH_RERUNS = 1

_crashes: dict[str, int] = {}  # nodeid -> crashes so far (the controller process keeps it)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  n = _crashes[crashitem] = _crashes.get(crashitem, 0) + 1
  if n > CRASH_RERUNS:
    return  # stays "failed"
  try:
    sched.mark_test_pending(crashitem)
  except NotImplementedError:  # loadscope/loadgroup: cannot reschedule one test
    report.longrepr = f"{report.longrepr} (not rerun: run with --dist load or worksteal)"
    return
  report.outcome = "rerun"
  report.longrepr = f"{report.longrepr}; rerun on a fresh worker ({n}/{CRASH_RERUNS})"


def pytest_report_teststatus(report):
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None


def pytest_terminal_summary(terminalreporter):
  reruns = terminalreporter.stats.get("rerun", [])
  if reruns:
    terminalreporter.section("crashed and rerun", sep="=", yellow=True)
    for rep in reruns:
      terminalreporter.line(str(rep.longrepr))
