"""Lossless acceptance of a verified draft tree (pure functions on distributions).

Given, for every tree node ``i``, the target's processed next-token distribution ``p[i]``
(temperature / top-k / top-p already applied, see ``sampling.target_probs``) and the proposal
``q[i]`` node ``i`` was drawn from, walk down from the root:

  at node ``n`` with residual ``r = p[n]``, for each child ``c`` (in node order):
      accept ``c`` with probability ``min(1, r[tok_c] / q_c[tok_c])``        (Leviathan et al. eq. 1)
      otherwise ``r <- normalise(max(0, r - q_c))``                       (the residual)
  if a child was accepted, move to it; otherwise emit a *bonus* token ``~ r`` and stop.

Every emitted token is distributed exactly as vanilla sampling from ``p`` (SpecInfer's
multi-candidate rejection sampling). Deterministic drafts (top-k trees, greedy chains) use a
one-hot ``q``: the acceptance becomes ``r[tok_c]`` and the residual removes ``tok_c``. With a
one-hot ``p`` (greedy, temperature 0) the rule reduces to "follow the child equal to the
target argmax", i.e. the longest matching path, and the bonus is the target argmax.

``accept_tree`` works on one sequence; ``accept_batch`` vmaps it over the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxsys.decoding.sampling import sample_probs
from jaxsys.speculative.tree import Tree, children_table

__all__ = ["accept_batch", "accept_tree", "Acceptance", "residual"]


class Acceptance(NamedTuple):
  path: jax.Array     # int32 [D+1]: accepted node indices, path[0] = root; -1 after n_accepted
  n_accepted: jax.Array  # int32: accepted draft nodes (0 .. D)
  bonus: jax.Array    # int32: the token sampled at the last accepted node
  tokens: jax.Array   # int32 [D+1]: emitted tokens (accepted drafts then bonus); -1 padded


def residual(r, q):
  """``normalise(max(0, r - q))``; keeps ``r`` if nothing is left (only when r == q)."""
  res = jnp.maximum(r - q, 0.0)
  s = jnp.sum(res, axis=-1, keepdims=True)
  return jnp.where(s > 0, res / jnp.where(s > 0, s, 1.0), r)


def accept_tree(key, tree: Tree, p, *, max_depth: int, max_children: int,
                residual_fn=residual) -> Acceptance:
  """Lossless acceptance for one tree.

  Args:
    key: PRNG key (unused randomness is harmless for one-hot distributions).
    tree: the verified tree (``tokens [T]``, ``parents [T]``, ``q [T, vocab]``).
    p: float32 ``[T, vocab]`` processed target distributions at every node.
    max_depth: tree height bound ``D`` (static).
    max_children: bound on children per node (static; the draft top-k).
    residual_fn: the update after a rejection (exposed so that tests can check that a wrong rule
      is detected by the distribution test).
  """
  kids = children_table(tree.parents, max_children)  # [T, max_children]
  tokens, q = tree.tokens, tree.q

  def visit(carry, _):
    key, node, active, n_acc, path = carry
    key, k_node = jax.random.split(key)
    us = jax.random.uniform(k_node, (max_children,))
    r = p[node]
    chosen = jnp.int32(-1)
    for j in range(max_children):  # sequential rejection over siblings
      c = kids[node, j]
      valid = (c >= 0) & (chosen < 0)
      cs = jnp.maximum(c, 0)
      tok = tokens[cs]
      qc = q[cs]
      ratio = r[tok] / jnp.maximum(qc[tok], 1e-30)
      acc = valid & (us[j] < jnp.minimum(1.0, ratio))
      chosen = jnp.where(acc, c, chosen)
      r = jnp.where(valid & ~acc, residual_fn(r, qc), r)
    take = active & (chosen >= 0)
    n_acc = n_acc + take.astype(jnp.int32)
    path = jnp.where(take, path.at[n_acc].set(chosen), path)
    stop_r = jnp.where(active & ~take, 1.0, 0.0)
    node = jnp.where(take, chosen, node)
    return (key, node, take, n_acc, path), (stop_r, r)

  path0 = jnp.full((max_depth + 1,), -1, jnp.int32).at[0].set(0)
  carry0 = (key, jnp.int32(0), jnp.bool_(True), jnp.int32(0), path0)
  (key, node, _, n_acc, path), (stopped, rs) = jax.lax.scan(visit, carry0, None, length=max_depth + 1)
  # The residual at the visit where the walk stopped (exactly one visit has stopped == 1).
  r_final = jnp.einsum("s,sv->v", stopped, rs)
  bonus = sample_probs(jax.random.fold_in(key, 1), r_final)
  idx = jnp.arange(max_depth + 1)
  acc_tokens = tokens[jnp.maximum(path, 0)]
  # emitted[i] = token of path[i+1] for i < n_acc, bonus at i == n_acc.
  shifted = jnp.concatenate([acc_tokens[1:], jnp.zeros((1,), jnp.int32)])
  out = jnp.where(idx < n_acc, shifted, jnp.where(idx == n_acc, bonus, -1)).astype(jnp.int32)
  return Acceptance(path, n_acc, bonus, out)


def accept_batch(key, trees: Tree, p, *, max_depth: int, max_children: int,
                 residual_fn=residual) -> Acceptance:
  """``accept_tree`` over a batch: ``trees`` and ``p [b, T, vocab]`` carry a leading batch axis."""
  keys = jax.random.split(key, p.shape[0])
  fn = lambda k, t, pp: accept_tree(k, t, pp, max_depth=max_depth, max_children=max_children,
                                    residual_fn=residual_fn)
  return jax.vmap(fn)(keys, trees, p)
