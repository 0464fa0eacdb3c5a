"""The server's routes beside completions: API-key auth, ``/version``, ``/tokenize``, ``/detokenize``,
``/v1/embeddings`` and Prometheus ``/metrics`` (:func:`add_routes`, called by ``build_app``).

* **Auth.** With an API key (``jaxsys serve --api-key KEY`` or ``$JAXSYS_API_KEY``) every ``/v1``
  route needs ``Authorization: Bearer KEY``; without it, 401 in OpenAI's error shape. ``/health``,
  ``/version``, ``/metrics``, ``/tokenize`` and ``/detokenize`` stay open, as in vLLM.
* ``GET /version``: ``{"version": "<jaxsys version>"}``.
* ``POST /tokenize``: ``{"model", "prompt": str}`` or ``{"model", "messages": [...],
  "add_generation_prompt": true}`` (the chat template) -> ``{"tokens", "count", "max_model_len"}``;
  ``add_special_tokens`` (default true) applies to a prompt.
* ``POST /detokenize``: ``{"model", "tokens": [ids]}`` -> ``{"prompt": text}``.
* ``POST /v1/embeddings``: ``input`` a string, a list of strings, a list of token ids or a list of
  such lists; each embedding is the input's **final hidden states (after the final norm) averaged
  over its tokens** (:func:`jaxsys.serving.generation.embed`), not a trained sentence-embedding
  head. ``encoding_format`` ``"float"`` or ``"base64"`` (little-endian float32, what the ``openai``
  client asks for by default); ``dimensions`` only at the model's hidden size; ``user`` passes.
  Embeddings run in a worker thread beside the engine thread, one request at a time.
* ``GET /metrics``: Prometheus text format from ``prometheus-client`` (one registry per app):
  ``jaxsys_requests_total{endpoint,status}``, ``jaxsys_prompt_tokens_total``,
  ``jaxsys_generation_tokens_total``, histograms ``jaxsys_time_to_first_token_seconds`` and
  ``jaxsys_inter_token_latency_seconds``, and gauges read from the engine at scrape time:
  ``jaxsys_kv_pages_used``, ``jaxsys_kv_pages_free``, ``jaxsys_requests_waiting``,
  ``jaxsys_requests_running``, and the counter ``jaxsys_preemptions_total``.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations (``Request``) at runtime.

import asyncio
import base64
import hmac
import json
import time

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.serving.openai_protocol import APIError, bad_request, chat_messages, read_body

__all__ = ["ServerMetrics", "add_routes"]

# Seconds: TTFT spans a queue wait and a prefill; ITL one decode step (ms on a GPU, 0.1 s+ on CPU).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}


class ServerMetrics:
  """The server's Prometheus metrics (module docstring) in a registry of their own, so that several
  servers in one process (tests) do not collide."""

  def __init__(self, engine):
    from prometheus_client import CollectorRegistry, Counter, Histogram  # noqa: PLC0415  (serve extra)
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("jaxsys_requests", "HTTP requests by endpoint and status code",
                            ["endpoint", "status"], registry=r)
    self.prompt_tokens = Counter("jaxsys_prompt_tokens", "prompt tokens of finished requests", registry=r)
    self.generation_tokens = Counter("jaxsys_generation_tokens", "generated tokens", registry=r)
    self.ttft = Histogram("jaxsys_time_to_first_token_seconds", "arrival to first generated token",
                          buckets=_TTFT_BUCKETS, registry=r)
    self.itl = Histogram("jaxsys_inter_token_latency_seconds", "time between a sequence's tokens",
                         buckets=_ITL_BUCKETS, registry=r)

    class _EngineState:  # gauges read at scrape time (the engine thread owns the numbers)
      def collect(self):
        s, c = engine.scheduler, engine.config
        free = engine.num_free_pages
        for name, doc, value in (
            ("jaxsys_kv_pages_used", "KV-cache pages held by sequences", c.num_pages - free),
            ("jaxsys_kv_pages_free", "KV-cache pages a new sequence could take", free),
            ("jaxsys_requests_waiting", "sequences queued for admission", len(s.waiting)),
            ("jaxsys_requests_running", "sequences holding pages", len(s.running))):
          yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("jaxsys_preemptions", "sequences preempted so far (pool out of pages)",
                                  value=s.stats["preemptions"])

    r.register(_EngineState())

  def tracker(self, t0: float) -> "_Tracker":
    """Per-request timing from its arrival ``t0`` (``time.perf_counter``)."""
    return _Tracker(self, t0)

  def render(self) -> bytes:
    from prometheus_client import generate_latest  # noqa: PLC0415
    return generate_latest(self.registry)


class _Tracker:
  """Observes one request's outputs: TTFT at its first token, ITL per later token of each choice,
  the token counts when it ends."""

  def __init__(self, metrics: ServerMetrics, t0: float):
    self.m, self.t0, self.last, self.first = metrics, t0, {}, True

  def output(self, item) -> None:
    now = time.perf_counter()
    if self.first:
      self.m.ttft.observe(now - self.t0)
      self.first = False
    elif item.index in self.last:
      self.m.itl.observe(now - self.last[item.index])
    self.last[item.index] = now
    self.m.generation_tokens.inc(len(item.new_token_ids))

  def done(self, prompt_tokens: int) -> None:
    self.m.prompt_tokens.inc(prompt_tokens)


def add_routes(app, loop, model_name: str, tokenizer, metrics: ServerMetrics | None, api_key: str | None):
  """Adds the module docstring's middleware and routes to the FastAPI ``app`` serving ``loop.engine``."""
  from fastapi import Request  # noqa: PLC0415  (serve extra)
  from fastapi.responses import Response  # noqa: PLC0415
  import jaxsys  # noqa: PLC0415
  engine = loop.engine
  lock = asyncio.Lock()  # one embedding batch at a time beside the engine thread

  app.add_middleware(_AuthAndCount, api_key=api_key, metrics=metrics)

  def _need_tokenizer(param: str):
    if tokenizer is None:
      raise APIError(400, "this model has no tokenizer", param)

  @app.get("/version")
  async def version():
    return {"version": jaxsys.__version__}

  @app.post("/tokenize")
  async def tokenize(request: Request):
    body = await read_body(request, model_name)
    _only(body, {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"}, "/tokenize")
    if ("prompt" in body) == ("messages" in body):
      raise APIError(400, "send exactly one of prompt (a string) and messages (a chat)", "prompt")
    try:
      if "prompt" in body:
        _need_tokenizer("prompt")
        if not isinstance(body["prompt"], str):
          raise APIError(400, "prompt must be a string", "prompt")
        ids = tokenizer.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
      else:
        _need_tokenizer("messages")
        ids = tokenizer.apply_chat_template(chat_messages(body["messages"]),
                                            add_generation_prompt=bool(body.get("add_generation_prompt", True)))
    except (InputError, ConfigError) as e:
      raise bad_request(e) from e
    return {"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_seq_len}

  @app.post("/detokenize")
  async def detokenize(request: Request):
    body = await read_body(request, model_name)
    _only(body, {"model", "tokens"}, "/detokenize")
    _need_tokenizer("tokens")
    ids = body.get("tokens")
    vocab = engine.model.config.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                            for t in ids):
      raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    return {"prompt": tokenizer.decode(ids)}

  @app.post("/v1/embeddings")
  async def embeddings(request: Request):
    from jaxsys.serving.generation import embed  # noqa: PLC0415  (JAX; already loaded by the engine)
    body = await read_body(request, model_name)
    _only(body, _EMBEDDING_FIELDS, "/v1/embeddings")
    prompts = _embedding_inputs(body.get("input"), tokenizer)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
      raise APIError(400, f"encoding_format={fmt!r} must be 'float' or 'base64'", "encoding_format")
    hidden = engine.model.config.hidden_size
    if body.get("dimensions") not in (None, hidden):
      raise APIError(400, f"dimensions={body['dimensions']!r} is not supported (only the model's hidden "
                     f"size, {hidden})", "dimensions")
    async with lock:
      try:
        vecs, counts = await asyncio.to_thread(_embed_on_mesh, engine, embed, prompts, tokenizer)
      except (InputError, ConfigError) as e:
        raise bad_request(e) from e
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()}
            for i, v in enumerate(vecs)]
    return {"object": "list", "data": data, "model": model_name,
            "usage": {"prompt_tokens": sum(counts), "total_tokens": sum(counts)}}

  if metrics is not None:
    @app.get("/metrics")
    async def prometheus():
      from prometheus_client import CONTENT_TYPE_LATEST  # noqa: PLC0415
      return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


