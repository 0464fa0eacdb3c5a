"""``jaxsys finetune``: supervised fine-tuning of a decoder LM on a chat file, then export.

::

  jaxsys finetune --model smollm2-135m-instruct --data chats.jsonl --out tuned \\
      [--lora r=16,alpha=32] [--mesh data=4,model=2 --rules fsdp] [--steps 200] [--lr 1e-4]
  jaxsys chat --model tuned/hf

``--data``: one ``{"messages": [...]}`` chat per line (``jaxsys.models.llm.sft``: the loss is on
assistant turns only; a malformed line stops the run with its line number and field). Chats are
packed into ``--seq-len`` rows; ``--batch-size`` rows per step.

Run folder ``--out``:

* ``work/``: orbax checkpoints every ``--checkpoint-every`` steps and ``metrics.jsonl``; running
  the same command again (after an interruption) resumes from the newest intact checkpoint;
  changing ``--steps`` or ``--lr`` against a checkpoint is refused (it would change the schedule);
* ``hf/``: the tuned model (LoRA adapters merged) as a Hugging Face folder with its tokenizer
  files (``AutoModelForCausalLM`` / ``AutoTokenizer`` load it; so do ``jaxsys chat/serve``);
* ``adapters/`` (with ``--lora``): the adapters alone as a PEFT folder (``adapter_model.safetensors``
  + ``adapter_config.json``), for the base model;
* ``model.gguf`` (``--gguf-dtype``, ``none`` to skip): the same weights for llama.cpp, with the
  source GGUF's tokenizer when the model came from one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.serving.cli_common import add_model_args

__all__ = ["build_parser", "main"]

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0", "none")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxsys finetune", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=__doc__.split("\n\n", 1)[1])
  add_model_args(p, default="smollm2-135m-instruct")
  p.add_argument("--data", required=True, help="JSONL file: one {\"messages\": [...]} chat per line")
  p.add_argument("--out", required=True, help="run folder (checkpoints, metrics, exported model)")
  p.add_argument("--lora", default=None, metavar="SPEC",
                 help="train LoRA adapters only, e.g. r=16,alpha=32[,targets=REGEX] (default: full fine-tuning)")
  p.add_argument("--freeze", action="append", default=[], metavar="REGEX",
                 help="freeze the parameters whose path matches (repeatable), e.g. '^embed_tokens'")
  p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
  p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
  p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
  p.add_argument("--batch-size", type=int, default=8, help="packed rows per step (default 8)")
  p.add_argument("--seq-len", type=int, default=512, help="tokens per packed row (default 512)")
  p.add_argument("--seed", type=int, default=0, help="data order and adapter initialisation")
  p.add_argument("--mesh", default=None, metavar="AXES", help="e.g. data=4,model=2 (default: one device)")
  p.add_argument("--rules", default="fsdp", choices=("fsdp", "tp"), help="placement on --mesh (default fsdp)")
  p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50)")
  p.add_argument("--gguf-dtype", default="f16", choices=GGUF_DTYPES, help="GGUF export encoding (default f16)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p


def _mesh(text):
  if text is None:
    return None
  import jax

  from jaxsys.core.mesh import parse_axes
  axes = parse_axes(text)
  need = 1
  for size in axes.values():
    need *= size
  if need != jax.device_count():
    raise ConfigError(f"--mesh {text} needs {need} devices, this host has {jax.device_count()}")
  return jax.make_mesh(tuple(axes.values()), tuple(axes))


def run(args) -> dict:
  from jaxsys.models.llm import sft
  from jaxsys.models.llm.interop.gguf import save_gguf
  from jaxsys.models.llm.interop.hf import save_lora_adapters, save_pretrained
  from jaxsys.nn.lora import LoRAConfig, merge_lora
  from jaxsys.serving.cli_common import load_model
  from jaxsys.train import TrainConfig
  chats = sft.read_chats(args.data)           # before the model loads: a bad line fails fast
  lora = LoRAConfig.parse(args.lora) if args.lora else None
  cfg = TrainConfig(learning_rate=args.lr, total_steps=args.steps,
                    warmup_steps=max(args.steps // 10, 1) if args.warmup is None else args.warmup,
                    checkpoint_every=args.checkpoint_every, log_every=max(1, min(10, args.steps // 10)),
                    rules=args.rules, freeze=tuple(args.freeze))
  mesh = _mesh(args.mesh)
  model, tokenizer = load_model(args.model, args.dtype)
  if tokenizer is None:
    raise InputError(f"--model {args.model} has no tokenizer: fine-tuning on chats needs its chat template")
  out = Path(args.out)
  res, data = sft.finetune(model, tokenizer, chats, cfg, seq_len=args.seq_len, batch_size=args.batch_size,
                           seed=args.seed, lora=lora, mesh=mesh, workdir=out / "work",
                           progress=not args.no_progress)
  if lora is not None:  # the adapters alone first (PEFT folder), then merged into the weights
    save_lora_adapters(model, out / "adapters", base_model=str(args.model))
  merged = merge_lora(model)
  save_pretrained(model, out / "hf", tokenizer=tokenizer)
  if args.gguf_dtype != "none":
    source = args.model if str(args.model).endswith(".gguf") else _source_gguf(args.model)
    save_gguf(model, out / "model.gguf", args.gguf_dtype, tokenizer=source)
  summary = {"chats": data.chats, "rows": len(data.tokens), "target_tokens": data.targets,
             "steps": res.step, "first_loss": res.history[0]["loss"] if res.history else None,
             "last_loss": res.history[-1]["loss"] if res.history else None,
             "lora_merged": merged, "out": str(out)}
  (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
  return summary


def _source_gguf(name: str):
  from jaxsys.models.llm.interop.pretrained import MODELS, find
  return find(name) if name in MODELS else None


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    summary = run(args)
  except (ConfigError, InputError) as e:
    print(f"jaxsys finetune: error: {e}", file=sys.stderr)
    return 2
  loss = ("no step left to run (the checkpoint is at the last step)" if summary["last_loss"] is None
          else f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
  print(f"fine-tuned {summary['steps']} steps on {summary['chats']} chats ({summary['target_tokens']} "
        f"target tokens): {loss}; wrote {summary['out']}/hf"
        + ("" if args.gguf_dtype == "none" else f" and {summary['out']}/model.gguf"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
