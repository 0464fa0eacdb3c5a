"""merge_lse: partial attentions over disjoint key sets merge into attention over all keys."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.ops import merge

# jitted: one compile per call pattern instead of one per eager primitive
merge_lse = jax.jit(merge.merge_lse, static_argnames=("axis", "num_segments", "indices_are_sorted",
                                                      "lse_heads_first"))
normalize_partial = jax.jit(merge.normalize_partial)

SPLITS = ((0, 3), (3, 8), (8, 12))


@jax.jit
def _attend(q, k, v):
  """Attention of ``q [n, h, d]`` over ``k, v [t, h, d]``: ``out [n, h, d]``, ``lse [n, h]``."""
  s = jnp.einsum("nhd,thd->nht", q, k, precision="highest")
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("nht,thd->nhd", p, v, precision="highest"), jax.nn.logsumexp(s, axis=-1)


def _case(seed=0, n=5, h=2, d=4, t=12):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(kq, (n, h, d)), jax.random.normal(kk, (t, h, d)),
          jax.random.normal(kv, (t, h, d)))


def test_list_stacked_and_heads_first_layouts():
  q, k, v = _case()
  full_o, full_lse = _attend(q, k, v)
  parts = [_attend(q, k[a:b], v[a:b]) for a, b in SPLITS]
  outs, lses = [p[0] for p in parts], [p[1] for p in parts]
  for out, lse in (merge_lse(outs, lses),                                        # a list
                   merge_lse(jnp.stack(outs, 1), jnp.stack(lses, 1), axis=1)):    # stacked on axis 1
    np.testing.assert_allclose(out, full_o, atol=1e-5)
    np.testing.assert_allclose(lse, full_lse, atol=1e-5)
  # lse [heads, rows] beside out [rows, heads, dim] (the attention op's layout)
  out, lse = merge_lse(outs, [x.T for x in lses], lse_heads_first=True)
  np.testing.assert_allclose(out, full_o, atol=1e-5)
  np.testing.assert_allclose(lse, full_lse.T, atol=1e-5)


def test_segments_merge_only_equal_ids_and_empty_segments_are_zero():
  q, k, v = _case(1)
  q2 = q[::-1] * 2.0
  parts = [_attend(q, k[:6], v[:6]), _attend(q, k[6:], v[6:]),
           _attend(q2, k[:4], v[:4]), _attend(q2, k[4:], v[4:])]
  o = jnp.stack([p[0] for p in parts])
  lse = jnp.stack([p[1] for p in parts])
  out, lse_out = merge_lse(o, lse, segment_ids=jnp.array([0, 0, 2, 2]), num_segments=3,
                           indices_are_sorted=True)
  for seg, qq in ((0, q), (2, q2)):
    ref_o, ref_l = _attend(qq, k, v)
    np.testing.assert_allclose(out[seg], ref_o, atol=1e-5)
    np.testing.assert_allclose(lse_out[seg], ref_l, atol=1e-5)
  assert np.all(np.asarray(out[1]) == 0) and np.all(np.isneginf(lse_out[1]))


def test_partials_that_saw_no_key_are_ignored_and_gradients_stay_finite():
  q, k, v = _case(2)
  o, lse = _attend(q, k, v)
  empty = (jnp.zeros_like(o), jnp.full_like(lse, -jnp.inf))
  out, lse_out = merge_lse([o, empty[0]], [lse, empty[1]])
  np.testing.assert_allclose(out, o, atol=1e-6)
  np.testing.assert_allclose(lse_out, lse, atol=1e-6)
  out, lse_out = merge_lse([empty[0]] * 2, [empty[1]] * 2)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse_out))
  grad = jax.grad(lambda x: jnp.sum(merge_lse([x, empty[0]], [lse, empty[1]])[0]))(o)
  assert np.all(np.isfinite(grad))


def test_normalize_partial_turns_online_softmax_state_into_a_partial():
  q, k, v = _case(3)
  s = jnp.einsum("nhd,thd->nht", q, k, precision="highest")
  m = jnp.max(s, -1)
  p = jnp.exp(s - m[..., None])
  o = jnp.einsum("nht,thd->nhd", p, v, precision="highest")
  out, lse = normalize_partial(o, m, jnp.sum(p, -1))
  ref_o, ref_l = _attend(q, k, v)
  np.testing.assert_allclose(out, ref_o, atol=1e-5)
  np.testing.assert_allclose(lse, ref_l, atol=1e-5)
  out, lse = normalize_partial(jnp.zeros_like(o), jnp.full_like(m, -jnp.inf), jnp.zeros_like(m))
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse))
