"""GRPO (Shao et al., 2024) with rollouts from the adaptive speculative engine.

For each prompt, ``G`` responses are sampled; with verifiable rewards ``r_i`` the advantage of
every token of response ``i`` is the group-normalised ``A_i = (r_i - mean(r)) / (std(r) + eps)``.
The policy maximises the clipped surrogate with a k3 KL penalty to a frozen reference policy:

    rho_t = pi(x_t) / pi_old(x_t)
    J = mean_i mean_t [ min(rho_t A_i, clip(rho_t, 1-eps, 1+eps) A_i) - beta * KL3_t ]
    KL3_t = pi_ref/pi - log(pi_ref/pi) - 1                     (Schulman's k3 estimator)

Options of :class:`GRPOConfig` (the defaults reproduce the formula above):

* ``clip_low`` / ``clip_high``: asymmetric clipping ``clip(rho, 1 - clip_low, 1 + clip_high)``
  (DAPO's clip-higher, Yu et al. 2025).
* ``dual_clip = c``: for ``A < 0`` the per-token objective is bounded below by ``c * A`` (Ye et
  al. 2020).
* ``loss_agg``: ``"seq-mean"`` (mean over each response's tokens, then over responses),
  ``"token-mean"`` (one mean over every response token of the batch, as verl's ``token-mean``;
  DAPO's token-level loss), or ``"seq-mean-token-sum-norm"`` (each response's token *sum* divided by the
  constant ``norm_length``, default the engine's ``max_new``, then the mean over responses: no
  length normalisation, Dr.GRPO, Liu et al. 2025, as verl's mode of that name). Responses with
  no loss tokens (dropped groups) are left out of the mean over responses.
* ``adv_norm``: ``"std"`` (``(r - mean) / (std + eps)``) or ``"none"`` (``r - mean``, Dr.GRPO).
* ``dynamic_sampling``: groups whose rewards are all equal (zero advantage, no gradient) are
  dropped from the update (DAPO); up to ``max_resample`` extra rounds roll out a fresh
  ``prompts_per_step`` prompts each until ``prompts_per_step`` groups with a signal are kept. The
  batch shape stays fixed (no recompilation): if the rounds run out, the missing groups are
  filled with dropped ones whose loss mask is zeroed. Metrics: ``groups_dropped`` (all rounds),
  ``groups_kept`` (in the update), ``resample_rounds``; ``reward_mean`` is the first round's (shaped) reward.
* ``overlong_buffer`` / ``overlong_penalty``: DAPO's soft overlong punishment (eq. 13) added to
  the reward, with ``L_cache = overlong_buffer * L_max`` (a fraction; DAPO: 4096 / 20480 = 0.2)
  and ``L_max`` = ``overlong_max_length`` (default the engine's ``max_new``):
  ``0`` for ``|y| <= L_max - L_cache``, ``((L_max - L_cache) - |y|) / L_cache`` up to ``L_max``,
  ``-1`` beyond, times ``overlong_penalty`` (see :func:`overlong_reward`).
* Presets: ``GRPOConfig.dapo()`` (clip 0.2 / 0.28, token-mean, dynamic sampling with 2 resample
  rounds, overlong buffer 0.2, KL 0) and ``GRPOConfig.dr_grpo()`` (no std and no length
  normalisation, KL 0); ``GRPOConfig.preset(name, **overrides)`` for either by name. With
  ``kl_coef = 0`` the trainer skips the reference forward (the ``kl`` metric is then NaN).

``pi_old`` log-probs are recomputed by the trainer (one forward before the updates) rather than
trusted from the rollout engine, and the new weights are synced into the engine after each step.
Minibatches are length-grouped (``GRPOConfig.length_bucket``): with a long tail most responses
are short, so the update costs what the tokens cost, not batch x the longest response;
``precompile()`` compiles every minibatch width before the first step. The log-probs come from
the model's chunked head (``Decoder.target_logprobs``: no ``[batch, seq, vocab]`` logits), and
``GRPOConfig.remat`` recomputes the blocks' activations in the update's backward pass (the
rollout engine's model is unchanged): what lets a 135M policy with a 49K vocabulary train two
copies side by side on a 24 GB host.
With a ``SpotTrainer`` the drafter trains on the rollout's features (in the background during the
long tail, or ``synchronous``: a fixed number of steps after the policy update, timed apart as
``drafter_seconds``) and is swapped in between rollouts (TLT).

Usage::

  trainer = GRPOTrainer(policy, engine, TaskSampler(seed=0), GRPOConfig(group_size=4))
  trainer.precompile()              # optional: no compilation inside the timed steps
  for _ in range(10):
    metrics = trainer.step()        # reward_mean, rollout_seconds, train_seconds, ...
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import ConfigError, check_min, check_one_of, check_positive, check_range
from jaxsys.models.llm.decoder import Decoder, replace_config
from jaxsys.rl import tasks as tasks_lib
from jaxsys.core.mesh import RULE_SETS, auto_mesh
from jaxsys.core.optim import OptimizerConfig, check_nested
from jaxsys.train import apply_optax, init_optimizer, place_batch, place_states

__all__ = [
    "ADV_NORMS", "build_batch", "group_advantages", "grpo_loss", "GRPOConfig", "GRPOTrainer",
    "LOSS_AGGS", "overlong_reward", "policy_objective", "PRESETS",
    "token_logprobs", "train_mesh", "zero_variance_groups",
]

LOSS_AGGS = ("seq-mean", "token-mean", "seq-mean-token-sum-norm")
ADV_NORMS = ("std", "none")
PRESETS = ("dapo", "dr_grpo")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  group_size: int = 4
  prompts_per_step: int = 8
  clip_eps: float = 0.2
  kl_coef: float = 0.02
  lr: float = 3e-4
  minibatches: int = 2
  # Length-grouped minibatches: responses sorted by length, each minibatch cut to its longest
  # sequence rounded up to a multiple of ``length_bucket`` (0: every batch at the engine's full
  # prompt + response length). Exact for a causal model (padding is masked and never attended
  # by earlier positions); with a long tail, most minibatches are short, so the update's cost
  # follows the total token count rather than batch x longest response.
  length_bucket: int = 32
  seed: int = 0
  # Asymmetric clip range (None: clip_eps), dual-clip bound (None: off) and loss aggregation.
  clip_low: float | None = None
  clip_high: float | None = None
  dual_clip: float | None = None
  loss_agg: str = "seq-mean"
  # Dr.GRPO: advantage normalisation and the constant of "seq-mean-token-sum-norm" (None: the
  # engine's max_new).
  adv_norm: str = "std"
  norm_length: int | None = None
  # DAPO: dynamic sampling (drop zero-variance groups, up to max_resample refill rounds) and the
  # overlong reward shaping (buffer as a fraction of L_max; 0 disables it).
  dynamic_sampling: bool = False
  max_resample: int = 0
  overlong_buffer: float = 0.0
  overlong_penalty: float = 1.0
  overlong_max_length: int | None = None
  # Rematerialise each block in the update's backward pass (activation memory of one block
  # instead of all of them, for ~1/3 more update FLOPs).
  remat: bool = False
  # The update's optimizer (jaxsys.core.optim); None: Adam at ``lr``. Given, it owns the
  # learning rate, and ``lr`` must stay at its default.
  optimizer: OptimizerConfig | None = None

  def __post_init__(self):
    check_min(self, 2, "group_size", note=" (advantages are group-relative)")
    check_min(self, 1, "prompts_per_step")
    check_range("clip_eps", self.clip_eps, 0, 1, lo_open=True, hi_open=True)
    for name in ("clip_low", "clip_high"):
      if getattr(self, name) is not None:
        check_range(name, getattr(self, name), 0, 1, lo_open=True, hi_open=True)
    if self.dual_clip is not None:
      check_range("dual_clip", self.dual_clip, 1, None, lo_open=True)
    check_one_of("loss_agg", self.loss_agg, LOSS_AGGS)
    check_one_of("adv_norm", self.adv_norm, ADV_NORMS)
    for name in ("norm_length", "overlong_max_length"):
      if getattr(self, name) is not None:
        check_min(self, 1, name, note=" (or None: the engine's max_new)")
    check_min(self, 0, "max_resample")
    if self.max_resample and not self.dynamic_sampling:
      raise ConfigError(f"max_resample={self.max_resample} needs dynamic_sampling=True")
    check_range("overlong_buffer", self.overlong_buffer, 0, 1, hi_open=True,
                note=" (a fraction of the max response length; 0 disables the shaping)")
    check_min(self, 0, "overlong_penalty")
    check_min(self, 0, "kl_coef")
    check_positive(self, "lr")
    check_nested(self, "lr")
    check_min(self, 0, "length_bucket", note=" (0 disables length grouping)")
    n = self.group_size * self.prompts_per_step
    if self.minibatches < 1 or n % self.minibatches:
      raise ConfigError(f"minibatches={self.minibatches} must divide group_size*prompts_per_step={n}")

  @classmethod
  def dapo(cls, **overrides) -> "GRPOConfig":
    """DAPO (Yu et al. 2025): clip-higher 0.2 / 0.28, token-mean, dynamic sampling (2 refill
    rounds), overlong shaping over the last 20% of the max length, no KL term."""
    kw = dict(clip_low=0.2, clip_high=0.28, loss_agg="token-mean", dynamic_sampling=True,
              max_resample=2, overlong_buffer=0.2, overlong_penalty=1.0, kl_coef=0.0)
    return cls(**{**kw, **overrides})

  @classmethod
  def dr_grpo(cls, **overrides) -> "GRPOConfig":
    """Dr.GRPO (Liu et al. 2025): advantages ``r - mean`` (no std), response token sums over a
    constant length (no length normalisation), no KL term."""
    kw = dict(adv_norm="none", loss_agg="seq-mean-token-sum-norm", kl_coef=0.0)
    return cls(**{**kw, **overrides})

  @classmethod
  def preset(cls, name: str, **overrides) -> "GRPOConfig":
    """``"dapo"`` or ``"dr_grpo"`` (see :meth:`dapo`, :meth:`dr_grpo`) with ``overrides``."""
    check_one_of("preset", name, PRESETS)
    return getattr(cls, name)(**overrides)

  def optimizer_config(self) -> OptimizerConfig:
    """The update's optimizer: ``optimizer``, or Adam at ``lr``."""
    return self.optimizer or OptimizerConfig("adam", lr=self.lr)

  @property
  def clip_range(self) -> tuple[float, float]:
    """``(clip_low, clip_high)`` with ``clip_eps`` filling the unset side(s)."""
    lo = self.clip_eps if self.clip_low is None else self.clip_low
    hi = self.clip_eps if self.clip_high is None else self.clip_high
    return lo, hi

  def objective_kwargs(self) -> dict:
    """Keyword arguments of :func:`policy_objective` for this config."""
    lo, hi = self.clip_range
    return dict(clip_low=lo, clip_high=hi, dual_clip=self.dual_clip, kl_coef=self.kl_coef,
                loss_agg=self.loss_agg, norm_length=self.norm_length)


