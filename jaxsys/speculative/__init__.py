"""TLT speculative decoding for RL rollouts.

Sampling parameters and the processed target distribution acceptance works on are the decoding
core's (``jaxsys.decoding.sampling``); the target runs through ``Decoder.forward_hidden`` with a
``jaxsys.decoding.cache.TreeCache``.

* ``tree``: draft-tree selection, ancestor mask, positions, ``TreeMask`` for ``jaxsys.ops.attention``.
* ``acceptance``: lossless greedy / rejection-sampling acceptance over siblings (pure functions).
* ``forward``, ``decode``: tree-masked target/drafter passes over a contiguous KV cache,
  commit/rollback, and the prefill / vanilla / draft / verify steps.
* ``lookup``: drafts copied from a row's history and reference tokens (``Strategy.lookup_chain``;
  no drafter model), e.g. the finished responses of its GRPO group.
* ``bandit``: ``Strategy`` and the bucketed epsilon-greedy ``BucketedBandit``.
  Also UCB1, median values and fastrl's BEG mode; ``BucketedBandit.fastrl()``, ``fastrl_strategies``.
* ``pool``: ``ExecutablePool`` of ahead-of-time compiled executables; persistent compile cache.
* ``engine``: ``RolloutEngine`` (speculation in the long tail, strategy bandit, bucketed batches).
* ``online``: drafter buffer, trainer, background spot trainer and orbax checkpoints.
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Tree": "tree", "TreeMask": "tree", "select_tree": "tree", "ancestor_matrix": "tree",
    "accept_tree": "acceptance", "accept_batch": "acceptance",
    "Strategy": "bandit", "BucketedBandit": "bandit",
    "fastrl_strategies": "bandit",
    "ExecutablePool": "pool", "enable_persistent_cache": "pool",
    "RolloutEngine": "engine", "RolloutConfig": "engine",
    "lookup_draft": "lookup", "build_references": "lookup",
    "DrafterBuffer": "online", "DrafterTrainer": "online", "SpotTrainer": "online",
    "save_drafter": "online", "load_drafter": "online",
})
