"""jaxsys as a Flax layer library, used the way a user would: their own ``nnx.Module`` built from
``jaxsys.nn``'s public layers (N-D inputs, bf16 compute), trained 5 steps by ``jaxsys.train.train``
on an Explicit ``jax.make_mesh`` mesh (parameters placed by their logical axes; the step runs on
the mesh's Auto twin), saved and restored with orbax (``jaxsys.core.checkpoint.Checkpointer``),
then given jaxsys LoRA adapters and trained with flax's own ``nnx.Optimizer`` + ``nnx.jit``, only
the adapters changing. Nothing private is imported.

The model reads token sequences ``[batch, docs, seq]`` whose positions are also the nodes of a
fixed graph (a chain plus a few long-range edges): token embedding + degree encoding, one
pre-norm transformer block (attention with RoPE and a per-call padding mask, SwiGLU), one graph
block (graph attention, GCN convolution) and a quantized (A2Q) output head.
"""

import jax
import jax.numpy as jnp
import jraph
import numpy as np
import optax
from flax import nnx

from jaxsys.core.checkpoint import Checkpointer
from jaxsys.nn import (A2QConfig, Attention, DegreeEncoding, Embed, GCNConv, GraphAttention,
                       LoRAConfig, LoRAParam, QuantLinear, RMSNorm, RopeConfig, SwiGLU, apply_lora,
                       graph_inputs, load_lora_state, lora_state, merge_lora)
from jaxsys.train import TrainConfig, train

VOCAB, DIM, SEQ = 32, 16, 8
BF16 = jnp.bfloat16
LORA = LoRAConfig(rank=2, alpha=4, targets=("attn/w", "mlp/", "graph_attn/.*kernel", "gcn/.*kernel"))


def chain_graph(n):
  """Positions as nodes: i -> i+1 both ways, plus every node -> node 0 (a hub)."""
  i = np.arange(n - 1)
  senders = np.concatenate([i, i + 1, np.arange(2, n)])
  receivers = np.concatenate([i + 1, i, np.zeros(n - 2, int)])
  return jraph.GraphsTuple(nodes=np.zeros((n, 1), np.float32), edges=None, globals=None,
                           senders=senders.astype(np.int32), receivers=receivers.astype(np.int32),
                           n_node=np.array([n]), n_edge=np.array([senders.size]))


class TokenGraphModel(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    kw = dict(dtype=BF16, param_dtype=jnp.float32, rngs=rngs)
    self.embed = Embed(VOCAB, DIM, **kw)
    self.degree = DegreeEncoding(4, DIM, **kw)
    self.norm1, self.norm2, self.norm3 = (RMSNorm(DIM, dtype=BF16) for _ in range(3))
    self.attn = Attention(DIM, 4, 2, 4, rope=RopeConfig(theta=1e4), **kw)
    self.mlp = SwiGLU(DIM, 2 * DIM, **kw)
    self.graph_attn = GraphAttention(DIM, 2, **kw)
    self.gcn = GCNConv(DIM, DIM, **kw)
    self.head = QuantLinear(DIM, VOCAB, A2QConfig(init_weight_bits=8), kernel_axes=("embed", "vocab"),
                            **kw)

  def __call__(self, tokens, graph, pad):
    """``tokens int[batch, docs, seq]``, ``pad bool[batch, docs, seq]`` (True: a real token)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    visible = nnx.make_attention_mask(pad, pad)                  # [batch, docs, 1, seq, seq]
    h = self.embed(tokens) + self.degree(graph.degree)           # [batch, docs, seq, dim]
    h = h + self.attn(self.norm1(h), positions, mask=visible)
    h = h + self.mlp(self.norm2(h))
    h = h + self.graph_attn(self.norm3(h), graph, mode="sparse")
    h = h + jax.nn.gelu(self.gcn(h, graph))
    return self.head(h).astype(jnp.float32)                     # [batch, docs, seq, vocab]


def next_token_loss(model, tokens, graph, pad):
  logits = model(tokens, graph, pad)[..., :-1, :]
  weight = (pad[..., 1:] & pad[..., :-1]).astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[..., 1:])
  return jnp.sum(ce * weight), jnp.sum(weight)


def data(seed=0, batch=8, docs=2):
  """A learnable sequence task: each document counts up from a random start (mod VOCAB), and the
  last ``k`` positions of some documents are padding."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, VOCAB, (batch, docs, 1))
  tokens = (start + np.arange(SEQ)) % VOCAB
  length = rng.integers(SEQ // 2, SEQ + 1, (batch, docs, 1))
  pad = np.arange(SEQ) < length
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(pad)


def params_of(model, kind=nnx.Param):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, kind)))


