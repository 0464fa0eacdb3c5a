"""``jaxsys gates``: learns DuoAttention streaming-head gates for a model and writes the gates file.

The gates (``streaming.identify_streaming_heads``: the frozen model's final hidden states on the
answer tokens of passkey sequences, distilled into a per-kv-head mix of full and sink + local
attention) go to ``--out`` as our JSON (what ``jaxsys serve --lserve --gates`` reads) and, with
``--tsv``, in DuoAttention's ``full_attention_heads.tsv`` format::

  jaxsys gates --model smollm2-135m-instruct --out gates.json --length 1024 --steps 40
  jaxsys serve --model smollm2-135m-instruct --lserve --gates gates.json

``--method attention`` ranks the heads instead by the attention mass they put outside the sink and
window at the answer states (``streaming.rank_streaming_heads``: forward passes only, so documents
as long as the contexts to serve are affordable)::

  jaxsys gates --model smollm2-135m-instruct --out gates.json --method attention --length 8100 --examples 4

Distillation data: with a tokenizer (a named model, a GGUF file, an HF checkpoint with one) the
text passkey task of ``jaxsys.data.passkey_text`` ("... The pass key is K ..." in filler, then
"What is the pass key? The pass key is K"), the answer being K's tokens; without one (``tiny``,
``random``) the token-level ``passkey`` task of ``jaxsys.data.synthetic``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from jaxsys.core.errors import ConfigError, InputError, check_min, check_range

__all__ = ["build_parser", "distillation_data", "main"]


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxsys gates", description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="tiny",
                 help="smollm2-135m-instruct | a .gguf file | tiny | random | HF checkpoint dir")
  p.add_argument("--out", required=True, help="gates JSON to write")
  p.add_argument("--tsv", help="also write DuoAttention's full_attention_heads.tsv here")
  p.add_argument("--method", choices=("distill", "attention"), default="distill",
                 help="distill: DuoAttention's gate distillation; attention: rank heads by their "
                      "attention outside sink + window at the answer tokens (forward only)")
  p.add_argument("--steps", type=int, default=100, help="distillation steps")
  p.add_argument("--length", type=int, default=1024, help="tokens per distillation sequence")
  p.add_argument("--examples", type=int, default=32, help="distillation sequences")
  p.add_argument("--batch-size", type=int, default=1)
  p.add_argument("--sparsity", type=float, default=0.5, help="fraction of kv heads made streaming")
  p.add_argument("--sink", type=int, default=64)
  p.add_argument("--window", type=int, default=256)
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--l1", type=float, default=0.05, help="L1 penalty on the gates")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-progress", action="store_true")
  return p


def distillation_data(n: int, length: int, seed: int = 0, tokenizer=None, task: str = "passkey"):
  """``(examples, (tokens int32[n, T], answer_mask bool[n, T]))``: the mask marks the positions
  whose next token is an answer token (the states that must recall the distant needle).

  With a tokenizer the sequences are text passkey documents of about ``length`` tokens and the
  examples are ``(prompt ids, answer ids)``; without one, ``synthetic.examples(task, ...)``."""
  check_min(argparse.Namespace(n=n, length=length), 1, "n", "length")
  if tokenizer is None:
    from jaxsys.data import synthetic  # noqa: PLC0415
    exs = synthetic.examples(task, seed, n, length)
    pairs = [(list(e.prompt), list(e.answer)) for e in exs]
  else:
    exs = pairs = _text_passkey(tokenizer, length, range(seed, seed + n))
  t = max(len(p) + len(a) for p, a in pairs)
  tokens = np.zeros((n, t), np.int32)
  mask = np.zeros((n, t), bool)
  for i, (p, a) in enumerate(pairs):
    tokens[i, :len(p) + len(a)] = p + a
    mask[i, len(p) - 1:len(p) + len(a) - 1] = True  # [n, T]: states that predict the answer
  return exs, (tokens, mask)


def _text_passkey(tokenizer, length: int, seeds) -> list[tuple[list[int], list[int]]]:
  from jaxsys.data import passkey_prompts  # noqa: PLC0415
  return [(prompt, tokenizer.encode(" " + key, add_special_tokens=False))
          for prompt, key in passkey_prompts(tokenizer, length, seeds)]


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    check_min(args, 1, "steps", "length", "examples", "batch_size", "window")
    check_min(args, 0, "sink")
    check_range("sparsity", args.sparsity, 0.0, 1.0)
    from jaxsys.serving.cli import load_model  # noqa: PLC0415
    from jaxsys.serving.streaming import identify_streaming_heads, rank_streaming_heads  # noqa: PLC0415
    model, tokenizer = load_model(args.model)
    _, data = distillation_data(args.examples, args.length, args.seed, tokenizer)
    mc = model.config
    how = f"{args.steps} steps" if args.method == "distill" else "attention outside sink + window"
    print(f"learning gates for {args.model}: {mc.num_layers} layers x {mc.num_kv_heads} kv heads, "
          f"{args.examples} sequences of {data[0].shape[1]} tokens, {how}", file=sys.stderr)
    t0 = time.perf_counter()
    if args.method == "attention":
      gates = rank_streaming_heads(model, data, sink=args.sink, window=args.window,
                                   sparsity=args.sparsity, progress=not args.no_progress)
    else:
      gates = identify_streaming_heads(model, data, sink=args.sink, window=args.window,
                                       sparsity=args.sparsity, steps=args.steps, lr=args.lr,
                                       l1=args.l1, batch_size=args.batch_size, seed=args.seed,
                                       progress=not args.no_progress)
  except (ConfigError, InputError) as e:
    print(f"jaxsys gates: error: {e}", file=sys.stderr)
    return 2
  gates.save(args.out)
  if args.tsv:
    gates.save_tsv(args.tsv)
  n_stream = int(np.sum(gates.streaming))
  print(f"wrote {args.out}{' and ' + args.tsv if args.tsv else ''}: {n_stream} of "
        f"{np.size(gates.streaming)} kv heads streaming (sparsity {args.sparsity}), "
        + (f"distillation loss {gates.history[0]:.4g} -> {gates.history[-1]:.4g}, " if gates.history else "")
        + f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
