"""Lookup drafting: draft chains copied from the row's own history and from reference tokens.

A drafter model is not the only source of drafts. In RL rollouts the text a response is about to
write has often been written already: by the response itself (``repeat the word 'x' 40 times``),
by its prompt (``sort these numbers: ...``), or by its *siblings*, the other responses of its
GRPO group to the same prompt, which have mostly finished by the time the long tail runs. Prompt
lookup decoding (Saxena 2023) and SuffixDecoding (Oliaro et al. 2024) draft by string matching
over such text; verification stays the same lossless acceptance (``speculative.acceptance``), so
what is drafted changes only the speed, never the output distribution.

Per row and round (all on device, static shapes):

* the haystack is ``ref [R]`` (reference tokens, ``-1`` padding and separators) followed by the
  row's own tokens ``seq[0..L]`` (prompt, committed tokens and the root at ``L``);
* a position ``j`` *matches with length m* when ``hay[j-m+1..j]`` equals the ``m`` tokens ending
  at the root (``m <= ngram``, the strategy's ``lookup``), none of them ``-1``, ``j`` before the
  root;
* the draft is the ``depth`` tokens after the best match: the longest ``m``, then the latest ``j``
  (the row's own history after the references, later siblings after earlier ones); rows whose best
  match is shorter than ``MIN_MATCH`` have no draft.

``lookup_loop`` (``fused.py``) verifies a round only when some running row has a draft, and runs a
plain vanilla step otherwise, so text with nothing to copy costs vanilla time, not a verify of
``depth + 1`` tokens per emitted token.

Shapes: ``seq int32 [b, S]``, ``ref int32 [b, R]``, hay ``[b, R + S]``; the comparison is
``ngram x b x (R + S)`` integer compares per round, nothing next to a forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.speculative import tree as tree_lib

__all__ = ["MIN_MATCH", "build_references", "lookup_draft"]

# A 1-token match (any earlier comma, any earlier digit) predicts little; its drafts would cost a
# verify of depth + 1 tokens for ~1 emitted token.
MIN_MATCH = 2


def lookup_draft(state, strategy, vocab: int):
  """``(Tree [b, depth + 1], has_draft bool [b])`` for a lookup ``strategy`` (chain, ``topk == 1``).

  ``state`` is a ``decode.DecodeState`` (``seq``, ``cache.lengths``, ``root``, ``ref``). Rows
  without a match of at least ``MIN_MATCH`` tokens get a chain of the root repeated (``has_draft``
  False); it is as lossless as any draft, only unlikely to be accepted.
  """
  seq, ref, root = state.seq, state.ref, state.root
  b, s = seq.shape
  r = ref.shape[1]
  n, depth = strategy.lookup, strategy.depth
  L = state.cache.lengths                                              # root sits at seq[L]
  own = jnp.where(jnp.arange(s)[None] <= L[:, None], seq, -1)
  hay = jnp.concatenate([ref, own], axis=1)                            # [b, H]
  h = r + s
  end = r + L                                                          # [b] root index in hay
  idx = jnp.arange(h)
  # m[b, j]: length (<= n) of the match ending at j (consecutive equal tokens walking back).
  m = jnp.zeros((b, h), jnp.int32)
  alive = jnp.ones((b, h), bool)
  for k in range(n):
    tail = jnp.take_along_axis(hay, jnp.maximum(end - k, 0)[:, None], 1)        # [b, 1]
    back = jnp.pad(hay, ((0, 0), (k, 0)), constant_values=-1)[:, :h]            # hay[j - k]
    alive = alive & (back == tail) & (back >= 0) & (L >= k)[:, None]
    m = m + alive.astype(jnp.int32)
  m = jnp.where(idx[None] < end[:, None], m, 0)                        # strictly before the root
  score = m * h + idx[None]                                            # longest, then latest
  j = jnp.argmax(score, axis=1)                                        # [b]
  best = jnp.take_along_axis(m, j[:, None], 1)[:, 0]
  has = best >= min(MIN_MATCH, n)
  cont = jnp.take_along_axis(hay, jnp.minimum(j[:, None] + 1 + jnp.arange(depth)[None], h - 1), 1)
  cont = jnp.where((cont >= 0) & has[:, None], cont, root[:, None])    # [b, depth]
  q = jax.nn.one_hot(cont, vocab, dtype=jnp.float32)                   # deterministic proposals
  return jax.vmap(tree_lib.chain_tree)(root, cont, q), has


def build_references(seqs: Sequence[Sequence[int]], length: int) -> np.ndarray:
  """``int32 [length]``: the token sequences ``seqs`` joined by ``-1`` separators (so no match
  spans two of them), right-aligned and ``-1``-padded; when they hold more than ``length``
  tokens, the newest (last) ones are kept: the buffer is a drafting cache, not data."""
  out = np.full((length,), -1, np.int32)
  if length == 0:
    return out
  parts = []
  for s in seqs:
    parts += [np.asarray(s, np.int32).reshape(-1), np.full((1,), -1, np.int32)]
  flat = np.concatenate(parts)[-length:] if parts else np.zeros((0,), np.int32)
  out[length - len(flat):] = flat
  return out
