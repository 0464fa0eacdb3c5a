"""``jaxsys generate`` and ``jaxsys chat``: a model's reply to a prompt, or a terminal chat,
streamed token by token through ``jaxsys.serving.generate``.

  jaxsys generate --model smollm2-135m-instruct "What is the capital of France?"
  jaxsys generate --model model.gguf --system "Answer in French." --temperature 0.7 --seed 1 "Hi"
  jaxsys chat --model smollm2-135m-instruct          # empty line or EOF to quit

``--model`` and the sampling flags are ``jaxsys serve``'s (``jaxsys.serving.cli_common``). ``chat``
samples turn ``t`` with seed ``--seed + t``, so two sampled turns do not open with the same words.
``--max-tokens`` defaults to the context the prompt leaves, at most ``CLI_MAX_TOKENS`` (512).

Registering the commands imports nothing heavy; JAX loads when one runs.
"""

from __future__ import annotations

import sys

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.models.llm.interop.pretrained import DEFAULT_MODEL
from jaxsys.serving.cli_common import (CLI_MAX_TOKENS, add_model_args, add_sampling_args, load_model,
                                       sampling_params, with_system)

__all__ = ["register_cli"]


class _Printer:
  """Streams row 0 of ``generate(on_token=...)`` to ``out`` as text through the server's
  incremental detokenizer (:class:`~jaxsys.serving.requests.TextStream`): text is released once it
  cannot change (not inside a multi-byte character, not a prefix of a stop string); printing ends at
  a stop string or stop token."""

  def __init__(self, tokenizer, stop_tokens, stop, out):
    from jaxsys.serving.requests import TextStream  # noqa: PLC0415  (imports JAX: only when a command runs)
    self.text, self.stops, self.out = TextStream(tokenizer, tuple(stop or ())), set(stop_tokens), out
    self.tokens, self.done = [], False

  def __call__(self, step, tokens):
    if self.done:
      return
    tok = int(tokens[0])
    self.tokens.append(tok)
    new, hit = self.text.add(self.tokens)
    self.done = hit or tok in self.stops
    self._write(new)
    if self.done:
      self.finish()

  def finish(self) -> None:
    """Writes the held-back rest (the reply ended by its token budget)."""
    self._write(self.text.flush())

  def _write(self, text: str) -> None:
    if text:
      self.out.write(text)
      self.out.flush()


def _reply(model, tokenizer, prompt, args, stream=None, turn: int = 0) -> str:
  """The model's reply to ``prompt`` (a string or a chat), streamed to ``stream`` if given."""
  from jaxsys.decoding.core import context_length  # noqa: PLC0415  (JAX, when a command runs)
  from jaxsys.serving.generation import default_stop_tokens, encode_prompts, generate  # noqa: PLC0415
  ids = encode_prompts(tokenizer, [prompt])[0]
  room = context_length(model.config) - len(ids)
  if room < 1:
    raise InputError(f"the prompt has {len(ids)} tokens and leaves no room in the model's context "
                     f"of {context_length(model.config)}")
  max_tokens = min(room, CLI_MAX_TOKENS) if args.max_tokens is None else args.max_tokens
  printer = None if stream is None else _Printer(
      tokenizer, default_stop_tokens(model.config, tokenizer), args.stop, stream)
  res = generate(model, [ids], tokenizer=tokenizer, max_new_tokens=max_tokens,
                 sampling=sampling_params(args, turn), stop=args.stop, on_token=printer)
  if printer is not None:
    printer.finish()
  return res.text[0]


def _load(args):
  model, tokenizer = load_model(args.model or args.name or DEFAULT_MODEL, args.dtype)
  if tokenizer is None:
    raise InputError(f"--model {args.model or args.name}: has no tokenizer; generate and chat need text "
                     "in and out (jaxsys serve --prompts takes token ids)")
  return model, tokenizer


def _cmd_generate(args) -> int:
  try:
    model, tokenizer = _load(args)
    prompt = args.prompt if args.raw else with_system([{"role": "user", "content": args.prompt}], args.system)
    if args.raw and args.system is not None:
      raise ConfigError("--system needs the chat template (drop --raw)")
    _reply(model, tokenizer, prompt, args, stream=sys.stdout)
  except (ConfigError, InputError) as e:
    print(f"jaxsys generate: error: {e}", file=sys.stderr)
    return 2
  print(flush=True)
  return 0


def _cmd_chat(args) -> int:
  try:
    model, tokenizer = _load(args)
  except (ConfigError, InputError) as e:
    print(f"jaxsys chat: error: {e}", file=sys.stderr)
    return 2
  messages = with_system([], args.system)
  print("type a message (empty line or EOF to quit)", file=sys.stderr)
  turn = 0
  while True:
    try:
      line = input("> ").strip()
    except EOFError:
      break
    if not line:
      break
    messages.append({"role": "user", "content": line})
    try:
      answer = _reply(model, tokenizer, messages, args, stream=sys.stdout, turn=turn)
    except (ConfigError, InputError) as e:  # e.g. the chat outgrew the context: say so, keep the session
      print(f"error: {e}", file=sys.stderr)
      messages.pop()
      continue
    turn += 1
    print(flush=True)
    messages.append({"role": "assistant", "content": answer})
  return 0


def _add_generation_args(p) -> None:
  p.add_argument("name", nargs="?", default=None, help="model (or --model)")
  add_model_args(p, default=None)
  add_sampling_args(p, f"most new tokens of a reply (default: the context left, at most {CLI_MAX_TOKENS})")


def register_cli(subparsers) -> None:
  """Adds ``generate`` and ``chat`` to an argparse subparsers object (``fn(args) -> exit code``)."""
  p = subparsers.add_parser("generate", help="greedy (or sampled) reply of a model to one prompt")
  _add_generation_args(p)
  p.add_argument("prompt")
  p.add_argument("--raw", action="store_true", help="continue the prompt without the chat template")
  p.set_defaults(fn=_cmd_generate)
  p = subparsers.add_parser("chat", help="interactive chat with a model on stdin "
                            "(replies stream as they are generated)")
  _add_generation_args(p)
  p.set_defaults(fn=_cmd_chat)
