"""Basic Flax NNX layers of decoder language models: RMSNorm, token embedding, SwiGLU MLP.

Every parameter carries ``logical_axes`` metadata ("embed", "mlp", "vocab", "heads", ...) and
activations are constrained by logical name through :func:`constrain`, so one rules table
(``jaxsys.core.mesh.DEFAULT_RULES``) decides how a model is sharded on any mesh.

* RMSNorm (Zhang & Sennrich, 2019): ``y = w * x / sqrt(mean(x^2) + eps)``, computed in float32.
* SwiGLU MLP (Shazeer, 2020): ``down(silu(x W_gate) * (x W_up))``.
* :class:`DecodeWeight`: a linear map stored for memory-bound decode (float32, bfloat16 or
  weight-only int8 with per-output-channel scales); ``jaxsys.models.llm.decoder.pack_for_decode``
  swaps a model's matrices for fused ones of this kind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.core.mesh import entry_axes, entry_ways, explicit_axes, hint, logical_to_spec, put
from jaxsys.nn.explicit import explicit_ok
from jaxsys.core import init as initializers

__all__ = [
    "activation_axes", "constrain", "DECODE_FORMATS", "DecodeWeight", "Embed", "FLAX_RENAMES", "param", "param_specs",
    "quantize_rows_int8",
    "RMSNorm", "row_matmul", "shard_params", "SMALL_M", "state_bytes_per_device", "SwiGLU", "take_rows",
]


#: Parameter names before they followed flax's (``Embed.weight`` -> ``embedding``,
#: ``RMSNorm.weight`` -> ``scale``): ``Checkpointer.restore(..., renames=FLAX_RENAMES)`` reads a
#: checkpoint written under the old names (``jaxsys.train`` resumes through it).
FLAX_RENAMES = {"weight": ("embedding", "scale")}


def constrain(x, logical: Sequence[str | None], rules=None):
  """``with_sharding_constraint`` by logical axis names under the ambient mesh; else identity.

  The ambient mesh is the one set with ``jax.sharding.use_mesh`` / ``jax.set_mesh``; without
  one (or on a one-device mesh) this returns ``x`` unchanged. Only Auto axes are constrained
  (``jaxsys.core.mesh.hint``): on Explicit axes the array's type decides.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return x
  return hint(x, logical_to_spec(logical, mesh, rules), mesh)


def activation_axes(ndim: int, last: str | None) -> tuple[str | None, ...]:
  """Logical names of an ``[..., last]`` activation of rank ``ndim``: ``[batch, seq, last]`` at
  rank 3 (the decoder's layout), ``[batch, ..., seq, last]`` above, ``[batch, last]`` at rank 2,
  so a layer takes any number of leading axes (as ``nnx.Linear`` does) and is still sharded by
  the rules table."""
  if ndim < 1:
    raise ShapeError(f"an activation needs a feature axis, got rank {ndim}")
  lead = ("batch", "seq")[:ndim - 1] if ndim <= 3 else ("batch",) + (None,) * (ndim - 3) + ("seq",)
  return (*lead, last)


def take_rows(table, ids):
  """``table[ids]``: rows ``[*ids.shape, dim]`` of a ``[rows, dim]`` table, on any mesh.

  On Explicit axes a gather must name its output sharding (JAX cannot choose between gathering
  the table and resharding the ids): the rows come out sharded like ``ids`` with ``dim``
  replicated, whatever shards the table (a vocab-sharded embedding is gathered by XLA's
  collectives). Elsewhere it is ``jnp.take``."""
  t_sharding, i_sharding = jax.typeof(table).sharding, jax.typeof(ids).sharding
  meshes = [s.mesh for s in (t_sharding, i_sharding) if s is not None and explicit_axes(s.mesh)]
  if not meshes:
    return jnp.take(table, ids, axis=0)
  ids_spec = tuple(i_sharding.spec) + (None,) * (ids.ndim - len(i_sharding.spec)) if explicit_axes(
      i_sharding.mesh) else (None,) * ids.ndim
  out = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec(*ids_spec, None))
  return table.at[ids].get(out_sharding=out, mode="clip")


