"""Hierarchical page selection: the bound, top-k rules, budget validation."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.serving import page_select as ps


def test_scores_are_upper_bounds_and_match_bruteforce():
  rng = np.random.default_rng(0)
  b, hk, g, d, page, lps, m = 2, 2, 3, 8, 8, 4, 5
  keys = rng.standard_normal((b, m * page, hk, d)).astype(np.float32)
  q = rng.standard_normal((b, hk * g, d)).astype(np.float32)
  lengths = np.array([37, 13], np.int32)
  blk = keys.reshape(b, m, page // lps, lps, hk, d)
  kmin, kmax = blk.min(3), blk.max(3)  # [b, m, nl, hk, d]
  n = b * m
  bt = np.arange(n).reshape(b, m).astype(np.int32)
  pool_min = kmin.reshape(n, page // lps, hk, d).transpose(0, 2, 1, 3)
  pool_max = kmax.reshape(n, page // lps, hk, d).transpose(0, 2, 1, 3)
  s = np.asarray(ps.page_scores(jnp.asarray(q), jnp.asarray(pool_min), jnp.asarray(pool_max),
                                jnp.asarray(bt), jnp.asarray(lengths), page_size=page, logical_page_size=lps))
  for i in range(b):
    for h in range(hk):
      for j in range(m):
        qs = q[i, h * g:(h + 1) * g]
        ref = -np.inf
        for l in range(page // lps):
          if (j * page + l * lps) < lengths[i]:
            ref = max(ref, np.max(np.maximum(qs * kmax[i, j, l, h], qs * kmin[i, j, l, h]).sum(-1)))
        np.testing.assert_allclose(s[i, h, j], ref, rtol=1e-5, atol=1e-5)
        # the bound holds for every visible key of the page
        tok = np.arange(j * page, min((j + 1) * page, lengths[i]))
        if len(tok):
          assert (qs @ keys[i, tok, h].T).max() <= s[i, h, j] + 1e-5


def test_select_rules():
  scores = jnp.asarray([[[5., 1., 9., 3., 7., 2.]]])
  # newest page (length 41 with page 8 -> page 5) forced; top-2 of the rest by score
  out = ps.select_pages(scores, jnp.asarray([41]), num_select=3, page_size=8, sink_pages=0)
  assert out.tolist() == [[[2, 4, 5]]]
  # by default the first page (the attention sink) is forced too, whatever its score
  low_sink = scores.at[0, 0, 0].set(-10.0)
  assert ps.select_pages(low_sink, jnp.asarray([41]), num_select=3, page_size=8).tolist() == [[[0, 2, 5]]]
  out = ps.select_pages(low_sink, jnp.asarray([41]), num_select=4, page_size=8, sink_pages=2)
  assert out.tolist() == [[[0, 1, 2, 5]]]
  # context fits the budget: every page, empty slots -1
  out = ps.select_pages(scores, jnp.asarray([17]), num_select=4, page_size=8)
  assert out.tolist() == [[[0, 1, 2, -1]]]
  # reuse: a page started since the selection gets the extra slot
  nxt = ps.with_newest_page(out, jnp.asarray([25]), page_size=8)
  assert nxt.tolist() == [[[0, 1, 2, -1, 3]]]
  assert ps.with_newest_page(out, jnp.asarray([24]), page_size=8).tolist() == [[[0, 1, 2, -1, -1]]]


def test_selection_config_validation():
  assert ps.SelectionConfig(token_budget=128, page_size=64).num_select == 3  # at least 3 pages
  with pytest.raises(ConfigError, match="token_budget=100"):
    ps.SelectionConfig(token_budget=100, page_size=64)
  with pytest.raises(ConfigError, match="logical_page_size=24"):
    ps.SelectionConfig(page_size=64, logical_page_size=24)
  with pytest.raises(ConfigError, match="sink_pages=3"):
    ps.SelectionConfig(token_budget=192, page_size=64, sink_pages=3)
  with pytest.raises(ConfigError, match="sink_pages"):
    ps.SelectionConfig(sink_pages=-1)


def test_page_scores_dispatch_errors():
  z = jnp.zeros((1, 1, 2, 4))
  args = (jnp.zeros((1, 2, 4)), z, z, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
  with pytest.raises(NotImplementedError, match="GPU"):
    ps.page_scores(*args, page_size=8, logical_page_size=4, impl="pallas")
  with pytest.raises(ConfigError, match="impl"):
    ps.page_scores(*args, page_size=8, logical_page_size=4, impl="cuda")
