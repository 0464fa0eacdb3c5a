"""The OpenAI request schema as this server reads it: one error type, the fields each endpoint
honours, and their parsing into :class:`~jaxsys.serving.requests.RequestParams`.

Every field of the OpenAI chat and completions request schemas is either honoured or refused with a
400 naming it (:data:`CHAT_FIELDS`, :data:`TEXT_FIELDS`; fields at a neutral value that asks for
nothing this server lacks pass, :data:`NEUTRAL`), so nothing a client sends is silently dropped.
``null`` counts as omitted. Server-side defaults (``jaxsys serve --temperature ...``) fill the
fields a request omits (:func:`with_defaults`).
"""

import json
import re

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.serving.requests import RequestParams

__all__ = ["APIError", "CHAT_FIELDS", "DEFAULTABLE", "NEUTRAL", "TEXT_FIELDS", "bad_request", "chat_messages",
           "check_fields", "read_body", "request_params", "tool_spec", "with_defaults"]


class APIError(Exception):
  """An error answered with OpenAI's error JSON."""

  def __init__(self, status: int, message: str, param: str | None = None,
               type: str = "invalid_request_error", code: str | None = None):
    # a client's text echoed back (a model name, a field) may hold lone surrogates, which JSON
    # responses cannot encode: escape them rather than fail the reply
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


async def read_body(request, model_name: str) -> dict:
  """The JSON object of a request to ``model_name``: 400 when it is not one, 404 for another model."""
  try:
    body = await request.json()
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise APIError(400, f"the request body is not valid JSON ({e})") from e
  if not isinstance(body, dict):
    raise APIError(400, "the request body must be a JSON object")
  if body.get("model") != model_name:
    raise APIError(404, f"The model `{body.get('model')}` does not exist; this server serves "
                   f"`{model_name}`", "model", code="model_not_found")
  return body


def bad_request(e: Exception) -> APIError:
  m = re.match(r"\s*(?:request \S+: )?(\w+)=", str(e))
  return APIError(400, str(e), m.group(1) if m else None)


def chat_messages(messages) -> list[dict]:
  """Validated chat messages with string contents (text parts joined)."""
  if not isinstance(messages, list) or not messages:
    raise APIError(400, "messages must be a non-empty list", "messages")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or "role" not in m:
      raise APIError(400, f"messages[{i}] must be an object with a 'role'", "messages")
    c = m.get("content") or ""
    if isinstance(c, list):
      for j, part in enumerate(c):
        if not isinstance(part, dict) or (part.get("type") == "text" and not isinstance(part.get("text"), str)):
          raise APIError(400, f"messages[{i}].content[{j}] must be a text part "
                         '{"type": "text", "text": <string>}', "messages")
      c = "".join(part["text"] for part in c if part.get("type") == "text")
    if not isinstance(c, str):
      raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
    msg = {"role": str(m["role"]), "content": c}
    if m.get("tool_calls") is not None:  # an assistant turn that called tools (rendered by serving.tools)
      msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
    if m.get("tool_call_id") is not None:
      if not isinstance(m["tool_call_id"], str):
        raise APIError(400, f"messages[{i}].tool_call_id must be a string", "messages")
      msg["tool_call_id"] = m["tool_call_id"]
    out.append(msg)
  return out


def _tool_calls(calls, i: int) -> list[dict]:
  ok = isinstance(calls, list) and all(
      isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
      and isinstance(c["function"].get("arguments", ""), str) for c in calls)
  if ok:
    try:
      for c in calls:
        if not isinstance(json.loads(c["function"].get("arguments") or "{}"), dict):
          ok = False
    except ValueError:
      ok = False
  if not ok:
    raise APIError(400, f"messages[{i}].tool_calls must be a list of {{\"id\", \"type\": \"function\", "
                   "\"function\": {\"name\", \"arguments\": <JSON object as a string>}}", "messages")
  return [{"id": str(c.get("id", "")), "type": "function",
           "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments") or "{}"}}
          for c in calls]


def tool_spec(body: dict):
  """The request's ``serving.tools.ToolSpec`` (None without tools); a 400 naming the field."""
  from jaxsys.serving.tools import parse_tools  # noqa: PLC0415
  try:
    return parse_tools(body)
  except InputError as e:
    raise APIError(400, str(e), "tool_choice" if str(e).startswith("tool_choice") else
                   "parallel_tool_calls" if str(e).startswith("parallel") else "tools") from e


