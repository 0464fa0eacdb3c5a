"""2D attention (LongVILA MM-SP, Chen et al. 2024; USP, Fang & Zhao 2024): Ulysses x ring.

The sequence is sharded over a 2D mesh ``("ring", "ulysses")`` (ring major). Inside a Ulysses
group (fast intra-node links) an all-to-all turns ``[b, s/(R U), h, d]`` into
``[b, s/R, h/U, d]``; across Ulysses groups, ring attention (zigzag layout) passes K/V blocks of
``s/R`` tokens and ``h/U`` heads between the ``R`` ring ranks; the inverse all-to-all restores
``[b, s/(R U), h, d]``. Compared with a pure ring of ``R U`` ranks, each K/V hop carries ``U``
times more tokens but ``U`` times fewer heads, and there are ``U`` times fewer hops, so the
ring's bytes drop by ``~U`` while the all-to-all adds a term independent of ``R``.

With a zigzag layout the data must be reordered once for the ring degree ``R`` (not ``R U``):
a ring rank's two chunks are then split contiguously across its Ulysses group, and the
all-to-all reassembles exactly those two chunks.

Usage (inside ``shard_map`` over ("ring", "ulysses"))::

  out = hybrid_attention_shard(q, k, v, ring_axis="ring", ring_size=2,
                               ulysses_axis="ulysses", ulysses_size=4, mask=masks.Causal())
"""

from __future__ import annotations

from jaxsys.parallel.ring import ring_attention_shard
from jaxsys.parallel.ulysses import ulysses_attention_shard

__all__ = ["hybrid_attention_shard", "hybrid_comm_elements"]


def hybrid_attention_shard(q, k, v, *, ring_axis, ring_size: int, ulysses_axis,
                           ulysses_size: int, layout: str = "zigzag", mask=None,
                           segment_ids=None, scale=None, impl: str = "auto"):
  """2D attention on local shards ``[batch, seq/(R U), heads, dim]`` (call inside shard_map)."""

  def inner(qh, kh, vh, seg):  # [batch, seq/R, heads/U, dim]
    return ring_attention_shard(qh, kh, vh, axis=ring_axis, size=ring_size, layout=layout,
                                mask=mask, segment_ids=seg, scale=scale, impl=impl)

  return ulysses_attention_shard(q, k, v, axis=ulysses_axis, size=ulysses_size, mask=mask,
                                 segment_ids=segment_ids, scale=scale, impl=impl, inner=inner)


def hybrid_comm_elements(batch: int, seq: int, heads: int, kv_heads: int, dim: int,
                         ring_size: int, ulysses_size: int) -> dict:
  """Elements one rank sends per attention layer (forward), by collective kind."""
  from jaxsys.parallel.ulysses import ulysses_comm_elements
  a2a = ulysses_comm_elements(batch, seq // ring_size, heads, kv_heads, dim, ulysses_size)
  hk = kv_heads if kv_heads % ulysses_size == 0 else max(kv_heads, ulysses_size)
  hk_local = hk // ulysses_size
  n = seq // ring_size  # tokens per ring rank after the all-to-all
  hops = ring_size - 1
  return {"all-to-all": a2a["all-to-all"],
          "collective-permute": int(hops * 2 * batch * n * hk_local * dim)}