def changed_leaves(before, after):
  flat = jax.tree_util.tree_flatten_with_path(before)[0]
  return [jax.tree_util.keystr(p) for (p, x), y in zip(flat, jax.tree.leaves(after))
          if not np.array_equal(x, y)]


def test_users_model_trains_on_an_explicit_mesh_saves_restores_and_takes_lora(tmp_path):
  graph = graph_inputs(chain_graph(SEQ))
  tokens, pad = data()

  def loss_fn(model, batch):  # jaxsys.train's loss convention: (sum, count, metrics)
    total, count = next_token_loss(model, batch["tokens"], graph, batch["pad"])
    return total, count, {}

  model = TokenGraphModel(rngs=nnx.Rngs(0))
  assert jax.eval_shape(lambda: model(tokens, graph, pad)).shape == (8, 2, SEQ, VOCAB)
  assert jax.eval_shape(lambda: model.attn(model.embed(tokens), tokens)).dtype == BF16
  assert model.attn.wq[...].dtype == jnp.float32             # bf16 compute, f32 parameters

  # 5 steps on an Explicit mesh, parameters placed by their logical axes
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}   # jax's default
  before = params_of(model)
  cfg = TrainConfig(learning_rate=3e-2, warmup_steps=0, total_steps=5, log_every=1)
  result = train(model, lambda step: {"tokens": tokens, "pad": pad}, cfg, loss_fn=loss_fn,
                 mesh=mesh, progress=False)
  losses = [row["loss"] for row in result.history]
  assert len(losses) == 5 and np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  assert len(changed_leaves(before, params_of(model))) == len(jax.tree.leaves(before))  # all trained
  # placed without trailing Nones (the form the compiled step returns), so P(None, "model")
  assert model.attn.wq[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")
  assert model.head.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")

  # orbax through jaxsys's Checkpointer: a fresh model restores to the trained one
  ckpt = Checkpointer(tmp_path / "ckpt")
  ckpt.save(5, {"model": nnx.to_pure_dict(nnx.state(model))})
  fresh = TokenGraphModel(rngs=nnx.Rngs(7))
  state = nnx.state(fresh)
  nnx.replace_by_pure_dict(state, ckpt.restore(like={"model": nnx.to_pure_dict(state)})["model"])
  ckpt.close()
  nnx.update(fresh, state)
  trained = params_of(fresh)
  jax.tree.map(np.testing.assert_array_equal, trained, params_of(model))

  # LoRA on the user's model: adapters on the attention, MLP and graph projections, trained
  # alone by flax's own loop
  names = apply_lora(fresh, LORA, rngs=nnx.Rngs(1))
  assert len(names) == 4 + 3 + 2 + 1, names
  np.testing.assert_array_equal(fresh.attn.wq[...], trained["attn"]["wq"])   # B = 0: W' = W
  base = params_of(fresh)
  optimizer = nnx.Optimizer(fresh, optax.adam(3e-2), wrt=LoRAParam)

  @nnx.jit
  def step(model, optimizer):
    def loss(model):
      total, count = next_token_loss(model, tokens, graph, pad)
      return total / count
    value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, LoRAParam))(model)
    optimizer.update(model, grads)
    return value

  losses = [float(step(fresh, optimizer)) for _ in range(5)]
  assert losses[-1] < losses[0], losses
  changed = changed_leaves(base, params_of(fresh))
  assert changed and all("lora_" in c for c in changed), changed
  w_adapted = np.asarray(fresh.mlp.up[...])                   # W' = W + (alpha / r) A B
  assert not np.allclose(w_adapted, trained["mlp"]["up"], atol=1e-4)

  # the adapters alone load into another copy of the base model; merging folds them in
  other = TokenGraphModel(rngs=nnx.Rngs(0))
  apply_lora(other, LORA, rngs=nnx.Rngs(2))
  nnx.update(other, nnx.state(fresh, nnx.Not(LoRAParam)))       # the base weights
  load_lora_state(other, jax.tree.map(np.asarray, lora_state(fresh)))
  np.testing.assert_array_equal(other.mlp.up[...], w_adapted)
  assert merge_lora(fresh) == len(names) and not nnx.state(fresh, LoRAParam)
  np.testing.assert_array_equal(fresh.mlp.up[...], w_adapted)