def request_params(body: dict, chat: bool) -> tuple[RequestParams, bool]:
  """``(RequestParams, max_tokens was omitted)`` from an OpenAI request body."""
  bias = body.get("logit_bias") or {}
  if not isinstance(bias, dict):
    raise APIError(400, f"logit_bias must be an object mapping token ids to biases, got {type(bias).__name__}",
                   "logit_bias")
  mt = body.get("max_completion_tokens", body.get("max_tokens"))
  stop = body.get("stop") or ()
  if isinstance(stop, str):
    stop = (stop,)
  if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
    raise APIError(400, f"stop must be a string or a list of strings, got {type(stop).__name__}", "stop")
  ids = body.get("stop_token_ids") or ()
  if not isinstance(ids, (list, tuple)):
    raise APIError(400, f"stop_token_ids must be a list of token ids, got {type(ids).__name__}",
                   "stop_token_ids")
  if not isinstance(body.get("stream_options") or {}, dict):
    raise APIError(400, "stream_options must be an object such as {\"include_usage\": true}",
                   "stream_options")
  if chat:
    logprobs, top = bool(body.get("logprobs") or False), body.get("top_logprobs") or 0
    if top and not logprobs:
      raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
  else:
    lp = body.get("logprobs")
    logprobs, top = lp is not None, lp or 0
  kw = dict(temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
            top_k=body.get("top_k", 0) or 0, min_p=body.get("min_p", 0.0) or 0.0, seed=body.get("seed"),
            n=body.get("n", 1), stop=tuple(stop) if isinstance(stop, (list, tuple)) else stop,
            stop_token_ids=tuple(body.get("stop_token_ids") or ()), ignore_eos=bool(body.get("ignore_eos")),
            logprobs=logprobs, top_logprobs=top, frequency_penalty=body.get("frequency_penalty"),
            presence_penalty=body.get("presence_penalty"), repetition_penalty=body.get("repetition_penalty"),
            logit_bias=tuple(bias.items()), grammar=_grammar(body))
  kw = {k: v for k, v in kw.items() if v is not None or k == "seed"}
  try:
    return RequestParams(max_tokens=16 if mt is None else mt, **kw), mt is None
  except (ConfigError, InputError, TypeError) as e:
    raise bad_request(e) from e


# Request fields beyond these are refused (400): nothing a client asks for is silently ignored.
_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop",
           "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "top_k",
           "min_p", "ignore_eos", "stop_token_ids", "response_format", "guided_json", "guided_regex",
           "guided_choice"} | {"user", "safety_identifier", "prompt_cache_key"}
# Identifiers of the end user or of a cache shard: strings that change nothing in the output.
_IDENTIFIERS = ("user", "safety_identifier", "prompt_cache_key")
CHAT_FIELDS = _FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls"}
TEXT_FIELDS = _FIELDS | {"prompt", "logprobs"}
# Fields accepted only at a value that asks for nothing this server lacks.
NEUTRAL = {"tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False), "best_of": (1,), "echo": (False,),
            "suffix": ("",), "store": (False,), "metadata": ({},), "service_tier": ("auto", "default")}


def _grammar(body: dict) -> str | None:
  """The llguidance grammar of ``response_format`` (``json_object`` / ``json_schema``) or vLLM's
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` (at most one of them), or None."""
  from jaxsys.serving.structured import grammar_for  # noqa: PLC0415
  rf = body.get("response_format")
  asks = {}
  if rf is not None:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":
      asks["response_format"] = {"json_schema": {"type": "object"}}
    elif kind == "json_schema":
      spec = rf.get("json_schema")
      schema = spec.get("schema") if isinstance(spec, dict) else None
      if not isinstance(schema, dict):
        raise APIError(400, 'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                       "response_format")
      asks["response_format"] = {"json_schema": schema}
    elif kind != "text":
      raise APIError(400, f"response_format={_short(rf)} must have type text, json_object or json_schema",
                     "response_format")
  for name, arg in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choices")):
    if body.get(name) is not None:
      asks[name] = {arg: body[name]}
  spec = tool_spec(body)
  if spec is not None:
    from jaxsys.serving.tools import call_schema  # noqa: PLC0415
    if (schema := call_schema(spec)) is not None:
      asks["tool_choice"] = {"json_schema": schema}
  if len(asks) > 1:
    raise APIError(400, f"ask for one structured output at a time, got {sorted(asks)}", sorted(asks)[1])
  if not asks:
    return None
  (name, kw), = asks.items()
  try:
    return grammar_for(**kw)
  except (InputError, ConfigError) as e:
    raise APIError(400, f"{name}: {e}", name) from e


def check_fields(body: dict, chat: bool) -> None:
  """400 naming the first field this endpoint does not support (``null`` counts as omitted)."""
  known = CHAT_FIELDS if chat else TEXT_FIELDS
  for name, value in body.items():
    if name in known or value is None:
      if name in _IDENTIFIERS and not isinstance(value, (str, type(None))):
        raise APIError(400, f"{name} must be a string, got {type(value).__name__}", name)
      continue
    if name in NEUTRAL:
      if any(type(value) is type(ok) and value == ok for ok in NEUTRAL[name]):
        continue
      raise APIError(400, f"{name}={_short(value)} is not supported by this server (accepted: "
                     f"{' or '.join(json.dumps(v) for v in NEUTRAL[name])})", name)
    raise APIError(400, f"unsupported field {name!r} for /v1/{'chat/' if chat else ''}completions",
                   name)


def _short(value) -> str:
  text = json.dumps(value, ensure_ascii=True)
  return text if len(text) <= 60 else text[:57] + "..."


#: Request fields a server-side default may fill (``jaxsys serve --temperature ...``).
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "seed", "stop")


def with_defaults(body: dict, defaults: dict) -> dict:
  """``body`` with ``defaults`` filling the :data:`DEFAULTABLE` fields it omits (or sets to null)."""
  extra = sorted(set(defaults) - set(DEFAULTABLE))
  if extra:
    raise ConfigError(f"defaults={extra} are not request fields a server default may fill; use {DEFAULTABLE}")
  return {**body, **{k: v for k, v in defaults.items() if body.get(k) is None}}
