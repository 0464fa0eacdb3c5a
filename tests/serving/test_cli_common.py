"""One CLI surface: generate, chat and serve share --model and the sampling flags; chat advances its
seed per turn; a missing extra is one line naming it, before any model loads. No model runs here."""

import argparse
import importlib.util

import pytest

from jaxsys.core.errors import InputError
from jaxsys.serving import chat_cli, cli_common
from jaxsys.serving import cli as serve_cli

FLAGS = ["--model", "m.gguf", "--dtype", "bfloat16", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20",
         "--min-p", "0.05", "--seed", "3", "--stop", "\n\n", "--stop", "END", "--max-tokens", "40",
         "--system", "Be brief."]
SHARED = ("model", "dtype", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "max_tokens", "system")


def _sub_parser():
  parser = argparse.ArgumentParser()
  chat_cli.register_cli(parser.add_subparsers(dest="command"))
  return parser


def test_generate_chat_and_serve_take_the_same_flags():
  parser = _sub_parser()
  parsed = [parser.parse_args(["generate", *FLAGS, "hi"]), parser.parse_args(["chat", *FLAGS]),
            serve_cli.build_parser().parse_args(FLAGS)]
  want = {"model": "m.gguf", "dtype": "bfloat16", "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
          "seed": 3, "stop": ["\n\n", "END"], "max_tokens": 40, "system": "Be brief."}
  for args in parsed:
    assert {k: getattr(args, k) for k in SHARED} == want
  # the old spellings still parse
  assert parser.parse_args(["generate", "x", "--max-new-tokens", "8"]).max_tokens == 8
  assert serve_cli.build_parser().parse_args(["--default-max-tokens", "9"]).max_tokens == 9
  with pytest.raises(SystemExit):
    parser.parse_args(["generate", "x", "--max-tokens", "0"])


def test_sampling_params_system_and_per_turn_seed(monkeypatch, capsys):
  args = _sub_parser().parse_args(["chat", *FLAGS])
  s = cli_common.sampling_params(args, turn=2)
  assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 20, 0.05, 5)
  greedy = cli_common.sampling_params(_sub_parser().parse_args(["chat"]))
  assert greedy.greedy and greedy.seed == 0
  user = [{"role": "user", "content": "hi"}]
  assert cli_common.with_system(user, "S")[0] == {"role": "system", "content": "S"}
  assert cli_common.with_system(user, None) == user
  assert cli_common.with_system([{"role": "system", "content": "own"}], "S")[0]["content"] == "own"
  # chat: turn t samples with seed + t, and the system message leads the chat
  calls = []
  monkeypatch.setattr(chat_cli, "load_model", lambda name, dtype=None: ("model", "tok"))
  monkeypatch.setattr(chat_cli, "_reply", lambda model, tok, messages, args, stream=None, turn=0:
                      calls.append((turn, [m["role"] for m in messages])) or "ok")
  lines = iter(["first", "second", ""])
  monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
  assert chat_cli._cmd_chat(args) == 0
  assert calls == [(0, ["system", "user"]), (1, ["system", "user", "assistant", "user"])]


def test_missing_extra_is_one_line_before_any_model_loads(monkeypatch, capsys):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
  monkeypatch.setattr(serve_cli, "load_model", lambda *a: pytest.fail("the model loaded"))
  assert serve_cli.main(["--model", "smollm2-135m-instruct"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "uvicorn" in err and "pip install 'jaxsys[serve]'" in err


def test_bad_model_names_the_flag(tmp_path):
  with pytest.raises(InputError, match="--model .*nope.* is not a registered model"):
    cli_common.load_model(str(tmp_path / "nope"))
  with pytest.raises(InputError, match="no such .gguf file"):
    cli_common.load_model(str(tmp_path / "x.gguf"))
