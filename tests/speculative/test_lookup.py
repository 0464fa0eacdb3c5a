"""Lookup drafting (``jaxsys.speculative.lookup``): the match rule against a plain Python twin,
references and siblings, and greedy lookup decoding == vanilla token for token (batch 1 and 8,
no drafter model)."""

import dataclasses
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.speculative import lookup
from jaxsys.speculative.bandit import Strategy
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine

from .test_lossless_greedy import CFG, STOP, setup  # noqa: F401  (pytest fixture)

LOOK = Strategy.lookup_chain(3, ngram=3)


def _naive(seq, L, ref, n, depth):
  """Longest match (<= n tokens) ending before the root, latest on ties; the tokens after it."""
  hay = list(ref) + list(seq[:L + 1])
  end = len(ref) + L
  best = (0, -1)
  for j in range(end):
    m = 0
    while m < n and j - m >= 0 and m <= L and hay[j - m] >= 0 and hay[j - m] == hay[end - m]:
      m += 1
    best = max(best, (m, j))
  m, j = best
  has = m >= min(lookup.MIN_MATCH, n)
  cont = [hay[j + 1 + i] if has and j + 1 + i <= end and hay[j + 1 + i] >= 0 else seq[L]
          for i in range(depth)]
  return has, cont


@pytest.mark.parametrize("ngram,depth", [(1, 2), (2, 4), (3, 3), (4, 5)])
def test_lookup_draft_matches_python_twin(ngram, depth):
  rng = np.random.default_rng(ngram)
  b, s, r = 16, 24, 12
  seq = rng.integers(0, 5, (b, s)).astype(np.int32)      # a 5-token alphabet: many matches
  L = rng.integers(0, s - 1, b).astype(np.int32)
  ref = rng.integers(-1, 5, (b, r)).astype(np.int32)      # -1: padding / separators
  state = SimpleNamespace(seq=jnp.asarray(seq), ref=jnp.asarray(ref),
                          root=jnp.asarray(seq[np.arange(b), L]),
                          cache=SimpleNamespace(lengths=jnp.asarray(L)))
  trees, has = lookup.lookup_draft(state, Strategy.lookup_chain(depth, ngram), vocab=5)
  for i in range(b):
    want_has, want = _naive(seq[i], int(L[i]), ref[i], ngram, depth)
    assert bool(has[i]) == want_has, i
    assert trees.tokens[i].tolist() == [int(seq[i, L[i]])] + want, i
    np.testing.assert_array_equal(np.asarray(trees.q[i, 1:]).argmax(-1), want)
    assert trees.parents[i].tolist() == list(range(-1, depth))


def test_lookup_prefers_the_longest_then_the_latest_match():
  # The text ends "0 1 2" (root 2 at 11). "0 1 2" also occurs at 0..2 of the row's own history
  # (then "9 5") and in the reference (then "4 4"); "1 2" alone also at 5..6 (then "3 8").
  seq = np.array([[0, 1, 2, 9, 5, 1, 2, 3, 8, 0, 1, 2, 0, 0]], np.int32)
  L = np.array([11], np.int32)
  state = SimpleNamespace(seq=jnp.asarray(seq), root=jnp.asarray(seq[:, 11]),
                          ref=jnp.asarray([[-1, 0, 1, 2, 4, 4, -1]], jnp.int32),
                          cache=SimpleNamespace(lengths=jnp.asarray(L)))
  # Own "0 1 2" at 0..2 (continuation 9 5) is later in the haystack than the reference's.
  trees, has = lookup.lookup_draft(state, Strategy.lookup_chain(2, 3), vocab=10)
  assert bool(has[0]) and trees.tokens[0].tolist() == [2, 9, 5]
  trees, _ = lookup.lookup_draft(state, Strategy.lookup_chain(2, 2), vocab=10)
  assert trees.tokens[0].tolist() == [2, 3, 8]             # latest "1 2": positions 5..6


def test_build_references_joins_with_separators_and_keeps_the_newest():
  np.testing.assert_array_equal(lookup.build_references([[1, 2], [3]], 8), [-1, -1, -1, 1, 2, -1, 3, -1])
  np.testing.assert_array_equal(lookup.build_references([[1, 2, 3], [4, 5]], 4), [-1, 4, 5, -1])
  assert lookup.build_references([], 3).tolist() == [-1, -1, -1]
  assert lookup.build_references([[1]], 0).shape == (0,)


