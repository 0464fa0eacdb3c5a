"""Synthetic tasks: determinism, formats, rewards, training batches, tokenizer."""

import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.data import synthetic as S

V = S.VOCAB


@pytest.mark.parametrize("task", S.TASKS)
def test_deterministic_and_in_vocab(task):
  a = S.examples(task, seed=3, count=5, length=96)
  b = S.examples(task, seed=3, count=5, length=96)
  c = S.examples(task, seed=4, count=5, length=96)
  assert a == b and a != c
  for e in a:
    assert e.answer[-1] == V.eos and all(0 <= t < V.size for t in e.tokens)
    if task in ("recall", "passkey", "copy"):
      assert abs(len(e.tokens) - 96) <= 1


def test_recall_answer_is_the_value_of_the_queried_key():
  for e in S.examples("recall", seed=0, count=20, length=64, n_keys=6):
    body = list(e.prompt)
    key = body[-1]
    first = body.index(key)  # the key's first occurrence is its needle
    assert e.answer[0] == body[first + 1]
    assert S.reward(e, [body[first + 1], V.eos]) == 1.0
    assert S.reward(e, [V.value0 + (body[first + 1] - V.value0 + 1) % 32]) == 0.0


def test_passkey_and_arith_rewards():
  e = S.examples("passkey", seed=1, count=1, length=80, n_needles=3)[0]
  k = e.prompt[-1]
  i = e.prompt.index(k)
  assert list(e.answer[:-1]) == list(e.prompt[i + 1:i + 5])
  for ex in S.examples("arith", seed=2, count=30, length=16, max_digits=2):
    p = S.detokenize(ex.prompt).split()
    op = "+" if "+" in p else "-"
    j = p.index(op)
    a, b = int("".join(p[2:j])), int("".join(p[j + 1:-1]))
    want = a + b if op == "+" else a - b
    assert S.reward(ex, V.digits(want) + [V.eos]) == 1.0
    assert S.reward(ex, V.digits(want)) == 1.0             # cut before EOS still counts
    assert S.reward(ex, V.digits(want + 1) + [V.eos]) == 0.0


def test_training_batch_masks_answers_only():
  b = S.training_batch({"recall": 1.0}, seed=0, step=5, batch_size=4, length=64,
                       task_kwargs={"recall": {"n_keys": 4, "n_queries": 3}})
  assert b["tokens"].shape == (4, 64) and b["loss_mask"].shape == (4, 64)
  assert np.all(b["loss_mask"].sum(1) == 4)  # 3 values + eos
  assert np.all(np.isin(b["tokens"][b["loss_mask"] > 0], np.r_[V.value0:V.value0 + 32, V.eos]))
  again = S.training_batch({"recall": 1.0}, seed=0, step=5, batch_size=4, length=64,
                           task_kwargs={"recall": {"n_keys": 4, "n_queries": 3}})
  np.testing.assert_array_equal(b["tokens"], again["tokens"])
  with pytest.raises(ConfigError, match="length"):
    S.make_example("recall", np.random.default_rng(0), 10, n_keys=8)
  with pytest.raises(ConfigError, match="task"):
    S.make_example("sort", np.random.default_rng(0), 10)


def test_tokenizer_round_trip(tmp_path):
  pytest.importorskip("tokenizers")
  from transformers import AutoTokenizer
  S.save_tokenizer(tmp_path)
  tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
  e = S.examples("recall", seed=0, count=1, length=32, n_keys=2)[0]
  text = S.detokenize(e.prompt)
  assert tok(text, add_special_tokens=False)["input_ids"] == list(e.prompt)
  assert tok.decode(list(e.answer)) == S.detokenize(e.answer)


def test_copy_length_range_varies_the_copy_distance():
  exs = S.examples("copy", seed=0, count=40, length=96, n=(4, 200))
  lengths = {len(e.answer) - 1 for e in exs}
  assert len(lengths) > 10 and min(lengths) >= 4 and max(lengths) <= (96 - 4) // 2
  for e in exs:
    assert list(e.answer[:-1]) == list(e.prompt[2:-1])  # the answer repeats the sequence
  with pytest.raises(ConfigError, match="copy n"):
    S.examples("copy", seed=0, count=1, length=20, n=(10, 50))  # low above (20 - 4) // 2


def test_passkey_text_hides_one_key_at_the_requested_depth():
  from jaxsys.data import PASSKEY_FILLER, passkey_text
  doc, key = passkey_text(3, 10, depth=0.3)
  assert passkey_text(3, 10, depth=0.3) == (doc, key) and len(key) == 5 and key.isdigit()
  assert doc.count(key) == 2 and doc.count(PASSKEY_FILLER) == 10
  before = doc.split("The pass key is")[0]
  assert before.count(PASSKEY_FILLER) == 3
  assert passkey_text(4, 10)[1] != key
  with pytest.raises(ConfigError, match="depth"):
    passkey_text(0, 4, depth=1.5)
