"""Batched speculative decoding steps (EAGLE drafting, tree verification, commit/rollback).

The decode state of a batch (``DecodeState``) holds the target KV cache (committed length ``L``
per row), the *root* token of each row (sampled but not yet in the cache), the drafter's own
KV cache and its *pending* entries ``(f_t, x_{t+1})`` not yet run through the drafter, the
token history, the target features of every committed position (for online drafter training)
and the emitted tokens. Four jittable steps act on it:

* ``prefill``: prompt -> cache, first token (root), features.
* ``vanilla_step``: one target forward over the root (the baseline decode step).
* ``drafter_sync``: re-runs the drafter over the whole history (after vanilla steps).
* ``draft`` (per strategy) -> a ``Tree`` per row; ``verify`` (per verify_tokens): one target
  forward over the tree, lossless acceptance, commit of the accepted path, new root = bonus.

Penalties and logit bias (``SamplingParams``' frequency / presence / repetition / ``logit_bias``)
keep their token history in ``DecodeState.pen``; verification penalizes each tree node with the
history plus the drafted tokens on its path, so acceptance is lossless against penalized vanilla.

Each row advances by its own accepted length; finished rows are frozen. All shapes are static
(batch bucket, cache length, tree size), so each step compiles once per bucket. The steps run
only inside the on-device loops of ``speculative.fused`` (the rollout engine's one decode path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.decoding import core
from jaxsys.decoding.cache import KVCache
from jaxsys.speculative import acceptance as acc_lib
from jaxsys.speculative import forward as fwd
from jaxsys.decoding import sampling as smp
from jaxsys.speculative import tree as tree_lib
from jaxsys.speculative.bandit import Strategy

__all__ = [
    "DecodeConfig", "DecodeState", "draft", "drafter_sync", "init_state", "jit_prefill", "prefill",
    "split", "vanilla_step", "verify",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  cache: KVCache        # target cache, lengths = committed tokens L [b]
  root: Any             # int32 [b] next token to feed (sampled, not in the cache)
  dk: Any               # drafter cache keys [b, S, kv_heads, head_dim]
  dv: Any
  dlen: Any             # int32 [b] drafter entries committed
  pend_tok: Any         # int32 [b, P] pending drafter inputs x_{t+1}
  pend_feat: Any        # [b, P, embed] pending drafter inputs f_t
  pend_n: Any           # int32 [b]
  seq: Any              # int32 [b, S] tokens (prompt, committed, root at L)
  feats: Any            # [b, S, embed] target features of committed positions
  out: Any              # int32 [b, max_new] emitted tokens
  n_out: Any            # int32 [b]
  done: Any             # bool [b]
  key: Any
  ref: Any              # int32 [b, R] reference tokens for lookup drafting (-1 = none / separator)
  pen: Any = None       # smp.Penalties [b, ...]: the penalties' token history (penalized sampling only)

  def replace(self, **kw) -> "DecodeState":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Static sizes: cache/history length ``max_len``, ``max_new`` emitted tokens per row,
  pending capacity ``max_depth + 1``, the largest draft ``max_topk`` (children per node, bounds
  the acceptance loop) and the stop tokens."""
  max_len: int
  max_new: int
  max_depth: int
  max_topk: int = 1
  stop_tokens: tuple[int, ...] = ()
  sampling: smp.SamplingParams = smp.GREEDY
  ref_len: int = 0  # R: reference tokens per row for lookup drafting (``speculative.lookup``)


def _emit(state: DecodeState, tokens, n_new, cfg: DecodeConfig):
  """Appends ``tokens [b, W]`` (first ``n_new`` valid) to ``out``; stops at stop tokens/max_new."""
  out, n_out, done, _ = core.emit(state.out, state.n_out, state.done, tokens, n_new,
                                  max_new=cfg.max_new, stop_tokens=cfg.stop_tokens)
  return state.replace(out=out, n_out=n_out, done=done)


def init_state(model, drafter_cfg, prompts, lengths, cfg: DecodeConfig, key) -> DecodeState:
  """Empty state for right-padded ``prompts int[b, Lp]`` (shapes only; run ``prefill`` next)."""
  b = prompts.shape[0]
  c = model.config
  dt = c.jnp_dtype
  kv_shape = (b, cfg.max_len, drafter_cfg.num_kv_heads, drafter_cfg.head_dim)
  p = cfg.max_depth + 1
  return DecodeState(
      cache=KVCache.init(c, b, cfg.max_len), root=jnp.zeros((b,), jnp.int32),
      dk=jnp.zeros(kv_shape, dt), dv=jnp.zeros(kv_shape, dt), dlen=jnp.zeros((b,), jnp.int32),
      pend_tok=jnp.zeros((b, p), jnp.int32), pend_feat=jnp.zeros((b, p, c.hidden_size), dt),
      pend_n=jnp.zeros((b,), jnp.int32), seq=jnp.zeros((b, cfg.max_len), jnp.int32),
      feats=jnp.zeros((b, cfg.max_len, c.hidden_size), dt),
      out=jnp.zeros((b, cfg.max_new), jnp.int32), n_out=jnp.zeros((b,), jnp.int32),
      done=jnp.zeros((b,), bool), key=key, ref=jnp.full((b, cfg.ref_len), -1, jnp.int32),
      pen=smp.Penalties.init(cfg.sampling, b, c.vocab_size) if cfg.sampling.penalized else None)


