"""Tensor-parallel serving: ``ServingEngine(..., mesh=...)`` shards the weights (the "tp" rules)
and every cache pool's kv-head axis over "model"; greedy outputs are token-identical to one
device, dense and LServe, on Auto and Explicit meshes."""

import jax
import numpy as np
import pytest

import jaxsys.models as M
from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import make_mesh
from jaxsys.serving import ServingConfig, ServingEngine
from jaxsys.serving.lserve import LServeConfig

CFG = M.DecoderConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=8, num_kv_heads=4, max_position_embeddings=512)
PROMPTS = [list(np.random.default_rng(i).integers(3, 256, n)) for i, n in enumerate((5, 17, 40, 23, 50))]


def _serve(mesh=None, dense=True, new=16):
  ls = LServeConfig(dense=dense, page_size=16, logical_page_size=4, token_budget=32, sink=16, window=32)
  engine = ServingEngine(M.random_model(CFG, seed=0), ServingConfig(lserve=ls, max_batch=4, num_pages=64,
                                                                    max_seq_len=256),
                         streaming=None if dense else [[h % 2 == 0 for h in range(4)]] * 2, mesh=mesh,
                         stop_tokens=())
  return engine, engine.generate(PROMPTS, max_new_tokens=new).tokens


@pytest.mark.parametrize("tp,dense", [(2, True), (4, True), (4, False)], ids=["tp2-dense", "tp4-dense", "tp4-lserve"])
def test_tp_greedy_tokens_equal_one_device(tp, dense):
  _, ref = _serve(dense=dense)
  engine, got = _serve(make_mesh({"model": tp}, jax.devices()[:tp]), dense=dense)
  assert got == ref
  pool = engine.cache.state.k[0]      # dense: 4 kv heads; LServe: 2 retrieval heads per layer
  sharded = pool.shape[1] % tp == 0
  assert (tuple(pool.sharding.spec)[1:2] == ("model",)) == sharded and len(pool.sharding.device_set) == tp
  assert engine.model.layers[0].attn.wq[...].sharding.spec != jax.sharding.PartitionSpec()


def test_explicit_mesh_and_errors():
  _, ref = _serve(new=8)
  _, got = _serve(jax.make_mesh((2,), ("model",)), new=8)   # Explicit axes: served on the Auto twin
  assert got == ref
  with pytest.raises(ConfigError, match="model' axis only"):
    _serve(make_mesh({"data": 2, "model": 2}, jax.devices()[:4]))
  with pytest.raises(ConfigError, match="num_kv_heads=4"):
    _serve(make_mesh({"model": 8}))


def test_serve_cli_takes_a_mesh(tmp_path):
  """``jaxsys serve --mesh model=2`` (prompt-file mode here) gives one device's greedy tokens."""
  import json

  from jaxsys.serving import cli
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("\n".join(json.dumps({"tokens": [int(t) % 100 for t in p[:12]]}) for p in PROMPTS[:3]) + "\n")
  outs = []
  for extra in ([], ["--mesh", "model=2"]):
    out = tmp_path / f"out{len(extra)}.jsonl"
    assert cli.main(["--model", "tiny", "--prompts", str(prompts), "--max-new-tokens", "6", "--out", str(out),
                     *extra]) == 0
    outs.append([json.loads(line)["tokens"] for line in out.read_text().splitlines()])
  assert outs[0] == outs[1]
