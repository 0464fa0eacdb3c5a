"""The node-classification objective and metric every graph trainer uses: the masked mean
cross-entropy over labelled nodes and the masked accuracy.

They sit in ``graphs`` (below ``parallel`` and ``models``) so the single-device loops
(``jaxsys.models``: GNN, graph transformer), the graph-parallel step (``jaxsys.parallel.graph``),
the Sylvie trainer (``jaxsys.parallel.graph_comm``) and the experiments share one formula.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxsys.core.errors import ShapeError

__all__ = ["masked_accuracy", "masked_node_cross_entropy"]


def _check(logits, labels, mask) -> None:
  if logits.ndim != 2:
    raise ShapeError(f"logits must be [nodes, classes], got shape {logits.shape}")
  n = logits.shape[0]
  if labels.shape != (n,) or not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ShapeError(f"labels must be int[{n}] (one class per node), got {labels.dtype}{list(labels.shape)}")
  if mask.shape != (n,) or mask.dtype != jnp.bool_:
    raise ShapeError(f"mask must be bool[{n}] (the nodes the loss counts), got {mask.dtype}{list(mask.shape)}; "
                     "a weight mask is not a node mask")


def masked_node_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array, *,
                              denominator=None) -> jax.Array:
  """``sum_{i: mask_i} CE(logits_i, labels_i) / denominator``: a float32 scalar.

  ``logits`` [nodes, classes], ``labels`` int[nodes], ``mask`` bool[nodes]. Masked-out nodes
  contribute exactly 0 to the value (``where``, not a product, so a non-finite logit on an
  unlabelled node does not make the loss NaN) and, for finite logits, to the gradient.
  ``denominator`` defaults to the number of masked nodes (at least 1, so an empty mask gives 0,
  not NaN); a sharded caller that holds only its own nodes passes the global count so that the
  psum of the per-device values is the global mean.
  """
  _check(logits, labels, mask)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [nodes]
  total = jnp.sum(jnp.where(mask, ce, 0.0))
  if denominator is None:
    denominator = jnp.maximum(jnp.sum(mask), 1)
  return total / denominator


def masked_accuracy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
  """Fraction of the masked nodes whose argmax class is the label (0 for an empty mask)."""
  _check(logits, labels, mask)
  hit = (jnp.argmax(logits, -1) == labels) & mask
  return jnp.sum(hit) / jnp.maximum(jnp.sum(mask), 1)