def group_advantages(rewards, eps: float = 1e-6, norm: str = "std"):
  """``rewards [prompts, G] -> (r - mean) / (std + eps)`` per group (``norm="none"``:
  ``r - mean``, Dr.GRPO)."""
  check_one_of("norm", norm, ADV_NORMS)
  r = jnp.asarray(rewards, jnp.float32)
  centred = r - r.mean(-1, keepdims=True)
  return centred if norm == "none" else centred / (r.std(-1, keepdims=True) + eps)


def zero_variance_groups(rewards) -> np.ndarray:
  """``rewards [prompts, G] -> bool[prompts]``: the groups whose rewards are all equal (their
  advantages are all 0: no gradient), which DAPO's dynamic sampling drops."""
  r = np.asarray(rewards, np.float64)
  return r.max(-1) == r.min(-1)


def overlong_reward(length, max_length: int, buffer: int, penalty: float = 1.0):
  """DAPO eq. 13, times ``penalty``: ``0`` for ``length <= max_length - buffer``, a linear ramp
  ``((max_length - buffer) - length) / buffer`` down to ``-1`` at ``max_length``, ``-1`` beyond.

  ``length`` (int or array) counts response tokens; ``buffer`` is ``L_cache`` in tokens.
  """
  if not 1 <= buffer <= max_length:
    raise ConfigError(f"buffer={buffer} must be in [1, max_length={max_length}]")
  n = np.asarray(length, np.float64)
  ramp = np.clip(((max_length - buffer) - n) / buffer, -1.0, 0.0)
  return penalty * np.where(n > max_length, -1.0, ramp)


