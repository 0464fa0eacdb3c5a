"""Draft trees: selection of the best nodes, tree attention mask and positions.

A draft tree for one sequence has ``T`` nodes; node 0 is the *root*, the last committed token
whose KV is not yet in the cache (the token vanilla decoding would feed next). Node ``i`` has
``parents[i] < i`` (``-1`` for the root) and ``depth[i]`` (root 0). Verifying the tree is one
target forward over the ``T`` nodes placed at cache slots ``L .. L+T-1`` (``L`` = committed
length) with

* positions ``L + depth[i]`` (RoPE sees each node where it would sit on its own path), and
* visibility ``key j < L`` (the committed prefix) or ``key L+m`` with ``m`` an ancestor-or-self
  of node ``i`` (SpecInfer / Medusa tree attention).

Tree drafting (EAGLE-2): expand the top-k children per depth, score every candidate by its
cumulative draft log-probability and keep the ``verify_tokens - 1`` best. Because a child's
score never exceeds its parent's and ``lax.top_k`` prefers the lower index on ties (parents
are listed before children), the kept set is always a connected tree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxsys.ops.masks import TreeMask  # noqa: F401  (defined in ops: the decoding core uses it too)

__all__ = [
    "ancestor_matrix", "chain_tree", "children_table", "select_tree", "Tree", "tree_positions", "TreeMask",
]


class Tree(NamedTuple):
  """One draft tree per sequence (leading batch axes allowed)."""
  tokens: Any   # int32 [T]: node tokens (node 0 = root)
  parents: Any  # int32 [T]: parent node, -1 for the root
  depth: Any    # int32 [T]: root 0
  vis: Any      # bool [T, T]: vis[i, j] = node j is an ancestor of node i or i itself
  q: Any        # float32 [T, vocab]: the proposal each node was drawn from (row 0 unused)


def ancestor_matrix(parents, max_depth: int):
  """``(vis bool[T, T], depth int32[T])`` from ``parents int[T]`` (tree height <= max_depth)."""
  t = parents.shape[-1]
  rows = jnp.arange(t)
  vis = jnp.eye(t, dtype=bool)
  depth = jnp.zeros((t,), jnp.int32)
  cur = parents
  for _ in range(max_depth):
    has = cur >= 0
    vis = vis.at[rows, jnp.where(has, cur, 0)].max(has)
    depth = depth + has.astype(jnp.int32)
    cur = jnp.where(has, parents[jnp.where(has, cur, 0)], -1)
  return vis, depth


def chain_tree(root, tokens, q):
  """A chain: ``root -> tokens[0] -> tokens[1] ...``; ``q [D, vocab]`` the proposals."""
  d = tokens.shape[-1]
  parents = jnp.arange(-1, d, dtype=jnp.int32)
  vis = jnp.tril(jnp.ones((d + 1, d + 1), bool))
  depth = jnp.arange(d + 1, dtype=jnp.int32)
  q = jnp.concatenate([jnp.zeros_like(q[:1]), q], axis=0)
  return Tree(jnp.concatenate([root[None], tokens]).astype(jnp.int32), parents, depth, vis, q)


def select_tree(root, cand_tokens, cand_parents, cand_scores, cand_q, num_nodes: int,
                max_depth: int) -> Tree:
  """Keeps the ``num_nodes - 1`` best candidates (by cumulative log-prob) under the root.

  Args:
    root: int32 scalar, the root token.
    cand_tokens: int32 ``[C]``; candidates listed parents-first.
    cand_parents: int32 ``[C]``: index of the parent candidate, -1 for children of the root.
    cand_scores: float32 ``[C]``: cumulative draft log-probability (non-increasing along paths).
    cand_q: float32 ``[C, vocab]``: proposal each candidate was drawn from.
    num_nodes: ``T`` (verify tokens, root included), ``2 <= T <= C + 1``.
  """
  c = cand_tokens.shape[-1]
  _, keep = jax.lax.top_k(cand_scores, num_nodes - 1)
  keep = jnp.sort(keep)  # candidate order = parents before children
  node_of_cand = jnp.full((c,), -1, jnp.int32).at[keep].set(jnp.arange(1, num_nodes, dtype=jnp.int32))
  cp = cand_parents[keep]
  parents = jnp.where(cp < 0, 0, node_of_cand[jnp.maximum(cp, 0)])
  parents = jnp.concatenate([jnp.array([-1], jnp.int32), parents.astype(jnp.int32)])
  tokens = jnp.concatenate([root[None].astype(jnp.int32), cand_tokens[keep].astype(jnp.int32)])
  vis, depth = ancestor_matrix(parents, max_depth)
  q = jnp.concatenate([jnp.zeros_like(cand_q[:1]), cand_q[keep]], axis=0)
  return Tree(tokens, parents, depth, vis, q)


def tree_positions(depth, length):
  """RoPE positions ``length + depth`` of the tree nodes (``int32 [..., T]``)."""
  return (jnp.asarray(length)[..., None] + depth).astype(jnp.int32)


def children_table(parents, max_children: int):
  """``int32 [T, max_children]``: children of each node in node order, -1 padded."""
  t = parents.shape[-1]
  is_child = parents[None, :] == jnp.arange(t)[:, None]  # [node, candidate child]
  # Stable order: sort child indices (non-children pushed to the end).
  key = jnp.where(is_child, jnp.arange(t)[None, :], t)
  order = jnp.sort(key, axis=-1)[:, :max_children]
  return jnp.where(order < t, order, -1).astype(jnp.int32)
