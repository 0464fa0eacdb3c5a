"""``jaxsys serve``: an OpenAI-compatible HTTP server, or the serving engine on a prompt file.

Without ``--prompts`` it serves ``--model`` over HTTP (``jaxsys.serving.openai_server``:
``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/v1/embeddings``, ``/tokenize``,
``/detokenize``, ``/version``, ``/metrics``, ``/health``; ``--api-key`` or ``$JAXSYS_API_KEY``: Bearer
auth on every ``/v1`` route); attention is dense
unless ``--lserve`` (LServe: page selection for retrieval heads under ``--budget``, and with
``--gates`` streaming heads on sink + local pages)::

  jaxsys serve --model smollm2-135m-instruct --host 127.0.0.1 --port 8000
  jaxsys serve --model smollm2-135m-instruct --lserve --budget 1024 --gates gates.json --port 8000

With ``--prompts`` it runs the batch engine on a prompt file (LServe unless ``--dense``). Prompt
file: one prompt per line, either a JSON list of token ids, a JSON object with a ``"tokens"``
list (and optional ``"max_new_tokens"``), or whitespace-separated token ids. Results go to
stdout (or ``--out``) as JSON lines ``{"index", "tokens", "finished", "error"}``, followed by a
summary line on stderr.

  jaxsys serve --prompts prompts.jsonl --model tiny --budget 256 --page-size 16 \\
               --logical-page 4 --gates gates.json --max-new-tokens 32
  jaxsys serve --prompts prompts.jsonl --model tiny --dense

``--model``, ``--dtype`` and the sampling flags are those of ``jaxsys generate`` / ``jaxsys chat``
(``jaxsys.serving.cli_common``): a registered name (``smollm2-135m-instruct``, with its tokenizer and
chat template; ``jaxsys fetch`` it first), a ``.gguf`` file, a Hugging Face checkpoint folder, ``tiny``
(the shipped tiny LM, the default) or ``random`` (a small random-weight model, for smoke tests). Over
HTTP the sampling flags are the defaults of the request fields a client omits (``--system``: a system
message for chats that have none), and ``--max-tokens`` caps the ``max_tokens`` of a request that omits
it, which is otherwise the context its prompt leaves; a request's own values win. In the prompt-file
mode they sample every prompt (``--max-tokens`` default 32).

HTTP serving needs the ``serve`` extra; without it ``jaxsys serve`` says so in one line (exit 2)
before any model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.serving.cli_common import (SERVE_MODULES, add_model_args, add_sampling_args, load_model,
                                       missing_extra, sampling_params)

__all__ = ["build_parser", "load_model", "main", "read_prompts"]


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxsys serve", description=__doc__.split("\n\n")[0])
  p.add_argument("--prompts", help="prompt file: run the batch engine on it instead of serving HTTP")
  add_model_args(p, default="tiny")
  add_sampling_args(p, "HTTP: caps max_tokens of a request that omits it (default: the context its prompt "
                       "leaves); prompt file: new tokens per prompt (default 32)")
  p.add_argument("--default-max-tokens", dest="max_tokens", type=int, help=argparse.SUPPRESS)  # old name
  p.add_argument("--dense", action="store_true", help="dense attention (every head, every page)")
  p.add_argument("--lserve", action="store_true", help="LServe sparse attention (the HTTP server's "
                 "default is dense; the prompt-file mode's is LServe)")
  p.add_argument("--api-key", default=None,
                 help="Bearer token every /v1 route requires (default: $JAXSYS_API_KEY; unset: open)")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--max-pending", type=int, default=256,
                 help="sequences (a request counts its n) queued or running before new ones get 503")
  p.add_argument("--max-n", type=int, default=16,
                 help="largest n (choices per request) a client may ask for; more is a 400")
  p.add_argument("--mesh", default=None, metavar="model=N",
                 help="tensor-parallel serving over N devices (weights and KV pages by kv head); "
                      "num_kv_heads must be a multiple of N")
  p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                 help="abort a request (and free its pages) this long after it arrives: 408, or an "
                      "error event on a stream (default: no deadline)")
  p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                 help="token budget of one engine step (decode tokens + prefill chunks)")
  p.add_argument("--no-prefix-caching", action="store_true")
  p.add_argument("--budget", type=int, default=4096, help="token budget of retrieval heads")
  p.add_argument("--page-size", type=int, default=64)
  p.add_argument("--logical-page", type=int, default=16)
  p.add_argument("--reuse", type=int, default=4, help="decode steps a page selection is reused")
  p.add_argument("--sink-pages", type=int, default=1,
                 help="leading pages every retrieval-head selection keeps (the attention sink)")
  p.add_argument("--sink", type=int, default=64)
  p.add_argument("--window", type=int, default=256)
  p.add_argument("--prefill-sink", type=int, default=None, help="streaming heads' sink in prefill "
                 "(default: --sink)")
  p.add_argument("--prefill-window", type=int, default=None, help="streaming heads' local window in "
                 "prefill (default: --window)")
  p.add_argument("--prefill-dense-tail", type=int, default=None,
                 help="last prompt tokens whose streaming heads attend to the whole prompt in prefill "
                      "(default: LServeConfig's)")
  p.add_argument("--gates", help="streaming gates JSON (from identify_streaming_heads)")
  p.add_argument("--kv-int8", action="store_true", help="int8 KV pages with per-token scales")
  p.add_argument("--max-batch", type=int, default=4)
  p.add_argument("--num-pages", type=int, default=512)
  p.add_argument("--max-seq-len", type=int, default=None,
                 help="prompt + new tokens of a request (default: the pool, num-pages x page-size; "
                      "never beyond the model's context length)")
  p.add_argument("--out", help="write JSON lines here instead of stdout")
  p.add_argument("--progress", action="store_true")
  return p


def read_prompts(path) -> tuple[list[list[int]], list[int | None]]:
  """Token-id prompts and optional per-prompt ``max_new_tokens`` from a prompt file."""
  path = Path(path)
  if not path.exists():
    raise InputError(f"--prompts file {str(path)!r} does not exist")
  prompts, news = [], []
  for n, line in enumerate(path.read_text().splitlines(), 1):
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    try:
      obj = json.loads(line) if line[0] in "[{" else [int(t) for t in line.split()]
    except ValueError as e:
      raise InputError(f"{path}:{n}: cannot parse prompt ({e})") from e
    if isinstance(obj, dict):
      if "tokens" not in obj:
        raise InputError(f"{path}:{n}: a JSON object prompt needs a 'tokens' list")
      news.append(obj.get("max_new_tokens"))
      obj = obj["tokens"]
    else:
      news.append(None)
    prompts.append([int(t) for t in obj])
  if not prompts:
    raise InputError(f"--prompts file {str(path)!r} holds no prompt")
  return prompts, news


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if not args.prompts and (msg := missing_extra("jaxsys serve", SERVE_MODULES, "serve")):
    print(f"jaxsys serve: error: {msg}", file=sys.stderr)
    return 2
  from jaxsys.serving.engine import ServingEngine, ServingConfig
  from jaxsys.serving.lserve import LServeConfig
  from jaxsys.serving.streaming import StreamingGates
  try:
    prompts, news = read_prompts(args.prompts) if args.prompts else (None, None)
    dense = args.dense or (prompts is None and not args.lserve)
    ls = LServeConfig(dense=dense, page_size=args.page_size, logical_page_size=args.logical_page,
                      token_budget=args.budget, reuse_steps=args.reuse, sink=args.sink,
                      window=args.window, kv_int8=args.kv_int8, prefill_sink=args.prefill_sink,
                      prefill_window=args.prefill_window, sink_pages=args.sink_pages,
                      **({} if args.prefill_dense_tail is None
                         else {"prefill_dense_tail": args.prefill_dense_tail}))
    cfg = ServingConfig(lserve=ls, max_batch=args.max_batch, num_pages=args.num_pages,
                       max_seq_len=args.num_pages * args.page_size if args.max_seq_len is None
                       else args.max_seq_len, max_num_batched_tokens=args.max_num_batched_tokens,
                       prefix_caching=not args.no_prefix_caching)
    if prompts is None and not 0 <= args.port <= 65535:
      raise ConfigError(f"--port {args.port} must be in [0, 65535]")
    streaming = None
    if args.gates and not dense:
      gates = StreamingGates.load(args.gates)
      if (gates.sink, gates.window) != (args.sink, args.window):
        print(f"note: gates were learned with sink={gates.sink}, window={gates.window}",
              file=sys.stderr)
      streaming = gates.streaming
    mesh = None
    if args.mesh:
      from jaxsys.core.mesh import make_mesh, parse_axes  # noqa: PLC0415
      mesh = make_mesh(parse_axes(args.mesh))
    model, tokenizer = load_model(args.model, args.dtype)
    engine = ServingEngine(model, cfg, streaming=streaming, tokenizer=tokenizer, mesh=mesh)
    if prompts is None:
      return _serve_http(engine, args)
    sampling = sampling_params(args)
    default_new = 32 if args.max_tokens is None else args.max_tokens
    max_new = [default_new if m is None else int(m) for m in news]
    res = engine.generate(prompts, max_new, sampling=sampling, progress=args.progress)
  except (ConfigError, InputError) as e:
    print(f"jaxsys serve: error: {e}", file=sys.stderr)
    return 2
  lines = [json.dumps({"index": i, "tokens": res.tokens[i], "finished": res.finished[i],
                       "error": res.errors[i]}) for i in range(len(prompts))]
  text = "\n".join(lines) + "\n"
  if args.out:
    Path(args.out).write_text(text)
  else:
    sys.stdout.write(text)
  mode = "dense" if dense else f"lserve(budget={args.budget})"
  print(f"served {len(prompts)} prompts ({sum(e is not None for e in res.errors)} rejected), {mode}: "
        f"{res.decode_tokens} decode tokens in {res.decode_seconds:.2f}s "
        f"({res.decode_tokens_per_second:.1f} tok/s), prefill {res.prefill_seconds:.2f}s",
        file=sys.stderr)
  return 0


def _serve_http(engine, args) -> int:
  import logging  # noqa: PLC0415
  import os  # noqa: PLC0415
  from jaxsys.serving.openai_server import serve  # noqa: PLC0415
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  mode = "dense" if engine.config.lserve.dense else f"lserve(budget={args.budget})"
  logging.getLogger("jaxsys.serving.server").info(
      "serving %s (%s) on http://%s:%d/v1", args.model, mode, args.host, args.port)
  defaults = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop")
              if getattr(args, k) is not None}
  return serve(engine, args.model, host=args.host, port=args.port, max_pending=args.max_pending,
               default_max_tokens=args.max_tokens, max_n=args.max_n, request_timeout=args.request_timeout,
               defaults=defaults, system=args.system, api_key=args.api_key or os.environ.get("JAXSYS_API_KEY") or None)


if __name__ == "__main__":
  sys.exit(main())
