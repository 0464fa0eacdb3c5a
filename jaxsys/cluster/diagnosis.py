"""Failure diagnosis from a job's log: a rule-based classifier over the Acme failure taxonomy,
with an optional local transformers model (text classification or generation).

Taxonomy (Hu et al., "Characterization of Large Language Model Development in the
Datacenter", NSDI'24): failures are *infrastructure* (NCCL, ECC, CUDA, node/network),
*framework* (out of memory, dataloader, NaN loss, runtime) or *script* (import, syntax, type,
key, file, attribute/name/value errors). Infrastructure failures and transient framework ones
are retryable from the latest checkpoint; OOM and script errors repeat on restart, so the
supervisor gives up on them with a report.

Rules are ordered most specific first (an OOM reported as "CUDA error: out of memory" is OOM,
not CUDA). Only the tail of the log is scanned: the last error is the cause.

Usage::

  from jaxsys.cluster import diagnose
  d = diagnose(open("job.log").read(), exit_code=1)
  d.category, d.kind, d.retryable, d.evidence
"""

from __future__ import annotations

import dataclasses
import re

from jaxsys.core.errors import ConfigError

__all__ = ["diagnose", "diagnose_rules", "Diagnosis", "KINDS", "ModelDiagnoser", "Rule", "rule_for", "RULES"]


@dataclasses.dataclass(frozen=True)
class Rule:
  category: str
  kind: str
  retryable: bool
  pattern: re.Pattern


def _r(category, kind, retryable, *patterns):
  return Rule(category, kind, retryable, re.compile("|".join(patterns), re.IGNORECASE))


RULES: tuple[Rule, ...] = (
    _r("framework", "oom", False, r"RESOURCE_EXHAUSTED", r"out of memory", r"OutOfMemoryError",
       r"OOM when allocating", r"Cannot allocate memory", r"oom-kill"),
    _r("infrastructure", "nccl", True, r"NCCL error", r"nccl(System|Internal|UnhandledCuda|Remote)Error",
       r"Watchdog caught collective operation timeout", r"NCCL (communicator|timeout|WARN .*(fail|error))",
       r"ProcessGroupNCCL.*(timeout|error)"),
    _r("infrastructure", "ecc", True, r"ECC error", r"uncorrectable ECC", r"\bXid\b.*\b(48|63|64|74|79)\b",
       r"double[- ]bit ECC"),
    _r("infrastructure", "cuda", True, r"CUDA error", r"illegal memory access", r"CUDA_ERROR_\w+",
       r"cudaError\w*", r"CUBLAS_STATUS_EXECUTION_FAILED", r"GPU has fallen off the bus",
       r"unspecified launch failure"),
    _r("infrastructure", "node", True, r"NODE[ _]FAIL", r"node (failure|lost|down|unreachable)",
       r"heartbeat (lost|timeout|timed out|stalled|missed)", r"Connection reset by peer",
       r"No route to host", r"lost connection to (node|host|worker)", r"stalled heartbeat"),
    _r("framework", "dataloader", True, r"DataLoader worker .*(killed|exited unexpectedly)",
       r"dataloader.*(timed out|timeout)", r"insufficient shared memory", r"Bus error.*shm"),
    _r("framework", "nan_loss", True, r"\bNaN loss\b", r"loss (is|became) nan", r"FloatingPointError",
       r"non-finite loss"),
    _r("script", "import", False, r"ModuleNotFoundError", r"ImportError", r"No module named"),
    _r("script", "syntax", False, r"SyntaxError", r"IndentationError", r"TabError"),
    _r("script", "type", False, r"\bTypeError\b"),
    _r("script", "key", False, r"\bKeyError\b"),
    _r("script", "file", False, r"FileNotFoundError", r"No such file or directory", r"IsADirectoryError"),
    _r("script", "attribute", False, r"\bAttributeError\b", r"\bNameError\b", r"\bValueError\b",
       r"\bIndexError\b", r"\bAssertionError\b"),
    _r("framework", "runtime", False, r"XlaRuntimeError", r"\bRuntimeError\b", r"Segmentation fault",
       r"core dumped", r"INTERNAL:"),
)
KINDS = tuple(r.kind for r in RULES) + ("killed", "unknown")


@dataclasses.dataclass(frozen=True)
class Diagnosis:
  category: str   # infrastructure | framework | script | unknown
  kind: str       # one of KINDS
  retryable: bool
  evidence: str   # the log line that decided it
  source: str = "rules"  # rules | model | exit_code


def rule_for(kind: str) -> Rule | None:
  return next((r for r in RULES if r.kind == kind), None)


def diagnose_rules(log: str, exit_code: int | None = None, tail_lines: int = 80) -> Diagnosis:
  """The first rule (in priority order) matching a line of the log's last ``tail_lines``."""
  lines = [ln for ln in (log or "").splitlines()[-tail_lines:] if ln.strip()]
  for rule in RULES:
    for ln in reversed(lines):
      if rule.pattern.search(ln):
        return Diagnosis(rule.category, rule.kind, rule.retryable, ln.strip()[:300])
  if exit_code is not None and exit_code in (-9, 137, -15, 143):
    # Killed from outside without a message: the node (or its agent) went away.
    return Diagnosis("infrastructure", "killed", True, f"exit code {exit_code}", "exit_code")
  return Diagnosis("unknown", "unknown", True, lines[-1].strip()[:300] if lines else "", "rules")


class ModelDiagnoser:
  """A local transformers model (no download): ``mode="classify"`` expects a sequence
  classifier whose ``id2label`` names failure kinds; ``mode="generate"`` prompts a causal LM
  with the kinds and reads the first kind named in its answer."""

  def __init__(self, path: str, mode: str = "classify", max_chars: int = 2000):
    if mode not in ("classify", "generate"):
      raise ConfigError(f"{mode=} must be 'classify' or 'generate'")
    from transformers import pipeline
    task = "text-classification" if mode == "classify" else "text-generation"
    self.pipe = pipeline(task, model=path, tokenizer=path, device=-1)
    self.mode, self.max_chars = mode, max_chars

  def kind(self, log: str) -> str:
    text = (log or "")[-self.max_chars:]
    if self.mode == "classify":
      label = str(self.pipe(text, truncation=True)[0]["label"]).lower()
    else:
      prompt = (f"Classify this training failure log as one of: {', '.join(KINDS)}.\n"
                f"Log:\n{text}\nAnswer:")
      label = self.pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"][len(prompt):].lower()
    return next((k for k in KINDS if k in label), "unknown")

  def __call__(self, log: str) -> Diagnosis:
    kind = self.kind(log)
    rule = rule_for(kind)
    if rule is None:
      return Diagnosis("infrastructure" if kind == "killed" else "unknown", kind, True, "", "model")
    return Diagnosis(rule.category, kind, rule.retryable, "", "model")


def diagnose(log: str, exit_code: int | None = None, model: ModelDiagnoser | None = None,
             prefer: str = "rules") -> Diagnosis:
  """Rules first; the model (when given) decides what the rules call unknown, or everything
  with ``prefer="model"``."""
  if prefer not in ("rules", "model"):
    raise ConfigError(f"{prefer=} must be 'rules' or 'model'")
  d = diagnose_rules(log, exit_code)
  if model is not None and (prefer == "model" or d.kind == "unknown"):
    return model(log)
  return d
