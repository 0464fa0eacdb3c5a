"""RL on top of the rollout engine: GRPO trainer, synthetic verifiable tasks, a tiny policy.

* ``grpo``: ``GRPOTrainer`` / ``GRPOConfig`` (group advantages, clipped surrogate, k3 KL).
* ``tasks``: long-tailed ``count`` (retrieval) and ``add`` (arithmetic) tasks with rewards.
* ``chat_tasks``: ``ChatTaskSampler``: long-tailed verifiable chat tasks for a real chat model
  (count / list / repeat / sort N items, worked arithmetic) with a format reward.
* ``policy``: config and supervised warm-up of the tiny policy used by experiments/tlt.py.
* ``tlt``: ``make_tlt_trainer`` / ``TLTConfig``: TLT assembled (rollout engine + online drafter
  buffer, trainer and spot scheduling + GRPO), or its vanilla baseline.
* ``video_grpo``: ``VideoGRPOTrainer`` / ``VideoGRPOConfig``: LongVILA-R1 MR-SP, GRPO on long videos
  with cached vision embeddings and sequence-parallel passes; ``video_tasks``: verifiable video QA.
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "GRPOTrainer": "grpo", "GRPOConfig": "grpo", "group_advantages": "grpo", "grpo_loss": "grpo",
    "TaskSampler": "tasks", "reward": "tasks",
    "policy_config": "policy", "pretrain_policy": "policy", "cached_policy": "policy",
    "TLTConfig": "tlt", "TLT": "tlt", "make_tlt_trainer": "tlt",
    "VideoGRPOTrainer": "video_grpo", "VideoGRPOConfig": "video_grpo", "policy_objective": "grpo",
    "VideoTaskSampler": "video_tasks",
    "ChatTaskSampler": "chat_tasks", "overlong_reward": "grpo",
})