def param(rngs: nnx.Rngs, shape, logical, *, init="normal", std=0.02, dtype=jnp.float32):
  """A ``nnx.Param`` with ``logical_axes`` metadata; ``init`` is "normal", "zeros" or "ones"."""
  if init == "normal":
    value = initializers.normal(std)(rngs.params(), shape, jnp.float32)
  elif init in ("zeros", "ones"):  # no key drawn
    value = (initializers.zeros if init == "zeros" else initializers.ones)(None, shape, jnp.float32)
  else:
    raise ValueError(f"{init=} must be 'normal', 'zeros' or 'ones'")
  return nnx.Param(value.astype(dtype), logical_axes=tuple(logical))


def param_specs(module: nnx.Module, mesh, rules=None, *, replicate_indivisible: bool = False):
  """``PartitionSpec`` tree (same structure as ``nnx.state(module, nnx.Param)``) from metadata.

  ``rules``: a rules table or a :data:`jaxsys.core.mesh.RULE_SETS` name ("tp", "fsdp"). A
  parameter dimension that its mesh axes do not divide raises ``ConfigError`` naming the
  parameter, its logical axis and the sizes; ``replicate_indivisible=True`` replicates that
  dimension instead (e.g. 2 kv heads on ``model=4``: each device then holds both heads)."""
  state = nnx.state(module, nnx.Param)

  def spec(path, var):
    names = var.get_metadata().get("logical_axes")
    if not names:
      return jax.sharding.PartitionSpec()
    entries = list(logical_to_spec(names, mesh, rules))
    for i, entry in enumerate(entries):
      ways = entry_ways(entry, mesh.shape)
      if var.get_value().shape[i] % ways:
        if not replicate_indivisible:
          name = "/".join(str(getattr(k, "key", k)) for k in path)
          raise ConfigError(
              f"parameter {name} dimension {i} ({names[i]!r}, size {var.get_value().shape[i]}) does not "
              f"divide mesh axes {entry_axes(entry)} of size {ways} (mesh {dict(mesh.shape)}); use a mesh "
              "whose axes divide it, or replicate_indivisible=True to replicate it")
        entries[i] = None
    return jax.sharding.PartitionSpec(*entries)

  return jax.tree_util.tree_map_with_path(spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def state_bytes_per_device(module: nnx.Module, mesh_shape: dict[str, int], rules=None, *,
                           optimizer_moments: int = 2, replicate_indivisible: bool = False) -> dict:
  """Bytes per device of a training state: parameters (their dtype), gradients (the same) and
  ``optimizer_moments`` float32 copies (AdamW: 2), each sharded as :func:`param_specs` places the
  parameters on a mesh of ``mesh_shape`` (no devices needed: an abstract mesh). ``module`` may be
  abstract (``nnx.eval_shape``), so an 8B model's estimate costs no memory. Activations are not
  counted. Returns ``{"params", "grads", "optimizer", "total"}`` in bytes."""
  mesh = jax.sharding.AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
  specs = param_specs(module, mesh, rules, replicate_indivisible=replicate_indivisible)
  state = nnx.state(module, nnx.Param)
  params = elems = 0
  for var, spec in zip(jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable)),
                       jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, jax.sharding.PartitionSpec))):
    value = var.get_value()
    local = math.prod(value.shape) // math.prod(entry_ways(e, mesh_shape) for e in spec)
    params += local * jnp.dtype(value.dtype).itemsize
    elems += local
  out = {"params": params, "grads": params, "optimizer": optimizer_moments * 4 * elems}
  out["total"] = sum(out.values())
  return out


def shard_params(module: nnx.Module, mesh, rules=None, *, replicate_indivisible: bool = False):
  """Places every parameter of ``module`` on ``mesh`` by its logical axes (in place); ``rules``
  and ``replicate_indivisible`` as :func:`param_specs`."""
  state = nnx.state(module, nnx.Param)
  specs = param_specs(module, mesh, rules, replicate_indivisible=replicate_indivisible)
  shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
  nnx.update(module, put(state, shardings))
  return module


