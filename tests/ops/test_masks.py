"""Mask semantics and their compilation to block layouts (checked against dense brute force)."""

import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.ops import masks as M
from jaxsys.ops.attn import layout as L


def test_mask_semantics_dense():
  c = M.Causal().dense(3, 5)  # bottom-right aligned: row i at position 2 + i
  assert c[0].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
  loc = M.Local(2).dense(4, 4)[0]
  assert loc.sum(1).tolist() == [1, 2, 2, 2] and loc[3, 2] and not loc[3, 1]
  s = (M.Sink(1) | M.Local(1)).dense(4, 4)[0]
  assert s.tolist() == np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], bool).tolist()
  mh = M.MultiHead([M.Causal(), M.Full()]).dense(2, 2)
  assert mh.shape == (2, 2, 2) and mh[1].all() and not mh[0, 0, 1]
  bs = M.BlockSparse(np.array([[1, 0], [0, 1]], bool), 2, 2).dense(4, 4)[0]
  assert bs[:2, :2].all() and not bs[:2, 2:].any() and bs[2:, 2:].all()


def test_mask_errors():
  with pytest.raises(ConfigError, match="window"):
    M.Local(0)
  with pytest.raises(ConfigError, match="Mask"):
    M.Causal() | 3
  with pytest.raises(ShapeError, match="BlockSparse layout shape"):
    M.BlockSparse(np.ones((2, 2), bool), 4, 4).check_lengths(12, 8)
  with pytest.raises(ConfigError, match="disagree"):
    _ = (M.MultiHead([M.Full()] * 2) | M.MultiHead([M.Full()] * 3)).num_heads


def _random_masks(rng):
  lay = rng.rand(3, 4, 5) < 0.4
  return [
      None, M.Full(), M.Causal(), M.Local(7), M.Sink(5), M.Sink(4) | M.Local(6),
      M.Local(20) & M.Causal(),
      M.MultiHead([M.Causal(), M.Local(3), M.Sink(2) | M.Local(9)]),
      M.BlockSparse(lay[:1], 8, 6),
      M.BlockSparse(lay, 8, 6, token_mask=M.Causal()),
      M.BlockSparse(lay[:1], 8, 6) | M.Local(4),
  ]


@pytest.mark.parametrize("q_len,kv_len,q_offset,bq,bk", [
    (30, 30, None, 8, 8), (17, 29, None, 4, 16), (30, 30, 5, 16, 8), (1, 29, 12, 8, 8),
    (29, 30, None, 7, 5)])
def test_layout_classes_match_dense(q_len, kv_len, q_offset, bq, bk):
  """SKIP blocks see nothing, FULL blocks see every real token pair, visible blocks are visited."""
  rng = np.random.RandomState(q_len + bq)
  for mask in _random_masks(rng):
    heads = 3
    lay = L.compile_layout(mask, heads=heads, q_len=q_len, kv_len=kv_len, block_q=bq, block_k=bk,
                           q_offset=q_offset)
    off = kv_len - q_len if q_offset is None else q_offset
    dense = np.ones((1, q_len, kv_len), bool) if mask is None else mask.dense(
        q_len, kv_len, heads=heads, q_offset=off)
    cls = np.broadcast_to(lay.cls, (heads, *lay.cls.shape[1:]))
    dense = np.broadcast_to(dense, (heads, q_len, kv_len))
    for h in range(heads):
      for i in range(lay.num_q_blocks):
        for j in range(lay.num_k_blocks):
          blk = dense[h, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
          c = cls[h, i, j]
          assert c != L.SKIP or not blk.any(), (mask, h, i, j)
          if c == L.FULL:
            assert blk.all() and (j + 1) * bk <= kv_len, (mask, h, i, j)


def test_layout_is_tight_for_interval_masks():
  """Causal / local / sink classes are exact (no visited block without a visible key)."""
  for mask in (M.Causal(), M.Local(20), M.Sink(8) | M.Local(16)):
    lay = L.compile_layout(mask, heads=1, q_len=128, kv_len=128, block_q=16, block_k=16, q_offset=0)
    dense = mask.dense(128, 128, q_offset=0)[0].reshape(8, 16, 8, 16)
    np.testing.assert_array_equal(lay.cls[0] != L.SKIP, dense.any(axis=(1, 3)))
  lay = L.compile_layout(M.Sink(8) | M.Local(16), heads=1, q_len=4096, kv_len=4096,
                         block_q=256, block_k=256, q_offset=0)
  assert (lay.cls != L.SKIP).sum() == 1 + 2 + 14 * 3  # sink, previous and diagonal blocks


def test_tables_and_transposed_tables():
  rng = np.random.RandomState(0)
  cls = (rng.rand(2, 5, 6) < 0.5) * rng.randint(1, 3, (2, 5, 6))
  lay = L.BlockLayout(cls.astype(np.int8), 4, 4, 20, 24)
  for tabs, c in ((lay.tables, cls), (lay.transposed_tables, np.swapaxes(cls, 1, 2))):
    idx, tc, cnt = tabs
    for h in range(c.shape[0]):
      for r in range(c.shape[1]):
        ids = np.nonzero(c[h, r])[0]
        assert cnt[h, r] == len(ids)
        assert idx[h, r, :len(ids)].tolist() == ids.tolist()
        assert tc[h, r, :len(ids)].tolist() == c[h, r, ids].tolist()
        assert (tc[h, r, len(ids):] == L.SKIP).all()


def test_traced_offset_visits_all_position_blocks():
  lay = L.compile_layout(M.Causal(), heads=1, q_len=1, kv_len=64, block_q=8, block_k=16,
                         q_offset=None)
  assert (lay.cls == L.PARTIAL).all()
  sparse = M.BlockSparse(np.array([[[1, 0, 0, 1]]], bool), 8, 16)
  lay = L.compile_layout(sparse & M.Causal(), heads=1, q_len=1, kv_len=64, block_q=8,
                         block_k=16, q_offset=None)
  assert lay.cls[0, 0].tolist() == [L.PARTIAL, L.SKIP, L.SKIP, L.PARTIAL]
