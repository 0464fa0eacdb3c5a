"""``jaxsys generate`` and ``jaxsys chat``: a named pretrained model's reply to a prompt, or a
terminal chat, streamed token by token through ``jaxsys.serving.generate``.

  jaxsys generate --model smollm2-135m-instruct "What is the capital of France?"
  jaxsys chat --model smollm2-135m-instruct          # empty line or EOF to quit

Registering the commands imports nothing heavy; JAX loads when one runs.
"""

from __future__ import annotations

import sys

from jaxsys.models.pretrained import DEFAULT_MODEL, MODELS, load_pretrained

__all__ = ["register_cli"]


class _Printer:
  """Streams row 0 of ``generate(on_token=...)`` to ``out`` as text: each step decodes all tokens
  so far and prints what is new (a token may end inside a multi-byte character), up to a stop token."""

  def __init__(self, tokenizer, stop_tokens, out):
    self.tokenizer, self.stops, self.out = tokenizer, set(stop_tokens), out
    self.tokens, self.shown, self.done = [], "", False

  def __call__(self, step, tokens):
    if self.done:
      return
    tok = int(tokens[0])
    self.tokens.append(tok)
    self.done = tok in self.stops
    text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
    if not text.endswith("\ufffd") and text.startswith(self.shown):
      self.out.write(text[len(self.shown):])
      self.out.flush()
      self.shown = text


def _reply(model, tokenizer, prompt, args, stream=None) -> str:
  """The model's reply to ``prompt`` (a string or a chat), streamed to ``stream`` if given."""
  from jaxsys.decoding.sampling import SamplingParams  # noqa: PLC0415  (JAX, when a command runs)
  from jaxsys.serving.generation import default_stop_tokens, generate  # noqa: PLC0415
  sampling = SamplingParams(args.temperature, top_p=args.top_p, seed=args.seed)
  printer = None if stream is None else _Printer(
      tokenizer, default_stop_tokens(model.config, tokenizer), stream)
  res = generate(model, [prompt], tokenizer=tokenizer, max_new_tokens=args.max_new_tokens,
                 sampling=sampling, on_token=printer)
  if printer is not None and printer.shown != res.text[0]:  # the rest (a held-back character)
    stream.write(res.text[0][len(printer.shown):] if res.text[0].startswith(printer.shown) else "")
  return res.text[0]


def _model_name(args) -> str:
  return args.model or args.name or DEFAULT_MODEL


def _cmd_generate(args) -> int:
  model, tokenizer = load_pretrained(_model_name(args), dtype=args.dtype)
  prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
  _reply(model, tokenizer, prompt, args, stream=sys.stdout)
  print(flush=True)
  return 0


def _cmd_chat(args) -> int:
  model, tokenizer = load_pretrained(_model_name(args), dtype=args.dtype)
  messages = []
  print("type a message (empty line or EOF to quit)", file=sys.stderr)
  while True:
    try:
      line = input("> ").strip()
    except EOFError:
      break
    if not line:
      break
    messages.append({"role": "user", "content": line})
    answer = _reply(model, tokenizer, messages, args, stream=sys.stdout)
    print(flush=True)
    messages.append({"role": "assistant", "content": answer})
  return 0


def _add_generation_args(p, positional_name: bool = True) -> None:
  if positional_name:
    p.add_argument("name", nargs="?", choices=sorted(MODELS), help="model name (or --model)")
  p.add_argument("--model", "-m", choices=sorted(MODELS), default=None,
                 help=f"model name (default {DEFAULT_MODEL})")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))


def register_cli(subparsers) -> None:
  """Adds ``generate`` and ``chat`` to an argparse subparsers object (``fn(args) -> exit code``)."""
  p = subparsers.add_parser("generate", help="greedy (or sampled) reply of a pretrained model")
  _add_generation_args(p)
  p.add_argument("prompt")
  p.add_argument("--raw", action="store_true", help="continue the prompt without the chat template")
  p.set_defaults(fn=_cmd_generate)
  p = subparsers.add_parser("chat", help="interactive chat with a pretrained model on stdin "
                            "(replies stream as they are generated)")
  _add_generation_args(p)
  p.set_defaults(fn=_cmd_chat)
