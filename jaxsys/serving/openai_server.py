"""An OpenAI-compatible HTTP server over the step-level ``ServingEngine`` (FastAPI + uvicorn).

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed over SSE with
``"stream": true``, else one JSON body), ``GET /v1/models``, ``GET /health``, and those of
``openai_routes`` (``/v1/embeddings``, ``/tokenize``, ``/detokenize``, ``/version``, ``/metrics``,
API-key auth). Chats are rendered with the tokenizer's chat template. Request fields (parsed in
``openai_protocol``): ``max_tokens`` / ``max_completion_tokens`` (default: the context the prompt
leaves, capped by ``--max-tokens``), ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``,
``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``logprobs`` / ``top_logprobs`` (chat)
or ``logprobs: int`` (completions), ``stream_options.include_usage``, ``response_format``
(``json_object`` / ``json_schema``: ``structured``), ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` (``tools``), and vLLM's extras ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``guided_json`` / ``guided_regex`` /
``guided_choice`` (``extra_body=`` in the ``openai`` client).

Threads: the engine runs in one background thread (:class:`EngineLoop`), which alone calls
``add_request`` / ``step`` / ``abort``; HTTP handlers hand requests over through a locked command
queue and receive each step's outputs on an ``asyncio.Queue`` (``call_soon_threadsafe``). A client
that disconnects mid-stream aborts its request, which frees its pages at the next step.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
parameter, a field this server does not support (``best_of`` above 1, an unknown name: nothing is silently ignored; fields at a neutral value such as ``"tool_choice":
"none"`` or ``"user"`` pass) or a prompt + ``max_tokens`` beyond the context, 404 for an unknown
model, 408 past ``--request-timeout`` (the work is aborted), 503 when ``max_pending`` sequences
are already queued or running or the engine thread has stopped. Limits: :class:`ServerLimits`.

Usage::

  jaxsys serve --model smollm2-135m-instruct --host 127.0.0.1 --port 8000

  server = start_server(engine, "smollm2-135m-instruct", port=0)   # in a thread; server.url
  client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
  client.chat.completions.create(model="smollm2-135m-instruct", messages=[...]).choices[0].message.content
  server.stop()
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations (``Request``) at runtime.

import asyncio
import collections
import dataclasses
import json
import logging
import threading
import time
import uuid

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.serving.openai_protocol import (APIError, bad_request, check_fields, chat_messages, read_body,
                                           request_params, tool_spec, with_defaults)
from jaxsys.serving.tools import render, reply_message
from jaxsys.serving.cli_common import with_system
from jaxsys.serving.openai_routes import ServerMetrics, add_routes
from jaxsys.serving.requests import RequestParams

__all__ = ["APIError", "build_app", "EngineLoop", "serve", "ServerHandle", "ServerLimits", "start_server"]

log = logging.getLogger("jaxsys.serving.server")

_ACCEPTED, _DONE = "accepted", "done"


@dataclasses.dataclass(frozen=True)
class ServerLimits:
  """What one server admits (``jaxsys serve`` flags of the same names).

  Attributes:
    max_pending: sequences (a request counts its ``n``) queued or running; beyond it, 503.
    default_max_tokens: caps ``max_tokens`` of a request that omits it, which is otherwise the
      context its prompt leaves (``--max-tokens``; None: no cap).
    max_n: the largest ``n`` one request may ask for (``--max-n``); beyond it, 400.
    request_timeout: seconds from arrival after which a request is aborted and its pages freed
      (``--request-timeout``; None: no deadline). A non-streamed request then gets a 408; a stream
      gets an error event and ends.
  """
  max_pending: int = 256
  default_max_tokens: int | None = None
  max_n: int = 16
  request_timeout: float | None = None

  def __post_init__(self):
    for name in ("max_pending", "default_max_tokens", "max_n"):
      value = getattr(self, name)
      if value is None and name == "default_max_tokens":
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an int >= 1")
    t = self.request_timeout
    if t is not None and not (isinstance(t, (int, float)) and 0 < t < float("inf")):
      raise ConfigError(f"request_timeout={t!r} must be a positive number of seconds (or None)")


class EngineLoop:
  """Runs ``engine.step()`` in a daemon thread while requests are live; see the module docstring."""

  def __init__(self, engine, limits: ServerLimits | None = None):
    self.engine, self.limits = engine, limits or ServerLimits()
    self._seqs: dict[str, int] = {}         # request id -> sequences (n) it holds
    self._cv = threading.Condition()
    self._cmds: collections.deque = collections.deque()
    self._subs: dict[str, tuple] = {}       # request id -> (event loop, asyncio.Queue)
    self._accepted: set[str] = set()
    self._stop = False
    self.failure: str | None = None         # why the engine thread stopped, if it did
    self.thread = threading.Thread(target=self._run, name="jaxsys-engine", daemon=True)
    self.thread.start()

  @property
  def num_pending(self) -> int:
    with self._cv:
      return len(self._subs)

  def submit(self, prompt, params: RequestParams, request_id: str, auto_max_tokens: bool) -> asyncio.Queue:
    """Queues a request (call from the event loop); its outputs arrive on the returned queue:
    first ``"accepted"`` or an exception, then ``StepOutput``s, then ``"done"``."""
    if not self.alive:
      raise APIError(503, f"the engine stopped: {self.failure}", type="server_error", code="engine_stopped")
    if params.n > self.limits.max_n:
      raise APIError(400, f"n={params.n} must be <= {self.limits.max_n} (the server's --max-n)", "n")
    q: asyncio.Queue = asyncio.Queue()
    with self._cv:
      # admission counts sequences: a request with n=8 takes 8 of max_pending
      if sum(self._seqs.get(r, 1) for r in self._subs) + params.n > self.limits.max_pending:
        raise APIError(503, f"the server is at capacity ({self.limits.max_pending} sequences queued or "
                       "running); retry later", type="server_error", code="overloaded")
      self._subs[request_id] = (asyncio.get_running_loop(), q)
      self._seqs[request_id] = params.n
      self._cmds.append(("add", prompt, params, request_id, auto_max_tokens))
      self._cv.notify()
    return q

  def abort(self, request_id: str) -> None:
    with self._cv:
      self._cmds.append(("abort", request_id))
      self._cv.notify()

  def close(self) -> None:
    with self._cv:
      self._stop = True
      self._cv.notify()
    self.thread.join(timeout=30)

  def _post(self, rid, item) -> None:
    sub = self._subs.get(rid)
    if sub is not None:
      sub[0].call_soon_threadsafe(sub[1].put_nowait, item)

  def _end(self, rid, item=_DONE) -> None:
    self._post(rid, item)
    with self._cv:
      self._subs.pop(rid, None)
      self._seqs.pop(rid, None)
    self._accepted.discard(rid)

  def _add(self, prompt, params, rid, auto_max_tokens) -> None:
    """Queues one request. Whatever its own data raises fails that request alone: the engine
    thread must never die on a client's input (a lone surrogate in a chat message made the
    tokenizer raise ``TypeError`` here, and every later request hung)."""
    e = self.engine
    try:
      try:
        ids = e.scheduler.encode(prompt)
      except (InputError, ConfigError):
        raise
      except Exception as err:  # noqa: BLE001 - the tokenizer's errors on this request's text
        raise InputError(f"prompt could not be tokenized: {type(err).__name__}: {err}") from err
      if auto_max_tokens:  # OpenAI's default: as many as the context leaves (capped by the server)
        room = e.max_seq_len - len(ids)
        cap = self.limits.default_max_tokens or room
        params = dataclasses.replace(params, max_tokens=max(1, min(cap, room)))
      e.add_request(ids, params, rid)
    except (InputError, ConfigError) as err:
      log.info("request %s: rejected: %s", rid, err)
      self._end(rid, bad_request(err))
      return
    except Exception as err:  # noqa: BLE001 - fail this request, keep serving the others
      log.exception("request %s: failed while queueing", rid)
      e.abort(rid)
      self._end(rid, APIError(500, f"request failed: {type(err).__name__}", None, type="server_error"))
      return
    self._accepted.add(rid)
    self._post(rid, _ACCEPTED)

  @property
  def alive(self) -> bool:
    """False once the engine thread has stopped (``/health`` then answers 503)."""
    return self.thread.is_alive() and self.failure is None

  def _run(self) -> None:
    """The engine thread. Request faults never reach here (``_add``); if anything else escapes,
    the thread records it, fails every live request and stops, and ``/health`` says so, so a
    supervisor can restart the server instead of it hanging with a healthy status."""
    try:
      self._serve_forever()
    except BaseException as err:  # noqa: BLE001 - recorded and reported, never silent
      self.failure = f"{type(err).__name__}: {err}"
      log.exception("the engine thread stopped")
      for rid in list(self._subs):
        self._end(rid, APIError(503, f"the engine stopped: {self.failure}", type="server_error"))

  def _serve_forever(self) -> None:
    e = self.engine
    while True:
      with self._cv:
        while not self._cmds and not e.has_unfinished() and not self._stop:
          self._cv.wait()
        if self._stop:
          return
        cmds = list(self._cmds)
        self._cmds.clear()
      for cmd in cmds:
        if cmd[0] == "add":
          self._add(*cmd[1:])
        elif e.abort(cmd[1]) or cmd[1] in self._subs:
          self._end(cmd[1])
      if not e.has_unfinished():
        continue
      try:
        outs = e.step()
      except Exception as err:  # noqa: BLE001  (the engine reset itself; every request fails)
        log.exception("engine step failed; failing %d requests", len(self._accepted))
        for rid in list(self._accepted):
          self._end(rid, APIError(500, f"engine failure: {err}", type="server_error"))
        continue
      for o in outs:
        self._post(o.request_id, o)
      for rid in [r for r in self._accepted if r not in e.scheduler.requests]:
        self._end(rid)


class ClientGone(Exception):
  """The client of a request closed its connection (its work is aborted)."""


def _timed_out(timeout: float) -> APIError:
  return APIError(408, f"the request took longer than the server's --request-timeout of {timeout:g} s; "
                  "its work was aborted", type="timeout_error", code="request_timeout")


async def _next(q: asyncio.Queue, request, deadline: float | None, timeout: float | None,
                poll: float = 0.25):
  """The next item of a request's queue. Every ``poll`` seconds it checks that the client is still
  connected (``ClientGone`` otherwise; ``request=None``: a stream, whose disconnect closes its
  generator instead) and that the deadline has not passed (408 ``APIError``), so a client that
  gives up, or a request past ``--request-timeout``, frees its pages and its ``max_pending``
  share within a poll, not when its ``max_tokens`` are done."""
  while True:
    try:
      return await asyncio.wait_for(q.get(), timeout=poll)
    except asyncio.TimeoutError:
      if request is not None and await request.is_disconnected():
        raise ClientGone() from None
      if deadline is not None and time.monotonic() > deadline:
        raise _timed_out(timeout) from None


def build_app(loop: EngineLoop, model_name: str, tokenizer=None, *, api_key: str | None = None,
              defaults: dict | None = None, system: str | None = None):
  """The FastAPI application serving ``loop.engine`` as ``model_name``. ``api_key``: the Bearer
  token every ``/v1`` route needs (None: open); ``defaults``: values for the request fields a
  client omits (``openai_protocol.DEFAULTABLE``); ``system``: a system message for chats without
  one. The routes beyond completions come from ``openai_routes.add_routes``."""
  from fastapi import FastAPI, Request  # noqa: PLC0415  (server extra)
  from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: PLC0415

  app = FastAPI(title="jaxsys", version="1")
  metrics = ServerMetrics(loop.engine)
  add_routes(app, loop, model_name, tokenizer, metrics, api_key)
  defaults = dict(defaults or {})
  with_defaults({}, defaults)  # a bad default is a ConfigError now, not at the first request
  created = int(time.time())

  @app.exception_handler(APIError)
  async def _api_error(_request, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status)

  @app.get("/health")
  async def health():
    if not loop.alive:
      return JSONResponse({"status": "engine stopped", "error": loop.failure}, status_code=503)
    return {"status": "ok", "pending": loop.num_pending}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "jaxsys"}]}

  async def _body(request) -> dict:
    return await read_body(request, model_name)

  def _token(t: int) -> str:
    return tokenizer.decode([t]) if tokenizer is not None else str(t)

  def _chat_logprobs(lps):
    if lps is None:
      return None
    return {"content": [{"token": _token(x.token_id), "logprob": x.logprob,
                         "bytes": list(_token(x.token_id).encode()),
                         "top_logprobs": [{"token": _token(a), "logprob": v, "bytes": list(_token(a).encode())}
                                          for a, v in x.top]} for x in lps]}

  def _text_logprobs(lps):
    if lps is None:
      return None
    return {"tokens": [_token(x.token_id) for x in lps], "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{_token(a): v for a, v in x.top} for x in lps]}

  async def _gather(q, request, n: int, deadline, track):
    """A non-streamed request's outputs until it is done: ``(texts, logprobs, finish reasons,
    prompt tokens, completion tokens per choice)``. ``deadline``: ``(monotonic deadline or None,
    --request-timeout)``, as ``_next`` takes them."""
    texts, lps, reasons = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
    prompt_tokens, completion = 0, [0] * n
    while (item := await _next(q, request, *deadline)) != _DONE:
      if isinstance(item, Exception):
        raise item
      track.output(item)
      texts[item.index].append(item.new_text or "")
      lps[item.index] += item.logprobs or []
      reasons[item.index] = item.finish_reason or reasons[item.index]
      prompt_tokens, completion[item.index] = item.num_prompt_tokens, item.num_generated
    return texts, lps, reasons, prompt_tokens, completion

  async def _serve(request, body, prompt, chat: bool, tools=None):
    params, auto = request_params(with_defaults(body, defaults), chat)
    kind = "chatcmpl" if chat else "cmpl"
    rid = f"{kind}-{uuid.uuid4().hex[:24]}"
    t0 = time.perf_counter()
    timeout = loop.limits.request_timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    q = loop.submit(prompt, params, rid, auto)
    track = metrics.tracker(t0)
    try:  # from here on, any exit but a finished reply aborts the queued work and frees its pages
      first = await _next(q, request, deadline, timeout)
      if isinstance(first, Exception):
        raise first
      obj = "chat.completion" if chat else "text_completion"
      base = {"id": rid, "created": int(time.time()), "model": model_name}
      log.info("request %s: accepted (%s, n=%d, stream=%s)", rid, obj, params.n, bool(body.get("stream")))
      if body.get("stream") and tools is None:
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(q, rid, base, obj, params, chat, usage, track, (deadline, timeout)),
                                 media_type="text/event-stream")
      texts, lps, reasons, prompt_tokens, completion = await _gather(q, request, params.n, (deadline, timeout),
                                                                     track)
    except ClientGone:  # nobody to answer: free the work, say so once, no traceback
      loop.abort(rid)
      log.info("request %s: client disconnected; aborted", rid)
      return Response(status_code=499)
    except BaseException as err:
      loop.abort(rid)
      if isinstance(err, APIError) and err.status == 408:
        log.info("request %s: timed out after %.1fs; aborted", rid, time.perf_counter() - t0)
      raise
    choices = []
    for i in range(params.n):
      text, lp = "".join(texts[i]), lps[i] if params.logprobs else None
      if chat:
        msg, called = ({"role": "assistant", "content": text}, False) if tools is None else reply_message(text, tools)
        choices.append({"index": i, "message": msg, "logprobs": _chat_logprobs(lp),
                        "finish_reason": "tool_calls" if called else reasons[i]})
      else:
        choices.append({"index": i, "text": text, "logprobs": _text_logprobs(lp),
                        "finish_reason": reasons[i]})
    track.done(prompt_tokens)
    log.info("request %s: done in %.3fs, %d completion tokens", rid, time.perf_counter() - t0,
             sum(completion))
    reply = {**base, "object": obj, "choices": choices,
             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sum(completion),
                       "total_tokens": prompt_tokens + sum(completion)}}
    if body.get("stream"):  # with tools: a reply is parsed whole, then streamed as one delta per choice
      usage = bool((body.get("stream_options") or {}).get("include_usage"))
      return StreamingResponse(_replay(reply, usage), media_type="text/event-stream")
    return reply

  async def _replay(reply, usage: bool):
    """A finished chat reply as OpenAI's stream: per choice, one delta (its content or its
    ``tool_calls``, each with its ``index``) and one chunk with the finish reason; then the usage."""
    base = {k: reply[k] for k in ("id", "created", "model")}
    sse = lambda d: f"data: {json.dumps(d)}\n\n"  # noqa: E731
    for c in reply["choices"]:
      msg = c["message"]
      delta = {"role": "assistant", "content": msg["content"]}
      if msg.get("tool_calls"):
        delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(msg["tool_calls"])]
      for d, reason in ((delta, None), ({}, c["finish_reason"])):
        yield sse({**base, "object": "chat.completion.chunk",
                   "choices": [{"index": c["index"], "delta": d, "logprobs": c["logprobs"] if reason is None
                                else None, "finish_reason": reason}]})
    if usage:
      yield sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": reply["usage"]})
    yield "data: [DONE]\n\n"

  async def _stream(q, rid, base, obj, params, chat, usage, track, deadline):
    obj += ".chunk" if chat else ""
    done = False
    sse = lambda d: f"data: {json.dumps(d)}\n\n"  # noqa: E731
    prompt_tokens, completion = 0, [0] * params.n
    try:
      if chat:
        for i in range(params.n):
          yield sse({**base, "object": obj, "choices": [
              {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
               "finish_reason": None}]})
      while True:
        try:
          item = await _next(q, None, *deadline)
        except APIError as err:  # past --request-timeout: say so, then abort (below)
          item = err
        if item == _DONE:
          break
        if isinstance(item, Exception):
          loop.abort(rid)  # a timed-out request still holds pages (an engine error already ended it)
          yield sse(item.body() if isinstance(item, APIError) else {"error": {"message": str(item)}})
          break
        track.output(item)
        prompt_tokens, completion[item.index] = item.num_prompt_tokens, item.num_generated
        lp = item.logprobs if params.logprobs else None
        if chat:
          choice = {"index": item.index, "delta": {"content": item.new_text or ""},
                    "logprobs": _chat_logprobs(lp), "finish_reason": item.finish_reason}
        else:
          choice = {"index": item.index, "text": item.new_text or "", "logprobs": _text_logprobs(lp),
                    "finish_reason": item.finish_reason}
        yield sse({**base, "object": obj, "choices": [choice]})
      if usage:
        yield sse({**base, "object": obj, "choices": [],
                   "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sum(completion),
                             "total_tokens": prompt_tokens + sum(completion)}})
      yield "data: [DONE]\n\n"
      done = True
      track.done(prompt_tokens)
      log.info("request %s: streamed in %.3fs, %d completion tokens", rid, time.perf_counter() - track.t0,
               sum(completion))
    finally:
      if not done:  # the client went away: free its pages
        log.info("request %s: client disconnected, aborting", rid)
        loop.abort(rid)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = await _body(request)
    check_fields(body, chat=True)
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
      raise APIError(400, "this model has no tokenizer chat template; use /v1/completions", "messages")
    messages = with_system(chat_messages(body.get("messages")), system)
    spec = tool_spec(body)
    if spec is None:
      return await _serve(request, body, messages, chat=True)
    msgs, tools_arg = render(messages, spec, tokenizer.chat_template)
    try:  # the prompt as ids: the template takes the tools (or they are in the messages by now)
      ids = tokenizer.apply_chat_template(msgs, tools=tools_arg, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the template's error on this request's messages
      raise APIError(400, f"the chat template could not render these messages with tools: {e}", "messages") from e
    return await _serve(request, body, list(ids), chat=True, tools=spec)

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = await _body(request)
    check_fields(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    if isinstance(prompt, str):
      if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
    elif not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
      raise APIError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                     "prompt")
    return await _serve(request, body, prompt, chat=False)

  return app


@dataclasses.dataclass
class ServerHandle:
  """A server running in a background thread (``start_server``)."""
  url: str
  loop: EngineLoop
  server: object
  thread: threading.Thread

  def stop(self) -> None:
    self.server.should_exit = True
    self.thread.join(timeout=30)
    self.loop.close()


def start_server(engine, model_name: str, *, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", api_key: str | None = None, defaults: dict | None = None,
                 system: str | None = None, **limits):
  """Starts uvicorn in a thread (``port=0``: a free port) and returns a :class:`ServerHandle`.
  ``api_key``, ``defaults``, ``system``: as :func:`build_app` takes them; ``limits``: the fields of
  :class:`ServerLimits` (``max_pending=``, ``request_timeout=``, ...)."""
  app_args = dict(api_key=api_key, defaults=defaults, system=system)
  import socket  # noqa: PLC0415
  import uvicorn  # noqa: PLC0415
  sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  loop = EngineLoop(engine, ServerLimits(**limits))
  app = build_app(loop, model_name, engine.tokenizer, **app_args)
  server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="jaxsys-http",
                            daemon=True)
  thread.start()
  deadline = time.time() + 60
  while not server.started and thread.is_alive() and time.time() < deadline:
    time.sleep(0.02)
  if not server.started:
    loop.close()
    raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
  return ServerHandle(f"http://{host}:{sock.getsockname()[1]}", loop, server, thread)


def serve(engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          graceful_seconds: float = 5.0, api_key: str | None = None, defaults: dict | None = None,
          system: str | None = None, **limits) -> int:
  """Serves until interrupted (``jaxsys serve``); returns the process exit code.

  SIGTERM / Ctrl-C stop the server within a bounded time: open requests get ``graceful_seconds``
  to finish, then their handlers are cancelled (which aborts their work), then the engine thread
  is joined. If the engine thread dies, ``/health`` answers 503 and the server shuts itself down
  and returns 1, so a supervisor restarts it instead of keeping a server that hangs every
  request. ``api_key``, ``defaults``, ``system``: as :func:`build_app` takes them; ``limits``: the
  fields of :class:`ServerLimits`."""
  import uvicorn  # noqa: PLC0415
  app_args = dict(api_key=api_key, defaults=defaults, system=system)
  loop = EngineLoop(engine, ServerLimits(**limits))
  server = uvicorn.Server(uvicorn.Config(build_app(loop, model_name, engine.tokenizer, **app_args), host=host,
                                         port=port, log_level="info",
                                         timeout_graceful_shutdown=graceful_seconds))

  def stop_when_engine_dies():
    loop.thread.join()
    if loop.failure is not None:
      log.error("the engine thread stopped (%s); shutting the server down", loop.failure)
      server.should_exit = True

  threading.Thread(target=stop_when_engine_dies, name="jaxsys-engine-watch", daemon=True).start()
  try:
    server.run()
  finally:
    loop.close()
  return 1 if loop.failure is not None else 0
