"""A concurrency soak for an OpenAI-compatible server: many clients at once, a share of them
abusive, and what the well-formed ones saw.

``soak(url, model, prompts, SoakConfig(...))`` sends ``requests`` requests from ``clients``
concurrent clients (HTTP on one connection pool, ``httpx``). A fraction ``abusive`` of them,
drawn with ``seed``, are one of :data:`ABUSE` (malformed JSON, wrong types, a giant ``n``, lone
surrogates, an unsupported field, a giant ``max_tokens``, a streamed request whose client
disconnects after its first chunk); the rest are well-formed ``/v1/completions`` requests of
``max_tokens`` tokens (``ignore_eos``). It returns the well-formed requests completed, their
latency percentiles, and the status codes each kind of abuse got. Pages leaked and engine
restarts are the server's to report (``ServingEngine.num_free_pages``, ``EngineLoop.alive``);
``experiments/serving.py --parts soak`` checks both, against a clean run of the same
well-formed requests.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time

import numpy as np

from jaxsys.core.errors import ConfigError

__all__ = ["ABUSE", "SoakConfig", "soak"]

#: The kinds of abusive request, each answered by the server without touching the engine (400s)
#: or, for ``disconnect``, with an abort that must free the request's pages.
ABUSE = ("malformed_json", "wrong_types", "giant_n", "surrogates", "unsupported_field",
         "giant_max_tokens", "disconnect")


@dataclasses.dataclass(frozen=True)
class SoakConfig:
  """``clients`` concurrent connections send ``requests`` requests, ``abusive`` of them abusive."""
  clients: int = 64
  requests: int = 256
  abusive: float = 0.2
  max_tokens: int = 8
  seed: int = 0
  timeout: float = 600.0   # seconds one request may take before the client counts it failed

  def __post_init__(self):
    if self.clients < 1 or self.requests < 1 or self.max_tokens < 1:
      raise ConfigError(f"clients={self.clients}, requests={self.requests} and max_tokens="
                        f"{self.max_tokens} must be >= 1")
    if not 0 <= self.abusive < 1:
      raise ConfigError(f"abusive={self.abusive} must be in [0, 1)")


def _schedule(cfg: SoakConfig, n_prompts: int) -> list[tuple[str, int]]:
  """``(kind, prompt index)`` per request: "ok" or an abuse kind, shuffled with the seed. The
  well-formed requests are the first ``requests - n_abusive`` prompts in order, so a clean run
  (``abusive=0``) over the same prompts serves the same well-formed set."""
  rng = np.random.default_rng(cfg.seed)
  n_bad = round(cfg.requests * cfg.abusive)
  n_ok = cfg.requests - n_bad
  if n_ok > n_prompts:
    raise ConfigError(f"{n_ok} well-formed requests need as many prompts, got {n_prompts}")
  jobs = [("ok", i) for i in range(n_ok)] + [(ABUSE[i % len(ABUSE)], i % n_prompts) for i in range(n_bad)]
  rng.shuffle(jobs)
  return jobs


def _abusive_body(kind: str, model: str, prompt, max_tokens: int) -> bytes:
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
  if kind == "malformed_json":
    return json.dumps(body).encode()[:-7]
  if kind == "wrong_types":
    body.update(max_tokens="lots", temperature=[1], stop={"x": 1})
  elif kind == "giant_n":
    body["n"] = 100_000
  elif kind == "surrogates":  # lone surrogates are valid JSON escapes but not text
    return json.dumps({**body, "prompt": "a\ud800b\udfff"}).encode()
  elif kind == "unsupported_field":
    body["tools"] = [{"type": "function", "function": {"name": "f"}}]
  elif kind == "giant_max_tokens":
    body["max_tokens"] = 10**9
  return json.dumps(body).encode()


async def _ok(http, url, model, prompt, cfg) -> float | None:
  """A well-formed request's latency (s), or None if it failed or came back short."""
  t0 = time.perf_counter()
  try:
    r = await http.post(url, json={"model": model, "prompt": prompt, "max_tokens": cfg.max_tokens,
                                   "temperature": 0, "ignore_eos": True}, timeout=cfg.timeout)
  except Exception:  # noqa: BLE001 - any transport failure counts against the server
    return None
  done = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == cfg.max_tokens
  return time.perf_counter() - t0 if done else None


async def _abuse(http, url, model, kind, prompt, cfg) -> str:
  """The status code (or what happened) of one abusive request."""
  try:
    if kind == "disconnect":
      body = {"model": model, "prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
      async with http.stream("POST", url, json=body, timeout=cfg.timeout) as r:
        async for _ in r.aiter_lines():
          break                                   # first chunk, then hang up
      return f"{r.status_code} then disconnected"
    r = await http.post(url, content=_abusive_body(kind, model, prompt, cfg.max_tokens),
                        headers={"content-type": "application/json"}, timeout=cfg.timeout)
    return str(r.status_code)
  except Exception as e:  # noqa: BLE001
    return type(e).__name__


async def _soak(url: str, model: str, prompts: list, cfg: SoakConfig) -> dict:
  import httpx  # noqa: PLC0415  (server extra)
  jobs = asyncio.Queue()
  for job in _schedule(cfg, len(prompts)):
    jobs.put_nowait(job)
  lat, failed, abuse = [], 0, collections.defaultdict(collections.Counter)
  endpoint = url.rstrip("/") + "/v1/completions"
  limits = httpx.Limits(max_connections=cfg.clients, max_keepalive_connections=cfg.clients)

  async def client(http):
    nonlocal failed
    while not jobs.empty():
      kind, i = jobs.get_nowait()
      if kind == "ok":
        t = await _ok(http, endpoint, model, prompts[i], cfg)
        failed += t is None
        lat.extend([] if t is None else [t])
      else:
        abuse[kind][await _abuse(http, endpoint, model, kind, prompts[i], cfg)] += 1

  t0 = time.perf_counter()
  async with httpx.AsyncClient(limits=limits) as http:
    await asyncio.gather(*(client(http) for _ in range(cfg.clients)))
  pct = lambda q: float(np.percentile(lat, q)) if lat else float("nan")  # noqa: E731
  return {"well_formed": len(lat) + failed, "completed": len(lat), "failed": failed,
          "latency_p50": pct(50), "latency_p99": pct(99), "seconds": time.perf_counter() - t0,
          "abuse": {k: dict(v) for k, v in abuse.items()},
          "abuse_5xx": sum(n for v in abuse.values() for code, n in v.items() if code.startswith("5"))}


def soak(url: str, model: str, prompts: list, cfg: SoakConfig | None = None) -> dict:
  """Runs the soak against the server at ``url`` (serving ``model``); ``prompts``: strings or
  token-id lists, one per well-formed request (at least ``requests - abusive share``)."""
  return asyncio.run(_soak(url, model, prompts, cfg or SoakConfig()))