DECODE_FORMATS = ("float32", "bfloat16", "int8")

#: Rows (batch x new tokens) up to which a DecodeWeight matmul reads its weights through the
#: fused multiply-reduce (decode); above it the weights are dequantised and fed to a dot (prefill).
SMALL_M = 16


def quantize_rows_int8(rows):
  """Symmetric int8 per row: ``rows [out, in] ~= q [out, in] * scale [out, 1]``.

  ``scale = max|row| / 127`` (1 for an all-zero row), ``q = round(row / scale)``: the error of
  every entry is at most ``scale / 2``.
  """
  rows = jnp.asarray(rows, jnp.float32)
  amax = jnp.max(jnp.abs(rows), axis=-1)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(rows / scale[:, None]), -127, 127).astype(jnp.int8)
  return q, scale


def row_matmul(x, rows, scale=None):
  """``x [m, in] @ (rows [out, in] * scale[:, None]).T -> float32 [m, out]`` (``rows`` f32,
  bf16 or int8, dequantised inside the matmul; ``scale [out]`` or None).

  XLA:CPU has no fast dot for int8 or bf16 weights against f32 activations: a ``convert``
  feeding a dot becomes a scalar loop (~20x slower than the f32 gemv here). For decode (``m <=
  SMALL_M``) the product is instead the row reduction ``sum_k rows[n, k] * x[m, k]``, which XLA
  fuses (convert included) and runs on all cores, reading each weight byte once. A single row
  takes a slow one-row reduction path, so ``m`` is padded to 2. Prefill is compute-bound: there
  the rows are dequantised to f32 and fed to a dot.
  """
  if x.ndim != 2 or rows.ndim != 2 or x.shape[1] != rows.shape[1]:
    raise ShapeError(f"row_matmul takes x [m, in] and rows [out, in], got {x.shape} and {rows.shape}")
  m = x.shape[0]
  xf = x.astype(jnp.float32)
  if m <= SMALL_M:
    if m < 2:
      xf = jnp.concatenate([xf, jnp.zeros_like(xf)], axis=0)
    # Tie the weights to the (loop-variant) activations: inside a decode while_loop XLA would
    # otherwise hoist the loop-invariant convert out of the loop and materialise every weight in
    # f32 once, so each step would read 4 bytes per weight instead of 1 or 2.
    rows, xf = jax.lax.optimization_barrier((rows, xf))
    prod = rows.astype(jnp.float32)[:, None, :] * xf[None, :, :]   # [out, m, in], fused away
    y = jnp.sum(prod, axis=-1).T[:m]                                 # [m, out]
  else:
    y = jnp.einsum("mk,nk->mn", xf, rows.astype(jnp.float32))
  return y if scale is None else y * scale.astype(jnp.float32)


