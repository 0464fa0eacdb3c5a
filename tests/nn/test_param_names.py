"""Parameter names follow flax's (``Embed.embedding``, ``RMSNorm.scale``, ``QuantLinear.kernel``),
and checkpoints written under the former names (``weight``) still restore: ``Checkpointer.restore(...,
renames=jaxsys.nn.FLAX_RENAMES)``, which ``jaxsys.train`` resumes through."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.checkpoint import Checkpointer
from jaxsys.core.errors import InputError
from jaxsys.models import DecoderConfig
from jaxsys.models.llm.decoder import Decoder
from jaxsys.nn import FLAX_RENAMES, Embed, RMSNorm

CFG = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def test_layers_use_flax_names():
  assert set(nnx.to_pure_dict(nnx.state(Embed(10, 4, rngs=nnx.Rngs(0)), nnx.Param))) == {"embedding"}
  assert set(nnx.to_pure_dict(nnx.state(RMSNorm(4), nnx.Param))) == {"scale"}
  flat = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(Decoder(CFG, rngs=nnx.Rngs(0)), nnx.Param))]
  assert not [p for p in flat if p.endswith("weight")], flat


def _old_names(d):
  """The state as the former names wrote it: ``embedding`` and ``scale`` leaves were ``weight``."""
  if not isinstance(d, dict):
    return d
  return {("weight" if k in ("embedding", "scale") else k): _old_names(v) for k, v in d.items()}


def test_checkpoint_under_former_names_restores(tmp_path):
  old = Decoder(CFG, rngs=nnx.Rngs(1))
  with Checkpointer(tmp_path, max_to_keep=None) as ck:
    ck.save(0, {"params": _old_names(nnx.to_pure_dict(nnx.state(old, nnx.Param))), "step": 0})
  new = Decoder(CFG, rngs=nnx.Rngs(2))
  like = {"params": nnx.to_pure_dict(nnx.state(new, nnx.Param)), "step": 0}
  with Checkpointer(tmp_path, max_to_keep=None) as ck:
    with pytest.raises(InputError, match="renames="):
      ck.restore(0, like=like)
    got = ck.restore(0, like=like, renames=FLAX_RENAMES)
  want = nnx.to_pure_dict(nnx.state(old, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, got["params"], want)
  nnx.update(new, got["params"])
  tokens = np.arange(12).reshape(2, 6) % CFG.vocab_size
  np.testing.assert_array_equal(new(tokens), old(tokens))