class _AuthAndCount:
  """ASGI middleware: the API key on ``/v1`` routes (401 without it) and the request counter. A
  plain ASGI wrapper, not Starlette's ``BaseHTTPMiddleware``, which hides a client's disconnect
  from ``request.is_disconnected()`` (the server aborts abandoned requests by it)."""

  def __init__(self, app, api_key: str | None, metrics: ServerMetrics | None):
    self.app, self.metrics = app, metrics
    self.expected = None if api_key is None else f"Bearer {api_key}".encode()

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    path = scope["path"]
    label = path if path in _COUNTED else "other"  # bounded label values whatever clients send
    if self.expected is not None and path.startswith("/v1"):
      given = dict(scope["headers"]).get(b"authorization", b"")
      # constant-time comparison: the key must not leak through response timing
      if not hmac.compare_digest(given, self.expected):
        body = json.dumps(APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                   code="invalid_api_key").body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        if self.metrics is not None:
          self.metrics.requests.labels(label, "401").inc()
        return None
    status = []

    async def send_and_note(message):
      if message["type"] == "http.response.start":
        status.append(message["status"])
      await send(message)

    try:
      await self.app(scope, receive, send_and_note)
    finally:
      if self.metrics is not None and status and path != "/metrics":
        self.metrics.requests.labels(label, str(status[0])).inc()


_COUNTED = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings", "/tokenize",
            "/detokenize", "/version", "/health"}


def _embed_on_mesh(engine, embed, prompts, tokenizer):
  with engine.on_mesh():
    return embed(engine.model, prompts, tokenizer=tokenizer)


def _only(body: dict, fields: set, route: str) -> None:
  for name, value in body.items():
    if name not in fields and value is not None:
      raise APIError(400, f"unsupported field {name!r} for {route}", name)


def _embedding_inputs(value, tokenizer) -> list:
  """``input`` as a list of strings or token-id lists (400 naming ``input`` otherwise)."""
  is_ids = lambda x: isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)  # noqa: E731
  if isinstance(value, str) or is_ids(value):
    value = [value]
  if not isinstance(value, list) or not value or not all(isinstance(x, str) or is_ids(x) for x in value):
    raise APIError(400, "input must be a string, a list of strings, a list of token ids or a list of "
                   "such lists (non-empty)", "input")
  if any(isinstance(x, str) for x in value) and tokenizer is None:
    raise APIError(400, "this model has no tokenizer: send the input as token ids", "input")
  if any(isinstance(x, str) and not x for x in value):
    raise APIError(400, "input strings must be non-empty", "input")
  return value

