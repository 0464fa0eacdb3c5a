"""Long-tailed verifiable chat tasks: exact verifiers with a format reward, heavy-tailed sizes,
chat-template prompts (the real SmolLM2 tokenizer where installed) and a GRPO step on them."""

import dataclasses

import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.rl import chat_tasks as ct, grpo


class CharTokenizer:
  """A byte-level chat tokenizer (ids 0..127, EOS 3) standing in for the real one."""
  eos_token_id = pad_token_id = 3

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
    text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
    return [ord(c) % 128 for c in text]

  def __call__(self, text):
    return {"input_ids": [ord(c) % 128 for c in text]}

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(i) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def _ex(kind, n=4, seed=0):
  return ct.make_example(kind, np.random.default_rng(seed), n)


def test_verifiers_and_format_reward():
  ex = dataclasses.replace(_ex("count"), answer=(3, 4, 5, 6))
  assert ct.score(ex, "Sure!\nAnswer: 3, 4, 5, 6")["reward"] == 1.0
  s = ct.score(ex, "Answer: 3, 4, 9, 6")
  assert (s["accuracy"], s["format"]) == (0.75, 1.0)
  assert s["reward"] == pytest.approx(0.9 * 0.75 + 0.1)
  assert ct.score(ex, "Answer: 3, 4, 5, 6, 7")["accuracy"] == pytest.approx(4 / 5)  # extra item
  trailing = ct.score(ex, "Answer: 3, 4, 5, 6\nHope this helps")  # not the final line
  assert (trailing["accuracy"], trailing["format"]) == (1.0, 0.0)
  assert trailing["reward"] == pytest.approx(0.9)
  assert ct.score(ex, "3, 4, 5, 6") == {"accuracy": 0.0, "format": 0.0, "reward": 0.0}
  assert ct.score(ex, "Answer: 3, 4, 5, 6\nAnswer: 1")["accuracy"] == 0.0  # the last Answer counts
  rep = dataclasses.replace(_ex("repeat"), answer=("cloud",) * 3)
  assert ct.score(rep, "answer: cloud cloud, cloud")["reward"] == 1.0
  assert ct.score(rep, "Answer: cloud cloud")["accuracy"] == pytest.approx(2 / 3)
  ar = dataclasses.replace(_ex("arith"), answer=(-18,))
  assert ct.score(ar, "1 + 8 = 9\nAnswer: -18")["reward"] == 1.0
  assert ct.score(ar, "Answer: 18")["reward"] == pytest.approx(0.1)  # format only
  assert ct.score(ex, "Answer: 3, 4, 9, 6", answer_weight=1, format_weight=0)["reward"] == 0.75
  assert ct.score(ex, "Answer: 0", answer_weight=0, format_weight=2)["reward"] == 1.0
  with pytest.raises(ConfigError, match="answer_weight"):
    ct.score(ex, "", answer_weight=0, format_weight=0)
  # every kind's worked reference is a perfect response, at any size
  rng = np.random.default_rng(1)
  for kind in ct.KINDS:
    for n in (1, 7, 30):
      ex = ct.make_example(kind, rng, n)
      assert ct.score(ex, ex.reference)["reward"] == 1.0, (kind, n, ex.reference)
      assert len(ex.answer) == (1 if kind == "arith" else n)
  sort = ct.make_example("sort", np.random.default_rng(2), 6)
  assert list(sort.answer) == sorted(sort.answer)
  assert sort.reference.count("\n") == 0 and ct.make_example("arith", rng, 5).reference.count("\n") == 5
  with pytest.raises(ConfigError, match="kind"):
    ct.make_example("poem", rng, 3)


def test_truncated_zipf_is_heavy_tailed():
  rng = np.random.default_rng(0)
  ns = np.array([ct.truncated_zipf(rng, 1.1, 2, 64) for _ in range(4000)])
  assert ns.min() >= 2 and ns.max() <= 64
  pmf = np.arange(2, 65, dtype=float) ** -1.1
  pmf /= pmf.sum()
  assert abs((ns == 2).mean() - pmf[0]) < 0.03  # P(n=2) as the law says (~0.19)
  assert np.median(ns) <= 10 and ns.max() >= 60  # most short, a few near the cap
  assert ct.truncated_zipf(np.random.default_rng(3), 2.0, 5, 5) == 5


