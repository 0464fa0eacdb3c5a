"""The speculative prefill runs through the decoding core's causal prefill, so the attention layout
skips every block above the diagonal (a dense ``[b, Lp, Lp]`` tree mask would visit them all)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.models import DecoderConfig
from jaxsys.models.llm.decoder import random_model
from jaxsys.ops.attn import layout as layout_lib
from jaxsys.speculative import decode as dec
from jaxsys.speculative.engine import _dummy_drafter_cfg

# A config of its own, so no jit cache entry of another test hides the trace.
CFG = DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2)
LP = 1024  # several query and key tiles of the XLA backend's causal tiles (512 x 256)


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
  for lay in seen:
    # Tiles come from the layout (the backend's choice); the causal block count follows from them.
    bq, bk = lay.block_q, lay.block_k
    nq, nk = -(-LP // bq), -(-LP // bk)
    assert lay.cls.shape[1:] == (nq, nk)
    assert nq > 1 and nk > 1, f"{LP=} must span several tiles ({bq=}, {bk=})"
    # q block i sees the key blocks up to its last row: ceil((last row + 1) / bk) of them.
    causal = sum(min(nk, -(-min((i + 1) * bq, LP) // bk)) for i in range(nq))
    visited = int((lay.cls != layout_lib.SKIP).sum())
    assert causal < nq * nk
    assert visited == causal, f"visited {visited} of {nq * nk} blocks; causal needs {causal}"
