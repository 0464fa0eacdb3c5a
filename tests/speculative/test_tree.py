"""Tree selection, ancestor mask and positions vs a naive pointer-walking construction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.ops import attention
from jaxsys.speculative import tree as tree_lib


def naive_tree(parents):
  t = len(parents)
  vis = np.zeros((t, t), bool)
  depth = np.zeros(t, int)
  for i in range(t):
    j = i
    while j >= 0:
      vis[i, j] = True
      j = parents[j]
      if j >= 0:
        depth[i] += 1
  return vis, depth


def random_parents(rng, t):
  return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, t)], np.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ancestor_matrix_matches_naive(seed):
  rng = np.random.default_rng(seed)
  parents = random_parents(rng, 12)
  vis, depth = tree_lib.ancestor_matrix(jnp.asarray(parents), max_depth=11)
  nvis, ndepth = naive_tree(parents)
  np.testing.assert_array_equal(np.asarray(vis), nvis)
  np.testing.assert_array_equal(np.asarray(depth), ndepth)
  pos = tree_lib.tree_positions(depth, 7)
  np.testing.assert_array_equal(np.asarray(pos), 7 + ndepth)


def test_select_tree_keeps_best_connected_nodes():
  # A full 2-ary tree of depth 3 listed parents-first: 2 + 4 + 8 candidates.
  rng = np.random.default_rng(0)
  parents, scores, tokens = [], [], []
  level = [-1]
  base = {-1: 0.0}
  idx = 0
  for _ in range(3):
    nxt = []
    for par in level:
      lp = np.log(rng.dirichlet([1, 1]))
      for c in range(2):
        parents.append(par)
        scores.append(base[par] + lp[c])
        tokens.append(int(rng.integers(0, 50)))
        base[idx] = scores[-1]
        nxt.append(idx)
        idx += 1
    level = nxt
  parents, scores = np.array(parents, np.int32), np.array(scores, np.float32)
  q = jnp.zeros((len(parents), 50))
  t = tree_lib.select_tree(jnp.int32(99), jnp.asarray(tokens, jnp.int32), jnp.asarray(parents),
                           jnp.asarray(scores), q, num_nodes=7, max_depth=3)
  kept = np.sort(np.argsort(-scores, kind="stable")[:6])
  # Node i+1 is candidate kept[i]; its parent node is the node of the parent candidate.
  node_of = {int(c): i + 1 for i, c in enumerate(kept)}
  exp_parents = [-1] + [0 if parents[c] < 0 else node_of[int(parents[c])] for c in kept]
  np.testing.assert_array_equal(np.asarray(t.parents), exp_parents)
  np.testing.assert_array_equal(np.asarray(t.tokens), [99] + [tokens[c] for c in kept])
  nvis, ndepth = naive_tree(np.asarray(exp_parents))
  np.testing.assert_array_equal(np.asarray(t.vis), nvis)
  np.testing.assert_array_equal(np.asarray(t.depth), ndepth)


def test_select_tree_ties_keep_parents():
  # All scores equal (-inf and 0 ties): parents must still be selected before children.
  parents = jnp.array([-1, -1, 0, 0, 1, 1], jnp.int32)
  scores = jnp.array([0.0, -jnp.inf, 0.0, -jnp.inf, -jnp.inf, -jnp.inf])
  t = tree_lib.select_tree(jnp.int32(0), jnp.arange(6, dtype=jnp.int32), parents, scores,
                           jnp.zeros((6, 8)), num_nodes=5, max_depth=2)
  par = np.asarray(t.parents)
  assert all(par[i] < i for i in range(1, 5)) and par[0] == -1


def test_tree_mask_in_attention_matches_dense_reference():
  """TreeMask through jaxsys.ops.attention == explicit dense softmax over visible keys."""
  rng = np.random.default_rng(3)
  parents = random_parents(rng, 6)
  vis, _ = tree_lib.ancestor_matrix(jnp.asarray(parents), 5)
  prefix, cache = 5, 16
  q = jnp.asarray(rng.normal(size=(1, 6, 2, 4)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, cache, 1, 4)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(1, cache, 1, 4)), jnp.float32)
  mask = tree_lib.TreeMask(vis, prefix, prefix)
  out = attention(q, k, v, mask=mask, impl="reference")
  nvis, _ = naive_tree(parents)
  full = np.zeros((6, cache), bool)
  full[:, :prefix] = True
  full[:, prefix:prefix + 6] = nvis
  s = np.einsum("qhd,khd->hqk", np.asarray(q[0]), np.repeat(np.asarray(k[0]), 2, 1)) / 2.0
  s = np.where(full[None], s, -np.inf)
  pr = np.exp(s - s.max(-1, keepdims=True))
  pr /= pr.sum(-1, keepdims=True)
  ref = np.einsum("hqk,khd->qhd", pr, np.repeat(np.asarray(v[0]), 2, 1))
  np.testing.assert_allclose(np.asarray(out[0]), ref, rtol=1e-5, atol=1e-5)
  # Under vmap (one tree per sequence) the traced mask still works.
  f = jax.vmap(lambda qq, kk, vv, vs, st: attention(qq[None], kk[None], vv[None],
                                                      mask=tree_lib.TreeMask(vs, st, st))[0])
  out2 = f(q, k, v, vis[None], jnp.array([prefix]))
  np.testing.assert_allclose(np.asarray(out2), np.asarray(out), rtol=1e-5, atol=1e-5)


def test_children_table():
  parents = jnp.array([-1, 0, 0, 1, 2, 1], jnp.int32)
  kids = np.asarray(tree_lib.children_table(parents, 3))
  np.testing.assert_array_equal(kids, [[1, 2, -1], [3, 5, -1], [4, -1, -1], [-1] * 3, [-1] * 3, [-1] * 3])
