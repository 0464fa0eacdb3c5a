"""Prefix caching: full KV pages keyed by a hash of their tokens, shared by reference count.

A page that holds tokens ``[i * P, (i + 1) * P)`` of a sequence is keyed by a chained hash
(vLLM's automatic prefix caching): ``h_i = H(h_{i-1} || tokens of page i)``, so equal keys mean
equal token prefixes, not only equal pages. When a request is admitted, the engine looks up the
longest run of its prompt's page keys, shares those pages (their reference count goes up) and
prefills only the rest. A page whose count drops to zero keeps its contents and key and goes to
an LRU list of evictable pages: a later request with the same prefix can revive it; a request
that needs fresh pages takes free ones first, then evicts the least recently used.

Shared pages are never written: the engine shares at most ``(prompt_len - 1) // P`` pages, so
the last prompt token (whose logits give the first new token) is always computed in a page of
the request's own.

Usage::

  alloc = PrefixCachingAllocator(num_pages=256)
  keys = page_keys(tokens, page_size=64)       # one key per full page
  shared = alloc.lookup(keys)                  # pages to reuse (each already referenced once more)
  alloc.register(page, key)                    # after the page was filled
  alloc.free(pages)                            # drop one reference of each
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from jaxsys.core.errors import InputError
from jaxsys.serving.paged_cache import PageAllocator, PoolExhaustedError

__all__ = ["page_keys", "PrefixCachingAllocator"]


def page_keys(tokens, page_size: int, start: int = 0, prev: bytes | None = None) -> list[bytes]:
  """Chained keys of the full pages ``start, start + 1, ...`` of ``tokens`` (``prev``: the key of
  page ``start - 1``). BLAKE2b of the previous key and the page's int32 token bytes."""
  arr = np.asarray(tokens, np.int32)
  keys, h = [], b"" if prev is None else prev
  for i in range(start, len(arr) // page_size):
    h = hashlib.blake2b(h + arr[i * page_size:(i + 1) * page_size].tobytes(), digest_size=16).digest()
    keys.append(h)
  return keys


class PrefixCachingAllocator(PageAllocator):
  """A :class:`PageAllocator` whose pages carry reference counts and optional content keys.

  ``num_free`` counts free and evictable (unreferenced, cached) pages: both can be handed out.
  ``hits`` / ``queries`` count pages found / looked up (the prefix cache hit rate).
  """

  def __init__(self, num_pages: int):
    super().__init__(num_pages)
    self._ref: dict[int, int] = {}
    self._key_of: dict[int, bytes] = {}
    self._page_of: dict[bytes, int] = {}
    self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
    self.hits = 0
    self.queries = 0

  @property
  def num_free(self) -> int:
    return len(self._free) + len(self._evictable)

  @property
  def num_cached(self) -> int:
    """Pages holding a registered key (referenced or evictable)."""
    return len(self._key_of)

  @property
  def hit_rate(self) -> float:
    return self.hits / self.queries if self.queries else 0.0

  def refcount(self, page: int) -> int:
    return self._ref.get(page, 0)

  def allocate(self, n: int) -> list[int]:
    if n > self.num_free:
      raise PoolExhaustedError(f"need {n} pages but only {self.num_free} of {self.num_pages} are free")
    pages = []
    for _ in range(n):
      if self._free:
        p = self._free.pop()
      else:  # evict the least recently used cached page
        p, _ = self._evictable.popitem(last=False)
        del self._page_of[self._key_of.pop(p)]
      self._ref[p] = 1
      pages.append(p)
    return pages

  def free(self, pages) -> None:
    for p in pages:
      if self._ref.get(p, 0) < 1:
        raise InputError(f"page {p} is not allocated (double free?)")
      self._ref[p] -= 1
      if self._ref[p] == 0:
        del self._ref[p]
        if p in self._key_of:
          self._evictable[p] = None
        else:
          self._free.append(p)

  def lookup(self, keys, limit: int | None = None) -> list[int]:
    """Pages of the longest cached run of ``keys[:limit]``; each gets one more reference."""
    keys = list(keys)[:limit]
    self.queries += len(keys)
    pages = []
    for k in keys:
      p = self._page_of.get(k)
      if p is None:
        break
      pages.append(p)
    for p in pages:
      self._evictable.pop(p, None)
      self._ref[p] = self._ref.get(p, 0) + 1
    self.hits += len(pages)
    return pages

  def register(self, page: int, key: bytes) -> None:
    """Marks a filled, referenced page as holding the tokens ``key`` names (first page wins)."""
    if self._ref.get(page, 0) < 1:
      raise InputError(f"page {page} is not allocated")
    if key in self._page_of or page in self._key_of:
      return
    self._page_of[key] = page
    self._key_of[page] = key

  def clear(self) -> None:
    """Forgets every key (after the pools were re-created: their contents are gone)."""
    for p in list(self._evictable):
      self._free.append(p)
    self._evictable.clear()
    self._key_of.clear()
    self._page_of.clear()