def token_logprobs(model, tokens):
  """``log pi(x_{t+1} | x_<=t)``: ``int[b, S] -> float32[b, S-1]`` (the head in chunks,
  ``Decoder.target_logprobs``: the ``[b, S, vocab]`` logits never exist at once)."""
  h, _ = model.forward_hidden(tokens)
  return model.target_logprobs(h[:, :-1], tokens[:, 1:])


def policy_objective(logp, old_logp, ref_logp, mask, adv, *, clip_low: float, clip_high: float,
                     kl_coef: float, dual_clip: float | None = None, loss_agg: str = "seq-mean",
                     norm_length: int | None = None):
  """The GRPO loss (negated objective) from log-probs ``[b, T]``, ``mask [b, T]``, ``adv [b]``.

  Per token: ``s = min(rho A, clip(rho, 1-clip_low, 1+clip_high) A)``; with ``dual_clip = c``,
  ``s = max(s, c A)`` where ``A < 0``; ``obj = s - kl_coef * KL3``. Aggregated per response then
  over responses (``"seq-mean"``), over all response tokens at once (``"token-mean"``), or as
  each response's token sum over ``norm_length`` then over responses
  (``"seq-mean-token-sum-norm"``). The means over responses count only rows with a loss token.
  Returns ``(loss, {"kl", "clip_frac"})``.
  """
  check_one_of("loss_agg", loss_agg, LOSS_AGGS)
  if loss_agg == "seq-mean-token-sum-norm" and (norm_length is None or norm_length < 1):
    raise ConfigError(f"loss_agg={loss_agg!r} needs norm_length >= 1, got {norm_length!r}")
  ratio = jnp.exp(logp - old_logp)
  a = adv[:, None]
  surr = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip_low, 1 + clip_high) * a)
  if dual_clip is not None:
    surr = jnp.where(a < 0, jnp.maximum(surr, dual_clip * a), surr)
  log_r = ref_logp - logp
  kl = jnp.exp(log_r) - log_r - 1.0
  per_tok = surr - kl_coef * kl
  rows = jnp.maximum((mask.sum(-1) > 0).sum(), 1.0)  # responses with a loss token
  if loss_agg == "token-mean":
    agg = lambda x: (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)  # noqa: E731
  else:
    # [b]: per-response mean (seq-mean) or sum over a constant length (Dr.GRPO)
    n = jnp.maximum(mask.sum(-1), 1.0) if loss_agg == "seq-mean" else float(norm_length)
    agg = lambda x: ((x * mask).sum(-1) / n).sum() / rows  # noqa: E731
  clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)) * mask
  return -agg(per_tok), {"kl": agg(kl), "clip_frac": clipped.sum() / jnp.maximum(mask.sum(), 1.0)}


