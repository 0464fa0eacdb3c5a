"""OpenAI tool calling for any chat model: tools rendered into the prompt, calls constrained or parsed,
replies in OpenAI's ``tool_calls`` shape.

* **Rendering.** A chat template that reads ``tools`` (its source mentions the name) gets them as
  ``tools=`` and the messages as sent (assistant ``tool_calls``, ``tool`` results). For a template that
  does not (SmolLM2's), the tools go into the system message as their JSON schemas, with the reply
  format ``{"name": <function>, "arguments": {...}}``; an assistant turn's calls become that JSON as its
  content and a ``tool`` turn's content is the result.
* **tool_choice.** ``"none"``: a plain reply, never parsed as a call. ``"required"`` or a named function
  ``{"type": "function", "function": {"name": ...}}``: the reply is constrained (``serving.structured``)
  to the JSON of a call of one of the tools (of that one), so it always parses. ``"auto"`` (the default
  with tools): the reply is free; it is a call when all of it (optionally inside ``<tool_call>`` tags) is
  such a JSON object naming a known tool, otherwise text.
* **Reply.** ``{"role": "assistant", "content": null, "tool_calls": [{"id": "call_...", "type":
  "function", "function": {"name", "arguments": <JSON string>}}]}`` with ``finish_reason
  "tool_calls"``; one call per reply (``parallel_tool_calls`` is accepted: one call is within "may").
  With ``stream: true`` the reply is parsed whole and then sent as one delta per choice (its content
  or its ``tool_calls``), since a call is only known once the reply is complete.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from jaxsys.core.errors import InputError

__all__ = ["ToolSpec", "call_schema", "parse_tools", "render", "reply_message"]

_CALL = re.compile(r"\s*(?:<tool_call>\s*)?(\{.*\})\s*(?:</tool_call>)?\s*", re.S)


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  """A request's validated tools: ``functions`` ``{name: {"description", "parameters"}}`` and
  ``choice`` ``"none" | "auto" | "required"`` or the name of the one function to call."""
  functions: dict
  choice: str


def parse_tools(body: dict) -> ToolSpec | None:
  """The request's :class:`ToolSpec` (None without tools); ``InputError`` naming the field."""
  tools, choice = body.get("tools"), body.get("tool_choice")
  if not tools:
    if choice not in (None, "none", "auto"):
      raise InputError(f"tool_choice={_short(choice)} needs tools")
    return None
  if not isinstance(tools, list):
    raise InputError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
  functions = {}
  for i, t in enumerate(tools):
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
      raise InputError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": <1-64 of "
                       "a-z A-Z 0-9 _ ->, \"parameters\": <JSON schema>}}}}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
      raise InputError(f"tools[{i}].function.parameters must be a JSON schema object")
    if name in functions:
      raise InputError(f"tools[{i}]: function {name!r} is listed twice")
    functions[name] = {"description": fn.get("description", ""), "parameters": params}
  if choice is None:
    choice = "auto"
  elif isinstance(choice, dict):
    fn = choice.get("function") if choice.get("type") == "function" else None
    choice = fn.get("name") if isinstance(fn, dict) else None
    if choice not in functions:
      raise InputError(f"tool_choice must name one of the tools {sorted(functions)}")
  elif choice not in ("none", "auto", "required"):
    raise InputError(f"tool_choice={_short(choice)} must be 'none', 'auto', 'required' or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")
  if not isinstance(body.get("parallel_tool_calls", True), bool):
    raise InputError("parallel_tool_calls must be true or false")
  return ToolSpec(functions, choice)


def call_schema(spec: ToolSpec) -> dict | None:
  """The JSON schema a constrained reply follows (``required`` / a named function), else None."""
  if spec.choice in ("none", "auto"):
    return None
  names = sorted(spec.functions) if spec.choice == "required" else [spec.choice]
  one = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
          "properties": {"name": {"const": n}, "arguments": spec.functions[n]["parameters"]}} for n in names]
  return one[0] if len(one) == 1 else {"anyOf": one}


def render(messages: list[dict], spec: ToolSpec, template: str | None) -> tuple[list[dict], list | None]:
  """``(messages, tools)`` for ``apply_chat_template``: as sent with ``tools=`` when the template
  reads tools, else rewritten into plain turns with the tools in the system message."""
  if template is not None and "tools" in template:
    return messages, [{"type": "function", "function": {"name": n, **f}} for n, f in spec.functions.items()]
  lines = ["You can call these functions. To call one, reply with only a JSON object "
           '{"name": <function name>, "arguments": <arguments object>}.']
  lines += [json.dumps({"name": n, **f}) for n, f in spec.functions.items()]
  tools_text = "\n".join(lines)
  out = []
  for m in messages:
    if m.get("tool_calls"):
      calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
               for c in m["tool_calls"]]
      m = {"role": "assistant", "content": "\n".join(json.dumps(c) for c in calls)}
    out.append({"role": m["role"], "content": m.get("content") or ""})
  if out and out[0]["role"] == "system":
    out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools_text}
  else:
    out.insert(0, {"role": "system", "content": tools_text})
  return out, None


def reply_message(text: str, spec: ToolSpec) -> tuple[dict, bool]:
  """``(assistant message, is a call)``: the reply as a ``tool_calls`` message when it is a call of
  a known tool (module docstring), else as text."""
  m = _CALL.fullmatch(text) if spec.choice != "none" else None
  try:
    call = json.loads(m.group(1)) if m else None
  except ValueError:
    call = None
  if isinstance(call, dict) and call.get("name") in spec.functions and isinstance(call.get("arguments"), dict):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]}, True
  return {"role": "assistant", "content": text}, False


def _short(value) -> str:
  text = json.dumps(value, ensure_ascii=True, default=str)
  return text if len(text) <= 60 else text[:57] + "..."