def test_sampler_mixture_seeding_and_errors():
  tok = CharTokenizer()
  s = ct.ChatTaskSampler(tok, seed=0)
  exs = s.sample(300)
  assert {e.kind for e in exs} == set(ct.KINDS)
  arith = [e.n for e in exs if e.kind == "arith"]
  assert max(arith) <= 12 and all(2 <= e.n <= 64 for e in exs if e.kind != "arith")
  # prompts are the chat template of the user message, ending with the generation prompt
  e = exs[0]
  assert tok.decode(e.prompt).startswith("<user>" + e.messages[0]["content"])
  assert tok.decode(e.prompt).endswith("<assistant>")
  assert max(len(x.prompt) for x in exs) <= s.max_prompt
  assert max(len(x.reference) + 1 for x in exs) <= s.max_response
  assert [x.prompt for x in ct.ChatTaskSampler(tok, seed=4).sample(5)] == \
      [x.prompt for x in ct.ChatTaskSampler(tok, seed=4).sample(5)]
  only = ct.ChatTaskSampler(tok, kinds=("repeat",), mix=(1.0,), items=(3, 3))
  assert {(x.kind, x.n) for x in only.sample(5)} == {("repeat", 3)}
  assert s.reward_fn(e, tok(e.reference)["input_ids"] + [3]) == 1.0
  assert s.pad_id == 3 and s.stop_tokens == (3,)
  for kw, match in [({"kinds": ("poem",), "mix": (1.0,)}, "kinds"), ({"mix": (1.0,)}, "mix"),
                    ({"items": (0, 4)}, "items"), ({"steps": (5, 2)}, "steps"),
                    ({"zipf_a": -1.0}, "zipf_a"), ({"answer_weight": -1.0}, "answer_weight")]:
    with pytest.raises(ConfigError, match=match):
      ct.ChatTaskSampler(tok, **kw)


def test_grpo_trainer_runs_on_chat_tasks():
  from jaxsys.decoding.sampling import SamplingParams
  from jaxsys.models.llm.decoder import DecoderConfig, random_model
  from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
  tok = CharTokenizer()
  tasks = ct.ChatTaskSampler(tok, kinds=("count", "arith"), mix=(1.0, 1.0), items=(2, 4),
                             steps=(1, 2), seed=0)
  cfg = DecoderConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=256, eos_token_id=3)
  policy = random_model(cfg, 0)
  engine = RolloutEngine(policy, None, RolloutConfig(
      max_new=8, max_prompt=tasks.max_prompt, batch_buckets=(4,), stop_tokens=tasks.stop_tokens,
      sampling=SamplingParams(1.0), speculative=False))
  tr = grpo.GRPOTrainer(policy, engine, tasks, grpo.GRPOConfig(group_size=2, prompts_per_step=2,
                                                               minibatches=1),
                        reward_fn=tasks.reward_fn, pad_id=tasks.pad_id)
  m = tr.step()
  assert len(m["responses"]) == 4 and np.isfinite(m["loss"]) and 0.0 <= m["reward_mean"] <= 1.0


@pytest.fixture()
def smol_tok(smollm2_tokenizer):
  return smollm2_tokenizer


def test_smollm2_chat_template_and_reward(smol_tok):
  tasks = ct.ChatTaskSampler(smol_tok, seed=0)
  exs = tasks.sample(12)
  text = smol_tok.decode(list(exs[0].prompt))
  assert exs[0].messages[0]["content"] in text and text.rstrip().endswith("assistant")
  assert tasks.stop_tokens == (smol_tok.eos_token_id,) == (2,)  # <|im_end|>
  for e in exs[:4]:
    ids = smol_tok(e.reference)["input_ids"] + [smol_tok.eos_token_id]
    assert tasks.reward_fn(e, ids) == 1.0
    assert len(ids) <= tasks.max_response and len(e.prompt) <= tasks.max_prompt
  assert tasks.reward_fn(exs[0], smol_tok("I do not know.")["input_ids"]) == 0.0
  tokens, mask = grpo.build_batch(exs[:2], [[5, 6, 2], [7, 2]], tasks.max_prompt + 4, tasks.pad_id)
  assert mask.sum() == 5 and (tokens[1, len(exs[1].prompt) + 2:] == tasks.pad_id).all()


def test_example_is_a_frozen_dataclass():
  assert dataclasses.is_dataclass(ct.ChatExample)
  with pytest.raises(dataclasses.FrozenInstanceError):
    _ex("count").n = 3