def grpo_loss(model, tokens, mask, adv, old_logp, ref_logp, clip_eps: float, kl_coef: float, *,
              clip_high: float | None = None, dual_clip: float | None = None,
              loss_agg: str = "seq-mean", norm_length: int | None = None):
  """Clipped surrogate + k3 KL of ``model`` on ``tokens`` (negated: minimise); see
  :func:`policy_objective` (``clip_eps`` is the low side, and the high side unless ``clip_high``).

  ``mask [b, S-1]`` marks log-prob positions that predict response tokens; ``adv [b]``.
  """
  logp = token_logprobs(model, tokens)
  return policy_objective(logp, old_logp, ref_logp, mask, adv, clip_low=clip_eps,
                          clip_high=clip_eps if clip_high is None else clip_high,
                          kl_coef=kl_coef, dual_clip=dual_clip, loss_agg=loss_agg,
                          norm_length=norm_length)


def build_batch(examples, responses, seq_len: int, pad: int = tasks_lib.EOS):
  """Prompt + response token arrays ``int[n, seq_len]`` and the response log-prob mask."""
  n = len(examples)
  tokens = np.full((n, seq_len), pad, np.int32)
  mask = np.zeros((n, seq_len - 1), np.float32)
  for i, (ex, resp) in enumerate(zip(examples, responses)):
    seq = list(ex.prompt) + list(resp)
    if len(seq) > seq_len:
      raise ConfigError(f"prompt+response length {len(seq)} exceeds seq_len={seq_len}")
    tokens[i, :len(seq)] = seq
    mask[i, len(ex.prompt) - 1:len(seq) - 1] = 1.0
  return tokens, mask