class DecodeWeight(nnx.Module):
  """A linear map ``[in, out]`` stored for memory-bound decode, as rows ``w [out, in]`` (each
  output channel's weights contiguous):

  * ``"float32"``: f32 rows;
  * ``"bfloat16"``: bf16 rows, half the bytes;
  * ``"int8"``: int8 rows and ``scale [out]`` f32, one per output channel
    (:func:`quantize_rows_int8`), a quarter of the bytes.

  A call with one row (batch-1 decode) is XLA's gemv for f32 (at the memory bound, on all
  cores); otherwise it is :func:`row_matmul` (XLA hands f32 dots of 2..16 rows to YNNPACK,
  which at batch 8 was slower here than the row reduction). Rows
  also make this an embedding table (:meth:`rows_at`), e.g. for a tied LM head. Calls return
  float32 ``[..., out]``.
  """

  def __init__(self, w, fmt: str = "float32", logical=(None, None)):
    if fmt not in DECODE_FORMATS:
      raise ConfigError(f"{fmt=} must be one of {DECODE_FORMATS}")
    w = jnp.asarray(w)
    if w.ndim != 2:
      raise ShapeError(f"a DecodeWeight takes a matrix [in, out], got shape {w.shape}")
    self.fmt = fmt
    self.in_dim, self.out_dim = int(w.shape[0]), int(w.shape[1])
    self.scale = None
    logical = tuple(logical)
    if fmt == "float32":
      self.w = nnx.Param(w.T.astype(jnp.float32), logical_axes=logical[::-1])
    elif fmt == "bfloat16":
      self.w = nnx.Param(w.T.astype(jnp.bfloat16), logical_axes=logical[::-1])
    else:
      q, scale = quantize_rows_int8(w.T)
      self.w = nnx.Param(q, logical_axes=logical[::-1])
      self.scale = nnx.data(nnx.Param(scale, logical_axes=logical[1:]))

  @classmethod
  def from_rows(cls, rows, fmt: str, logical=(None, None)) -> "DecodeWeight":
    """From ``rows [out, in]`` (e.g. an embedding table ``[vocab, embed]``)."""
    return cls(jnp.asarray(rows).T, fmt, logical=tuple(logical)[::-1])

  def dense(self):
    """The float32 matrix ``[in, out]`` this weight stands for (dequantised)."""
    w = self.w[...].astype(jnp.float32)
    if self.scale is not None:
      w = w * self.scale[...][:, None]
    return w.T

  def rows_at(self, idx):
    """Float32 rows ``[..., in]`` of output channels ``idx`` (bf16/int8 storage only)."""
    # The barrier keeps XLA from treating the table's gather and the tied head's matmul as two
    # users of one value: with two users it will not fuse the head's bf16 -> f32 convert into
    # the matmul and materialises the whole table in f32 every step (~4x the head's own read).
    w = jax.lax.optimization_barrier(self.w[...])
    out = jnp.take(w, idx, axis=0).astype(jnp.float32)
    if self.scale is not None:
      out = out * jnp.take(self.scale[...], idx, axis=0)[..., None]
    return out

  def __call__(self, x):
    """``x [..., in] -> float32 [..., out]``."""
    if x.shape[-1] != self.in_dim:
      raise ShapeError(f"x must end in {self.in_dim} features, got shape {x.shape}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, self.in_dim)
    if self.fmt == "float32" and x2.shape[0] == 1:
      y = jnp.einsum("mk,nk->mn", x2.astype(jnp.float32), self.w[...])
    else:
      y = row_matmul(x2, self.w[...], None if self.scale is None else self.scale[...])
    return y.reshape(*lead, self.out_dim)


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis (Zhang & Sennrich, 2019).

  ``x [..., dim] -> [..., dim]``: ``scale * x / sqrt(mean(x^2) + eps)``; statistics in float32,
  output in ``dtype`` (default: x's dtype). Parameter ``scale [dim]`` (logical ``("embed",)``,
  flax's name), initialised to ones. Takes no ``rngs``: nothing in it is random.

  Example::

    norm = RMSNorm(64, eps=1e-6)
    y = norm(jnp.ones((2, 8, 64)))          # [2, 8, 64]
  """

  def __init__(self, dim: int, *, eps: float = 1e-6, dtype=None, param_dtype=jnp.float32):
    self.dim, self.eps, self.dtype = dim, float(eps), dtype
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("embed",))

  @explicit_ok
  def __call__(self, x):
    if x.shape[-1] != self.dim:
      raise ShapeError(f"x must end in {self.dim} features, got shape {x.shape}")
    dtype = self.dtype or x.dtype
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(dtype) * normed.astype(dtype)


class Embed(nnx.Module):
  """Token embedding table ``embedding [vocab, embed]`` (logical ``("vocab", "embed")``; flax's
  name, as in ``nnx.Embed``).

  ``tokens int[...] -> [..., embed]`` in ``dtype``; ``attend(h [..., embed]) -> [..., vocab]``
  multiplies by the table's transpose (a tied LM head).

  Example::

    embed = Embed(1000, 64, rngs=nnx.Rngs(0))
    h = embed(jnp.zeros((2, 8), jnp.int32))   # [2, 8, 64]
    logits = embed.attend(h)                  # [2, 8, 1000]
  """

  def __init__(self, vocab: int, dim: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.vocab, self.dim, self.dtype = vocab, dim, dtype
    self.embedding = param(rngs, (vocab, dim), ("vocab", "embed"), dtype=param_dtype)
    self.packed: DecodeWeight | None = None  # bf16/int8 rows replacing ``embedding`` (decode)

  def pack(self, fmt: str):
    """bf16/int8 rows (:class:`DecodeWeight`) for both the lookup and the tied head; float32
    keeps ``embedding`` (the f32 head is already a gemv over ``[vocab, embed]``)."""
    self.packed = nnx.data(DecodeWeight.from_rows(self.embedding[...], fmt, logical=("vocab", "embed")))
    self.embedding = None

  @explicit_ok
  def __call__(self, tokens):
    if self.packed is not None:
      out = self.packed.rows_at(tokens).astype(self.dtype)
    else:
      out = take_rows(self.embedding[...], tokens).astype(self.dtype)  # [..., embed]
    return constrain(out, activation_axes(out.ndim, "embed"))

  @explicit_ok
  def attend(self, h):
    if self.packed is not None:
      return self.packed(h)  # [..., vocab] float32
    return jnp.einsum("...d,vd->...v", h, self.embedding[...].astype(h.dtype))  # [..., vocab]


class SwiGLU(nnx.Module):
  """SwiGLU MLP (Shazeer, 2020): ``down(silu(x @ gate) * (x @ up))``.

  ``x [..., dim] -> [..., dim]`` in ``dtype``; parameters gate/up ``[dim, hidden]`` (logical
  ``("embed", "mlp")``) and down ``[hidden, dim]`` (``("mlp", "embed")``), stored in
  ``param_dtype``.

  Example::

    mlp = SwiGLU(64, 256, rngs=nnx.Rngs(0))
    y = mlp(jnp.ones((2, 8, 64)))             # [2, 8, 64]
  """

  def __init__(self, dim: int, hidden: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.dtype = dtype
    self.gate = param(rngs, (dim, hidden), ("embed", "mlp"), dtype=param_dtype)
    self.up = param(rngs, (dim, hidden), ("embed", "mlp"), dtype=param_dtype)
    self.down = param(rngs, (hidden, dim), ("mlp", "embed"), dtype=param_dtype)
    # decode storage (see pack): gate|up fused into one [embed, 2 * mlp] map, and down
    self.packed_gate_up: DecodeWeight | None = None
    self.packed_down: DecodeWeight | None = None

  def pack(self, fmt: str):
    """Replaces gate/up/down by :class:`DecodeWeight` s: one read of ``[gate | up]`` per step."""
    gu = jnp.concatenate([self.gate[...], self.up[...]], axis=1)  # [embed, 2 * mlp]
    self.packed_gate_up = nnx.data(DecodeWeight(gu, fmt, logical=("embed", "mlp")))
    self.packed_down = nnx.data(DecodeWeight(self.down[...], fmt, logical=("mlp", "embed")))
    self.gate = self.up = self.down = None

  @explicit_ok
  def __call__(self, x):
    x = x.astype(self.dtype)
    hid, out_axes = activation_axes(x.ndim, "mlp"), activation_axes(x.ndim, "embed")
    if self.packed_gate_up is not None:
      gu = self.packed_gate_up(x).astype(self.dtype)                     # [..., 2 * mlp]
      g, u = jnp.split(gu, 2, axis=-1)
      h = constrain(jax.nn.silu(g) * u, hid)
      out = self.packed_down(h).astype(self.dtype)
      return constrain(out, out_axes)
    g = jnp.einsum("...d,dm->...m", x, self.gate[...].astype(self.dtype))  # [..., mlp]
    u = jnp.einsum("...d,dm->...m", x, self.up[...].astype(self.dtype))
    h = constrain(jax.nn.silu(g) * u, hid)
    out = jnp.einsum("...m,md->...d", h, self.down[...].astype(self.dtype))  # [..., embed]
    return constrain(out, out_axes)