def _sample(key, logits, state: DecodeState, cfg: DecodeConfig):
  """The next token of every row from ``logits [b, vocab]``: penalties and bias first (with the
  row's history), then the one sampler's filter and draw."""
  if state.pen is not None:
    logits = smp.penalize(logits, state.pen)
  return smp.sample(key, logits, cfg.sampling.without_penalties())


def _record(state: DecodeState, tokens, live) -> DecodeState:
  """Adds ``tokens int32[b, W]`` (where ``live bool[b, W]``) to the penalties' history."""
  if state.pen is None:
    return state
  pen = state.pen
  for j in range(tokens.shape[1]):
    pen = pen.record(tokens[:, j], live[:, j])
  return state.replace(pen=pen)


def _tree_probs(logits, trees: tree_lib.Tree, state: DecodeState, cfg: DecodeConfig):
  """The target distribution ``p [b, T, vocab]`` at every tree node. With penalties, node ``t``'s
  history is the row's plus the drafted tokens on its path (its ancestors and itself, the root
  excluded: it is already recorded), so acceptance stays lossless against penalized vanilla."""
  if state.pen is not None:
    t, vocab = trees.tokens.shape[1], logits.shape[-1]
    drafted = jax.nn.one_hot(trees.tokens, vocab) * (jnp.arange(t) > 0)[None, :, None]  # [b, T, V]
    extra = jnp.einsum("bts,bsv->btv", trees.vis.astype(jnp.float32), drafted)          # [b, T, V]
    p = state.pen
    node = smp.Penalties(p.counts[:, None] + extra, p.seen[:, None] | (extra > 0), p.frequency[:, None],
                         p.presence[:, None], p.repetition[:, None], p.bias[:, None])
    logits = smp.penalize(logits, node)
  return smp.target_probs(logits, cfg.sampling.without_penalties())


def prefill(model, state: DecodeState, prompts, lengths, cfg: DecodeConfig) -> DecodeState:
  """Runs the prompts (right-padded ``int[b, Lp]``, true ``lengths``) and samples the root."""
  b, lp = prompts.shape
  # The decoding core's prefill: a causal forward over the contiguous cache, so the attention
  # layout skips every block above the diagonal.
  h, cache = core.prefill_hidden(model, prompts, lengths, state.cache)
  h_last = h[jnp.arange(b), lengths - 1]  # [b, embed]
  logits = model.logits(h_last[:, None])[:, 0]
  key, sub = jax.random.split(state.key)
  if state.pen is not None:
    state = state.replace(pen=state.pen.record_prompts(prompts, lengths))
  root = _sample(sub, logits, state, cfg)
  state = _record(state, root[:, None], jnp.ones((b, 1), bool))
  seq = state.seq.at[:, :lp].set(prompts)
  seq = seq.at[jnp.arange(b), lengths].set(root)
  feats = state.feats.at[:, :lp].set(h.astype(state.feats.dtype))
  state = state.replace(cache=cache, root=root, seq=seq, feats=feats, key=key)
  return _emit(state, root[:, None], jnp.ones((b,), jnp.int32), cfg)


def vanilla_step(model, state: DecodeState, cfg: DecodeConfig) -> DecodeState:
  """One target forward over the root of every running row (the baseline decode step)."""
  b = state.root.shape[0]
  L = state.cache.lengths
  # The decoding core's step (the one every vanilla decode runs: generate, serving's contiguous
  # path, rollouts); it writes the root at row L of every row, and only running rows keep it.
  logits, h, cache = core.step(model, state.cache, state.root[:, None])
  key, sub = jax.random.split(state.key)
  nxt = _sample(sub, logits[:, 0], state, cfg)
  active = ~state.done
  state = _record(state, nxt[:, None], active[:, None])
  # The root's row is already at L: keeping it is a length update. ``fwd.commit``'s row move
  # (a scatter) cost ~2 ms of a ~20 ms SmolLM2 step at batch 1 with a 412-row cache on CPU.
  cache = cache.replace(lengths=L + active.astype(L.dtype))
  rows = jnp.arange(b)
  seq = state.seq.at[rows, jnp.where(active, L + 1, cfg.max_len)].set(nxt, mode="drop")
  feats = state.feats.at[rows, jnp.where(active, L, cfg.max_len)].set(h[:, 0], mode="drop")
  new = state.replace(cache=cache, root=jnp.where(active, nxt, state.root), seq=seq, feats=feats,
                      key=key, pend_n=jnp.zeros_like(state.pend_n))
  return _emit(new, nxt[:, None], active.astype(jnp.int32), cfg)