class GRPOTrainer:
  """One ``step()`` = rollout (engine) -> rewards -> advantages -> clipped updates -> weight sync."""

  def __init__(self, policy, engine, tasks: tasks_lib.TaskSampler, config: GRPOConfig, *,
               buffer=None, spot=None, temperature_check: bool = True, reward_fn=None,
               pad_id: int = tasks_lib.EOS, mesh=None, rules: str = "fsdp"):
    """``reward_fn(example, response) -> float`` (default ``tasks.reward``); ``pad_id`` pads
    the training batch (masked out of the loss). ``mesh``: the update runs sharded, parameters,
    reference and optimizer state placed by ``rules`` ("fsdp" or "tp", ``jaxsys.core.mesh``) and
    minibatches split over "data" (on the mesh's Auto twin); the engine keeps its own placement
    (e.g. ``RolloutEngine(..., mesh=<a "model" mesh>)``: tensor-parallel rollouts)."""
    self.config = config
    self.reward_fn, self.pad_id = reward_fn or tasks_lib.reward, pad_id
    self.engine, self.tasks = engine, tasks
    self.buffer, self.spot = buffer, spot
    if temperature_check and engine.config.sampling.greedy:
      raise ConfigError("GRPO needs sampled rollouts: engine sampling temperature must be > 0")
    self.mesh = train_mesh(mesh, config, rules)
    self.gdef, self.params, self.rest = nnx.split(policy, nnx.Param, ...)
    place_states(policy, self.mesh, rules, self.params)
    if config.remat and not isinstance(policy, Decoder):
      raise ConfigError(f"GRPOConfig.remat needs a jaxsys Decoder policy, got {type(policy).__name__}")
    # the update's graph: the same parameters, blocks rematerialised when config.remat
    self.train_gdef = (nnx.split(replace_config(policy, remat=True), nnx.Param, ...)[0]
                       if config.remat else self.gdef)
    # the reference policy is only read when its KL term has weight (not by DAPO / Dr.GRPO)
    self.ref_params = (jax.tree.map(jnp.copy, self.params) if self.mesh is not None
                       else copy.deepcopy(jax.device_get(self.params))) if config.kl_coef else None
    self.tx = config.optimizer_config().build()
    self.opt_state = init_optimizer(self.tx, self.params, self.mesh)
    self.rng = np.random.default_rng(config.seed)
    self.step_count = 0
    self.seq_len = engine.config.max_prompt + engine.config.max_new
    max_new = engine.config.max_new
    self.norm_length = config.norm_length or max_new
    self.overlong_max = config.overlong_max_length or max_new
    # L_cache in tokens: at least one when the shaping is on.
    self.overlong_cache = max(1, round(config.overlong_buffer * self.overlong_max)) \
        if config.overlong_buffer else 0
    self._logp = jax.jit(lambda gdef, p, rest, t: token_logprobs(nnx.merge(gdef, p, rest), t),
                         static_argnums=0)
    self._update = jax.jit(self._update_fn, static_argnums=0)
    engine.set_weights(self.policy)

  def _on_mesh(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _put(self, x):
    """A host minibatch array, split over "data" on the trainer's mesh (as ``train`` places one)."""
    return place_batch(x, self.mesh)

  @property
  def policy(self):
    return nnx.merge(self.gdef, self.params, self.rest)

  def _update_fn(self, gdef, params, rest, opt_state, tokens, mask, adv, old_logp, ref_logp):
    c = self.config

    def loss_fn(p):
      kw = c.objective_kwargs()
      return grpo_loss(nnx.merge(gdef, p, rest), tokens, mask, adv, old_logp, ref_logp,
                       kw["clip_low"], c.kl_coef, clip_high=kw["clip_high"],
                       dual_clip=c.dual_clip, loss_agg=c.loss_agg, norm_length=self.norm_length)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    params, opt_state = apply_optax(self.tx, grads, opt_state, params)
    return params, opt_state, dict(aux, loss=loss)

  def _width(self, longest: int) -> int:
    b = self.config.length_bucket
    return self.seq_len if b == 0 else min(self.seq_len, -(-int(longest) // b) * b)

  def _minibatches(self, lengths):
    """``(row indices, padded width)`` per minibatch: random rows, or length-sorted rows (ties
    broken at random) in a random minibatch order when ``length_bucket > 0``."""
    c = self.config
    n = len(lengths)
    mb = n // c.minibatches
    perm = self.rng.permutation(n)
    if c.length_bucket:
      perm = perm[np.argsort(lengths[perm], kind="stable")]
    chunks = [perm[k * mb:(k + 1) * mb] for k in self.rng.permutation(c.minibatches)]
    return [(idx, self._width(lengths[idx].max())) for idx in chunks]

  def _logps(self, tokens):
    """Old-policy and reference log-probs of one minibatch (recomputed by the trainer). With
    ``kl_coef == 0`` (DAPO, Dr.GRPO) the reference pass is skipped: its term has weight 0."""
    with self._on_mesh():
      old = self._logp(self.gdef, self.params, self.rest, tokens)
      if self.config.kl_coef == 0:
        return old, old
      return old, self._logp(self.gdef, self.ref_params, self.rest, tokens)

  def precompile(self) -> int:
    """Compile the update for every minibatch width before the first step (outputs discarded,
    state unchanged); returns the number of widths."""
    c = self.config
    mb = c.group_size * c.prompts_per_step // c.minibatches
    widths = sorted({self._width(w) for w in range(1, self.seq_len + 1)})
    for w in widths:
      tokens = self._put(np.zeros((mb, w), np.int32))
      old_logp, ref_logp = self._logps(tokens)
      with self._on_mesh():
        out = self._update(self.train_gdef, self.params, self.rest, self.opt_state, tokens,
                           self._put(np.zeros((mb, w - 1), np.float32)), self._put(np.zeros((mb,), np.float32)),
                           old_logp, ref_logp)
      jax.block_until_ready(out)
    return len(widths)

  def rewards(self, examples, responses) -> np.ndarray:
    """``reward_fn`` per response plus DAPO's overlong shaping (when ``overlong_buffer > 0``)."""
    r = np.array([self.reward_fn(ex, t) for ex, t in zip(examples, responses)], np.float32)
    if self.overlong_cache:
      lengths = np.array([len(t) for t in responses])
      r = r + overlong_reward(lengths, self.overlong_max, self.overlong_cache,
                              self.config.overlong_penalty).astype(np.float32)
    return r

  def _generate(self, examples, round_: int):
    """One rollout of ``examples`` (the drafter trains in its long tail when spot is set)."""
    c = self.config
    target = self.policy
    background = self.spot is not None and not getattr(self.spot, "synchronous", False)
    hook = (lambda: self.spot.start(target)) if background else None
    # round 0 keeps the seed schedule of a step without resampling
    res = self.engine.generate([list(ex.prompt) for ex in examples],
                               seed=(c.seed * 100003 + self.step_count + 1000003 * round_) % 2**32,
                               on_long_tail=hook)
    if background:
      state = self.spot.stop()
      if state is not None:
        self.engine.set_drafter(state)  # swap the updated drafter in between rollouts
    return res

  def step(self) -> dict:
    c = self.config
    P, G = c.prompts_per_step, c.group_size
    t0, c0 = time.perf_counter(), time.process_time()
    rounds = 1 + (c.max_resample if c.dynamic_sampling else 0)
    kept, dropped, results, first_rewards = [], [], [], None
    for round_ in range(rounds):
      prompts = self.tasks.sample(P, self.rng)
      examples = [ex for ex in prompts for _ in range(G)]
      res = self._generate(examples, round_)
      results.append(res)
      r = self.rewards(examples, res.tokens).reshape(P, G)
      first_rewards = r if first_rewards is None else first_rewards
      flat = zero_variance_groups(r) if c.dynamic_sampling else np.zeros(P, bool)
      for p in range(P):
        group = (examples[p * G:(p + 1) * G], res.tokens[p * G:(p + 1) * G], r[p])
        (dropped if flat[p] else kept).append(group)
      if len(kept) >= P:
        break
    t1, c1 = time.perf_counter(), time.process_time()
    if self.buffer is not None:
      for res in results:
        self.buffer.add(self.step_count, res.sequences, res.features, res.prompt_lengths)
    # A fixed batch of P groups (fixed shapes: no recompilation); dropped groups fill what the
    # rounds did not, with their loss mask zeroed.
    n_kept = min(len(kept), P)
    batch = kept[:n_kept] + dropped[:P - n_kept]
    examples = [ex for g in batch for ex in g[0]]
    responses = [t for g in batch for t in g[1]]
    rewards = np.stack([g[2] for g in batch])                          # [P, G]
    valid = np.repeat(np.arange(P) < n_kept, G)                        # [P*G] rows in the update
    adv = np.asarray(group_advantages(rewards, norm=c.adv_norm)).reshape(-1) * valid
    tokens, mask = build_batch(examples, responses, self.seq_len, self.pad_id)
    mask *= valid[:, None]
    # dropped rows sort first at length 1, so they do not widen a minibatch
    seq_lengths = np.where(valid, [len(ex.prompt) + len(t) for ex, t in zip(examples, responses)], 1)
    batches = []
    for idx, width in self._minibatches(seq_lengths):  # pi_old is the rollout policy: all before any update
      if not valid[idx].any():
        continue  # nothing to learn from; an Adam step on zero gradients would still move weights
      # device_put, not jnp.asarray: the latter compiles a staging copy per new width.
      mb_tokens, mb_mask = self._put(tokens[idx, :width]), self._put(mask[idx, :width - 1])
      batches.append((mb_tokens, mb_mask, self._put(adv[idx]), *self._logps(mb_tokens)))
    train_tokens = sum(int(np.prod(bt[0].shape)) for bt in batches)  # incl. padding to the width
    aux = {"loss": np.nan, "kl": np.nan, "clip_frac": np.nan}
    for batch in batches:
      with self._on_mesh():
        self.params, self.opt_state, aux = self._update(self.train_gdef, self.params, self.rest,
                                                        self.opt_state, *batch)
    jax.block_until_ready(self.params)
    self.engine.set_weights(self.policy)
    t2, c2 = time.perf_counter(), time.process_time()
    if self.spot is not None and getattr(self.spot, "synchronous", False):
      # Drafter updates between rollouts, on this rollout's features and the new policy's
      # head; timed apart from the step (TLT runs them on resources the rollout leaves idle).
      state = self.spot.train_now(self.policy)
      if state is not None:
        jax.block_until_ready(state)
        self.engine.set_drafter(state)
    t3, c3 = time.perf_counter(), time.process_time()
    self.step_count += 1
    generated = [t for res in results for t in res.tokens]
    lengths = np.array([len(t) for t in generated])
    spec = sum(res.stats["spec_steps"] for res in results)
    accepted = (sum(res.stats["mean_accepted"] * res.stats["spec_steps"] for res in results) / spec
                if spec and len(results) > 1 else results[0].stats["mean_accepted"])
    return {"step": self.step_count, "reward_mean": float(first_rewards.mean()),
            "rollout_seconds": t1 - t0, "train_seconds": t2 - t1, "step_seconds": t2 - t0,
            "rollout_cpu_seconds": c1 - c0, "step_cpu_seconds": c2 - c0,
            "drafter_seconds": t3 - t2, "drafter_cpu_seconds": c3 - c2,
            "mean_accepted": accepted, "spec_steps": spec,
            "vanilla_steps": sum(res.stats["vanilla_steps"] for res in results),
            "len_mean": float(lengths.mean()), "len_max": int(lengths.max()),
            "train_tokens": train_tokens, "loss": float(aux["loss"]),
            "kl": float(aux["kl"]) if c.kl_coef else float("nan"),  # no reference pass at 0
            "clip_frac": float(aux["clip_frac"]), "groups_dropped": len(dropped),
            "groups_kept": n_kept, "resample_rounds": len(results) - 1, "responses": generated}


def train_mesh(mesh, config: GRPOConfig, rules: str):
  """The Auto twin of a trainer's mesh (the layers' annotations are hints there), or None;
  the minibatch rows must divide over its "data" axis."""
  if mesh is None:
    return None
  check_one_of("rules", rules, tuple(RULE_SETS))
  rows = config.group_size * config.prompts_per_step // config.minibatches
  data = mesh.shape.get("data", 1)
  if rows % data:
    raise ConfigError(f"a minibatch of {rows} rows (group_size x prompts_per_step / minibatches) "
                      f"does not divide over the mesh's data={data} axis")
  return auto_mesh(mesh)
