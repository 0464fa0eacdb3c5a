"""Strategy bandit on a stationary synthetic reward; executable pool counting compilations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.speculative.bandit import BucketedBandit, Strategy, bucket_of
from jaxsys.speculative.pool import ExecutablePool, aot_compile, enable_persistent_cache


def test_bandit_picks_best_arm_per_bucket():
  arms = [Strategy.chain(2), Strategy.chain(4), Strategy(3, 2, 6)]
  bandit = BucketedBandit(arms, buckets=(1, 8), epsilon=0.1, seed=0)
  rng = np.random.default_rng(0)
  means = {1: [1.0, 3.0, 2.0], 8: [2.0, 1.0, 1.5]}  # the best arm differs per bucket
  for _ in range(600):
    for batch in (1, 5):
      arm = bandit.select(batch)
      bucket = bucket_of(batch, (1, 8))
      bandit.update(batch, arm, means[bucket][arm] + rng.normal(0, 0.5))
  assert bandit.best(1) == 1 and bandit.best(5) == 0
  pulls1 = [bandit.pulls[(1, a)] for a in range(3)]
  pulls8 = [bandit.pulls[(8, a)] for a in range(3)]
  assert pulls1[1] > 0.8 * 600 and pulls8[0] > 0.8 * 600


def test_bandit_errors():
  with pytest.raises(ConfigError, match="epsilon"):
    BucketedBandit([Strategy.chain(2)], (1,), epsilon=2.0)
  with pytest.raises(ConfigError, match="exceeds the largest bucket"):
    BucketedBandit([Strategy.chain(2)], (1, 2)).select(3)
  with pytest.raises(ConfigError, match="verify_tokens"):
    Strategy(2, 2, 10)
  with pytest.raises(ConfigError, match="depth"):
    Strategy(0, 1, 2)


def test_pool_never_recompiles_cached_bucket():
  pool = ExecutablePool(max_entries=3)
  traces = []

  def f(x):
    traces.append(x.shape)
    return x * 2

  def exe(b):
    return pool.get(("double", b), lambda: aot_compile(f, jax.ShapeDtypeStruct((b,), jnp.float32)))

  for _ in range(3):
    for b in (1, 2, 4):
      np.testing.assert_allclose(np.asarray(exe(b)(jnp.ones(b))), 2.0)
  assert pool.compilations == 3 and len(traces) == 3 and pool.hits == 6
  exe(8)  # a fourth bucket evicts the least recently used one (1)
  assert len(pool) == 3 and pool.evictions == 1 and ("double", 1) not in pool
  exe(1)
  assert pool.compilations == 5


def test_pool_memory_bound_and_errors():
  pool = ExecutablePool(max_entries=10, max_bytes=1)
  for b in (1, 2):
    pool.get(b, lambda b=b: aot_compile(lambda x: x + 1, jax.ShapeDtypeStruct((b,), jnp.float32)))
  assert len(pool) == 1  # over the byte budget: only the newest entry survives
  with pytest.raises(ConfigError, match="max_entries"):
    ExecutablePool(max_entries=0)


def test_persistent_cache_option(tmp_path):
  from jax.experimental.compilation_cache import compilation_cache as cc
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {n: getattr(jax.config, n) for n in names}
  try:
    enable_persistent_cache(tmp_path / "cache")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(3.0)).block_until_ready()
    assert any((tmp_path / "cache").iterdir())  # every executable is stored, however small
  finally:
    # The rest of this worker's tests must not write into (or read from) a temporary directory.
    for n, v in old.items():
      jax.config.update(n, v)
    cc.reset_cache()
