"""Lossless acceptance on a toy 'model' made of fixed next-token distributions (a Markov chain).

The exact distribution of the first two generated tokens is known in closed form; speculative
sampling (tree with one-hot proposals, sampled chain) must match it, vanilla sampling must match
it, and an acceptor with a wrong residual rule must be caught by the same test.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxsys.core.errors import ConfigError
from jaxsys.decoding import sampling
from jaxsys.speculative import acceptance
from jaxsys.speculative import tree as tree_lib

V = 5
N = 20000
ALPHA = 1e-6  # false-alarm probability of each test

_rng = np.random.default_rng(0)
TARGET_LOGITS = jnp.asarray(_rng.normal(size=(V, V)) * 1.5, jnp.float32)   # [prev, next]
DRAFT_LOGITS = TARGET_LOGITS + jnp.asarray(_rng.normal(size=(V, V)), jnp.float32)  # a biased drafter
PARAMS = sampling.SamplingParams(temperature=0.8, top_k=4, top_p=0.95)


def exact_two_tokens(params, root):
  p = np.asarray(sampling.target_probs(TARGET_LOGITS, params), np.float64)
  return np.einsum("a,ab->ab", p[root], p).reshape(-1)


def draft_tree(root, depth=2, topk=2, nodes=5):
  """Deterministic top-k tree (one-hot proposals) from the draft table."""
  lp = jax.nn.log_softmax(DRAFT_LOGITS, -1)
  toks, pars, scores = [], [], []
  frontier = [(-1, root, 0.0)]
  for _ in range(depth):
    nxt = []
    for (ci, tok, sc) in frontier:
      top = jnp.argsort(-lp[tok])[:topk]
      for t in top:
        pars.append(ci)
        toks.append(t)
        scores.append(sc + lp[tok, t])
        nxt.append((len(toks) - 1, t, scores[-1]))
    frontier = nxt
  toks = jnp.stack(toks).astype(jnp.int32)
  q = jax.nn.one_hot(toks, V)
  return tree_lib.select_tree(root, toks, jnp.asarray(pars, jnp.int32), jnp.stack(scores), q,
                              num_nodes=nodes, max_depth=depth)


def draft_chain_sampled(key, root, depth=3):
  """A chain whose tokens are *sampled* from the drafter (non-degenerate q)."""
  qs, toks, tok = [], [], root
  for i in range(depth):
    q = jax.nn.softmax(DRAFT_LOGITS[tok] / 1.3)
    tok = sampling.sample_probs(jax.random.fold_in(key, i), q)
    qs.append(q)
    toks.append(tok)
  return tree_lib.chain_tree(root, jnp.stack(toks), jnp.stack(qs))


def two_tokens(key, mode, params, residual_fn=acceptance.residual):
  root = jnp.int32(2)
  k1, k2, k3 = jax.random.split(key, 3)
  if mode == "vanilla":
    t1 = sampling.sample(k1, TARGET_LOGITS[root], params)
    t2 = sampling.sample(k2, TARGET_LOGITS[t1], params)
    return t1 * V + t2
  if mode == "tree":
    tree, depth, kids = draft_tree(root), 2, 2
  else:
    tree, depth, kids = draft_chain_sampled(k3, root), 3, 1
  p = sampling.target_probs(TARGET_LOGITS[tree.tokens], params)  # [T, V]
  acc = acceptance.accept_tree(k1, tree, p, max_depth=depth, max_children=kids, residual_fn=residual_fn)
  t1 = acc.tokens[0]
  t2 = jnp.where(acc.n_accepted >= 1, acc.tokens[1], sampling.sample(k2, TARGET_LOGITS[t1], params))
  return t1 * V + t2


@functools.lru_cache(maxsize=None)
def counts(mode, params, residual_fn=acceptance.residual, seed=0):
  keys = jax.random.split(jax.random.key(seed), N)
  f = jax.jit(jax.vmap(functools.partial(two_tokens, mode=mode, params=params, residual_fn=residual_fn)))
  return np.bincount(np.asarray(f(keys)), minlength=V * V)


def chi2_pvalue(c, p):
  nz = p > 0
  assert c[~nz].sum() == 0, "a token with zero target probability was generated"
  exp = p[nz] * c.sum()
  stat = ((c[nz] - exp) ** 2 / exp).sum()
  return stats.chi2.sf(stat, df=nz.sum() - 1)


def tv_bound(k, n, alpha):
  # Bretagnolle-Huber-Carol: P(||emp - p||_1 >= eps) <= 2^k exp(-n eps^2 / 2).
  return 0.5 * np.sqrt(2 * (k * np.log(2) + np.log(1 / alpha)) / n)


@pytest.mark.parametrize("mode", ["vanilla", "tree", "chain_sampled"])
def test_speculative_sampling_matches_target_distribution(mode):
  p = exact_two_tokens(PARAMS, 2)
  c = counts(mode, PARAMS)
  assert chi2_pvalue(c, p) > ALPHA
  assert 0.5 * np.abs(c / N - p).sum() < tv_bound(int((p > 0).sum()), N, ALPHA)


def test_speculative_matches_vanilla_two_sample():
  cv, cs = counts("vanilla", PARAMS, seed=1), counts("tree", PARAMS)
  keep = (cv + cs) > 0
  _, pval, _, _ = stats.chi2_contingency(np.stack([cv[keep], cs[keep]]))
  assert pval > ALPHA
  assert 0.5 * np.abs(cv - cs).sum() / N < 2 * tv_bound(int(keep.sum()), N, ALPHA)


@pytest.mark.parametrize("mode", ["tree", "chain_sampled"])
def test_broken_acceptor_is_caught(mode):
  """Bonus drawn from p instead of the residual (a classic bug) over-weights drafted tokens."""
  p = exact_two_tokens(PARAMS, 2)
  c = counts(mode, PARAMS, residual_fn=lambda r, q: r)
  assert chi2_pvalue(c, p) < ALPHA


def test_greedy_acceptance_is_longest_matching_path():
  # Target argmax after token t is (t + 1) % V; the drafter proposes a tree; greedy must follow
  # exactly the matching children and emit the target argmax as the bonus.
  logits = jax.nn.one_hot((jnp.arange(V) + 1) % V, V) * 5.0
  parents = jnp.array([-1, 0, 0, 1, 2, 3], jnp.int32)
  tokens = jnp.array([0, 3, 1, 2, 2, 4], jnp.int32)  # path 0 -> 1 -> 2 matches, then 3 != 4
  vis, depth = tree_lib.ancestor_matrix(parents, 3)
  t = tree_lib.Tree(tokens, parents, depth, vis, jax.nn.one_hot(tokens, V))
  p = sampling.target_probs(logits[tokens], sampling.GREEDY)
  f = jax.jit(functools.partial(acceptance.accept_tree, max_depth=3, max_children=2))
  for seed in range(3):
    acc = f(jax.random.key(seed), t, p)
    assert int(acc.n_accepted) == 2
    np.testing.assert_array_equal(np.asarray(acc.path), [0, 2, 4, -1])
    np.testing.assert_array_equal(np.asarray(acc.tokens), [1, 2, 3, -1])


def test_batch_acceptance_matches_per_sequence():
  trees = jax.jit(jax.vmap(draft_tree))(jnp.arange(3, dtype=jnp.int32))
  p = sampling.target_probs(TARGET_LOGITS[trees.tokens], sampling.GREEDY)
  acc = jax.jit(functools.partial(acceptance.accept_batch, max_depth=2, max_children=2))(
      jax.random.key(0), trees, p)
  one_fn = jax.jit(functools.partial(acceptance.accept_tree, max_depth=2, max_children=2))
  for i in range(3):
    one = one_fn(jax.random.key(1), jax.tree.map(lambda a: a[i], trees), p[i])
    np.testing.assert_array_equal(np.asarray(acc.tokens[i]), np.asarray(one.tokens))


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p")])
def test_invalid_sampling_params(kwargs, field):
  with pytest.raises(ConfigError, match=field):
    sampling.SamplingParams(**kwargs)


def test_top_k_larger_than_vocab():
  with pytest.raises(ConfigError, match="top_k"):
    sampling.SamplingParams(top_k=10).check_vocab(V)


def test_target_probs_filters():
  logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
  p = np.asarray(sampling.target_probs(logits, sampling.SamplingParams(top_k=2)))
  np.testing.assert_allclose(p, [0.625, 0.375, 0, 0], atol=1e-6)
  p = np.asarray(sampling.target_probs(logits, sampling.SamplingParams(top_p=0.85)))
  np.testing.assert_allclose(p, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-6)