def drafter_sync(model, drafter, state: DecodeState) -> DecodeState:
  """Rebuilds the drafter cache from the history: entries ``(f_t, x_{t+1})``, ``t < L - 1``,
  and leaves ``(f_{L-1}, root)`` pending."""
  b, s = state.seq.shape
  L = state.cache.lengths
  tok_next = jnp.concatenate([state.seq[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
  x = drafter.fuse(model, tok_next, state.feats)
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  vis = jnp.broadcast_to(jnp.tril(jnp.ones((s, s), bool)), (b, s, s))
  zero = jnp.zeros((b,), jnp.int32)
  _, dk, dv = fwd.drafter_forward(drafter, x, pos, state.dk, state.dv, vis=vis,
                                  prefix_len=zero, write_start=zero)
  rows = jnp.arange(b)
  pend_tok = jnp.zeros_like(state.pend_tok).at[:, 0].set(state.root)
  pend_feat = jnp.zeros_like(state.pend_feat).at[:, 0].set(state.feats[rows, L - 1])
  return state.replace(dk=dk, dv=dv, dlen=L - 1, pend_tok=pend_tok, pend_feat=pend_feat,
                       pend_n=jnp.ones((b,), jnp.int32))


def _drafter_block(model, drafter, state, tokens, feats, positions, vis, prefix_len, write_start,
                   tree_start):
  x = drafter.fuse(model, tokens, feats)
  out, dk, dv = fwd.drafter_forward(drafter, x, positions, state.dk, state.dv, vis=vis,
                                    prefix_len=prefix_len, write_start=write_start,
                                    tree_start=tree_start)
  return drafter.out_norm(out), state.replace(dk=dk, dv=dv)


def draft(model, drafter, state: DecodeState, strategy: Strategy):
  """EAGLE-2 drafting: commit pending entries, expand ``topk`` nodes per depth, keep the
  ``verify_tokens - 1`` best candidates. Returns ``(Tree [b, ...], state)``."""
  b, p = state.pend_tok.shape
  k, depth, vocab = strategy.topk, strategy.depth, model.config.vocab_size
  # 1) pending entries (accepted path of the last step) -> drafter cache, causal among them.
  pos = state.dlen[:, None] + jnp.arange(p, dtype=jnp.int32)
  vis = jnp.broadcast_to(jnp.tril(jnp.ones((p, p), bool)), (b, p, p))
  out, state = _drafter_block(model, drafter, state, state.pend_tok, state.pend_feat, pos, vis,
                              state.dlen, state.dlen, state.dlen)
  g = out[jnp.arange(b), jnp.maximum(state.pend_n - 1, 0)]  # [b, embed] f^ at the root
  ld = state.dlen + state.pend_n                              # = target length L
  state = state.replace(dlen=ld, pend_n=jnp.zeros_like(state.pend_n))
  # 2) depth 1: top-k children of the root.
  # Draft logits over the drafter's vocabulary (all target tokens, or its reduced K set); top-k
  # indices map back to target ids (``EagleDrafter.to_target``).
  logp = jax.nn.log_softmax(drafter.draft_logits(model, g[:, None])[:, 0], axis=-1)  # [b, K]
  f_score, f_tok = jax.lax.top_k(logp, k)                             # [b, k]
  f_tok = drafter.to_target(f_tok)
  cand_tok, cand_par, cand_score = [f_tok], [jnp.full((b, k), -1, jnp.int32)], [f_score]
  f_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
  f_feat = jnp.broadcast_to(g[:, None], (b, k, g.shape[-1]))
  scratch = max(1, (depth - 1) * k)
  f_anc = jnp.zeros((b, k, scratch), bool)
  n_cand = k
  # 3) depths 2..D: feed the frontier (tree attention among drafted entries), expand top-k each.
  for d in range(1, depth):
    base = (d - 1) * k
    anc = f_anc | jax.nn.one_hot(base + jnp.arange(k), scratch, dtype=bool)[None]
    pos = jnp.broadcast_to(ld[:, None] + d - 1, (b, k)).astype(jnp.int32)
    h, state = _drafter_block(model, drafter, state, f_tok, f_feat, pos, anc, ld, ld + base, ld)
    lp = jax.nn.log_softmax(drafter.draft_logits(model, h), axis=-1)  # [b, k, K]
    c_score, c_tok = jax.lax.top_k(lp, k)                  # [b, k, k]
    c_tok = drafter.to_target(c_tok)
    c_score = f_score[:, :, None] + c_score
    cand_tok.append(c_tok.reshape(b, k * k))
    cand_par.append(jnp.repeat(f_cand, k, axis=1))
    cand_score.append(c_score.reshape(b, k * k))
    s_score, sel = jax.lax.top_k(c_score.reshape(b, k * k), k)  # next frontier
    parent = sel // k
    f_tok = jnp.take_along_axis(c_tok.reshape(b, k * k), sel, 1)
    f_feat = jnp.take_along_axis(h, parent[:, :, None], 1)
    f_anc = jnp.take_along_axis(anc, parent[:, :, None], 1)
    f_cand = (n_cand + sel).astype(jnp.int32)
    f_score = s_score
    n_cand += k * k
  cand_tok = jnp.concatenate(cand_tok, 1).astype(jnp.int32)
  cand_par = jnp.concatenate(cand_par, 1).astype(jnp.int32)
  cand_score = jnp.concatenate(cand_score, 1)

  def one(root, ct, cp, cs):
    q = jax.nn.one_hot(ct, vocab, dtype=jnp.float32)  # deterministic drafts: one-hot proposals
    return tree_lib.select_tree(root, ct, cp, cs, q, strategy.verify_tokens, depth)

  return jax.vmap(one)(state.root, cand_tok, cand_par, cand_score), state


def verify(model, state: DecodeState, trees: tree_lib.Tree, cfg: DecodeConfig):
  """One target forward over the trees, lossless acceptance, commit, new root = bonus.

  Returns ``(state, n_accepted int[b])`` (-1 for rows that were already done).
  """
  b, t = trees.tokens.shape
  L = state.cache.lengths
  positions = tree_lib.tree_positions(trees.depth, L)
  logits, h, cache = fwd.target_tree_forward(model, state.cache, trees.tokens, positions, trees.vis)
  p = _tree_probs(logits, trees, state, cfg)  # [b, T, vocab]
  key, sub = jax.random.split(state.key)
  acc = acc_lib.accept_batch(sub, trees, p, max_depth=min(t - 1, cfg.max_depth),
                             max_children=min(t - 1, cfg.max_topk))
  active = ~state.done
  pcap = cfg.max_depth + 1
  path, emitted = acc.path, acc.tokens
  if t < pcap:  # fewer tree nodes than the pending capacity: pad
    path = jnp.pad(path, ((0, 0), (0, pcap - t)), constant_values=-1)
    emitted = jnp.pad(emitted, ((0, 0), (0, pcap - t)), constant_values=-1)
  path, emitted = path[:, :pcap], emitted[:, :pcap]
  n_acc = jnp.minimum(acc.n_accepted, cfg.max_depth)
  cache = fwd.commit(cache, path, n_acc, active)
  rows = jnp.arange(b)[:, None]
  idx = jnp.arange(path.shape[1])[None]
  keep = (idx <= n_acc[:, None]) & active[:, None]
  hp = jnp.take_along_axis(h, jnp.maximum(path, 0)[:, :, None], 1)  # [b, P, embed] path features
  feats = state.feats.at[rows, jnp.where(keep, L[:, None] + idx, cfg.max_len)].set(hp, mode="drop")
  seq = state.seq.at[rows, jnp.where(keep, L[:, None] + 1 + idx, cfg.max_len)].set(emitted, mode="drop")
  pend_tok = jnp.where(keep, emitted, 0)
  pend_feat = jnp.where(keep[:, :, None], hp, 0)
  new = state.replace(cache=cache, root=jnp.where(active, acc.bonus, state.root), seq=seq,
                      feats=feats, key=key, pend_tok=pend_tok, pend_feat=pend_feat.astype(state.pend_feat.dtype),
                      pend_n=jnp.where(active, n_acc + 1, state.pend_n))
  new = _record(new, emitted, keep)
  new = _emit(new, emitted, jnp.where(active, n_acc + 1, 0), cfg)
  return new, jnp.where(active, n_acc, -1)


# ---- jitted entry points (modules split into graphdef + state) -------------------------------

def split(module):
  return nnx.split(module)


def jit_prefill(cfg: DecodeConfig):
  def f(gdef, tstate, state, prompts, lengths):
    return prefill(nnx.merge(gdef, tstate), state, prompts, lengths, cfg)
  return jax.jit(f, static_argnums=0, donate_argnums=2)
