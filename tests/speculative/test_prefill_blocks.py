"""The speculative prefill runs through the decoding core's causal prefill, so the attention layout
skips every block above the diagonal (a dense ``[b, Lp, Lp]`` tree mask would visit them all)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.models import DecoderConfig
from jaxsys.models.decoder import random_model
from jaxsys.ops.attn import layout as layout_lib
from jaxsys.speculative import decode as dec
from jaxsys.speculative.engine import _dummy_drafter_cfg

# A config of its own, so no jit cache entry of another test hides the trace.
CFG = DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2)
LP = 1024  # 4 x 4 blocks of 256 (the XLA backend's default tile)


def test_speculative_prefill_visits_only_causal_blocks(monkeypatch):
  seen = []
  real = layout_lib.compile_layout

  def spy(*args, **kwargs):
    lay = real(*args, **kwargs)
    seen.append(lay)
    return lay

  monkeypatch.setattr(layout_lib, "compile_layout", spy)
  model = random_model(CFG, seed=0)
  cfg = dec.DecodeConfig(max_len=LP + 8, max_new=4, max_depth=1)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, LP)), jnp.int32)
  lengths = jnp.asarray([LP, LP - 100], jnp.int32)
  state = dec.init_state(model, _dummy_drafter_cfg(CFG), prompts, lengths, cfg, jax.random.key(0))
  state = jax.jit(lambda s: dec.prefill(model, s, prompts, lengths, cfg))(state)
  assert int(state.n_out[0]) == 1
  assert len(seen) == CFG.num_layers, "one block-sparse attention call per layer"
  nq = LP // 256
  for lay in seen:
    visited = int((lay.cls != layout_lib.SKIP).sum())
    assert lay.cls.shape[1:] == (nq, nq)
    assert visited == nq * (nq + 1) // 2, f"visited {visited} of {nq * nq} blocks; causal needs 10"