@pytest.fixture(scope="module")
def lookup_engines(setup):  # noqa: F811
  model, _, engine, prompts, ref = setup
  base = dict(strategies=(LOOK,), max_new=12, max_prompt=8, stop_tokens=(STOP,), lookup_ref=32)
  return RolloutEngine(model, None, RolloutConfig(**base, batch_buckets=(1, 4, 8), spec_threshold=5))


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_lookup_equals_vanilla_without_a_drafter(setup, lookup_engines, batch):  # noqa: F811
  _, _, _, prompts, ref = setup
  eng = lookup_engines
  res = eng.generate(prompts[:batch], force_strategy=LOOK)
  assert res.tokens == ref[:batch]
  # With the vanilla answers as references, most drafts are accepted: the round is exercised.
  res = eng.generate(prompts[:batch], force_strategy=LOOK, references=[[r] for r in ref[:batch]])
  assert res.tokens == ref[:batch]
  assert res.stats["mean_accepted"] > 1.0 and res.stats["spec_steps"] > 0


def test_lookup_long_tail_with_siblings_equals_vanilla(setup, lookup_engines):  # noqa: F811
  """Bandit-chosen lookup in the long tail after a shrink (references rebuilt with the finished
  rows of identical prompts): same tokens as vanilla."""
  _, _, _, prompts, ref = setup
  ps = prompts[:4] + prompts[:4]                            # every prompt twice: siblings
  res = lookup_engines.generate(ps)
  assert res.tokens == ref[:4] + ref[:4]
  assert res.stats["shrinks"] >= 1


def test_references_hold_the_prompts_references_then_finished_siblings(lookup_engines):
  eng = lookup_engines
  arrs = [np.array([1, 2]), np.array([3]), np.array([1, 2])]
  results = {2: ([7, 8, STOP], None, None), 1: ([9], None, None)}
  user = [[np.array([4, 4], np.int32)], [], []]
  got = eng._references(np.array([0, -1]), arrs, user, results)
  np.testing.assert_array_equal(got[0], lookup.build_references([[4, 4], [7, 8, STOP]], 32))
  assert (got[1] == -1).all()                               # a padding row


def test_lookup_errors(setup, lookup_engines):  # noqa: F811
  model, drafter, engine, prompts, _ = setup
  with pytest.raises(ConfigError, match="lookup strategy is a chain"):
    Strategy(3, 2, 4, lookup=3)
  with pytest.raises(ConfigError, match="lookup=-1"):
    Strategy(3, 1, 4, lookup=-1)
  with pytest.raises(ConfigError, match="lookup_ref=-1"):
    RolloutConfig(strategies=(LOOK,), lookup_ref=-1)
  with pytest.raises(ConfigError, match="needs a drafter"):
    RolloutEngine(model, None, RolloutConfig(strategies=(LOOK, Strategy.chain(3))))
  with pytest.raises(ConfigError, match="lookup_ref > 0"):
    engine.generate(prompts[:1], references=[[[1, 2]]])
  eng = lookup_engines
  with pytest.raises(InputError, match="references has 2 entries for 1 prompts"):
    eng.generate(prompts[:1], references=[[], []])
  with pytest.raises(InputError, match=r"references\[0\]\[1\] must be a 1-D sequence of token ids"):
    eng.generate(prompts[:1], references=[[[1], [CFG.vocab_size]]])
  assert Strategy.lookup_chain(4).name == "lookup(d=4,n=3)"


def test_lookup_arm_beside_eagle_arms_is_lossless(setup):  # noqa: F811
  """One engine with EAGLE and lookup arms (the bandit explores both in the per-step tail)."""
  model, drafter, engine, prompts, ref = setup
  cfg = dataclasses.replace(engine.config, strategies=engine.config.strategies + (LOOK,),
                            spec_threshold=5, batch_buckets=(1, 4, 8), epsilon=0.0, lookup_ref=16)
  eng = RolloutEngine(model, drafter, cfg, pool=engine.pool)
  seen = []
  for _ in range(len(cfg.strategies)):
    res = eng.generate(prompts)
    assert res.tokens == ref
    seen += res.stats["strategy"]
  assert LOOK.name in seen and set(seen) - {LOOK.name}
