"""Synthetic node-classification graphs from 1K to 1M+ nodes, generated vectorised in numpy.

Both generators are degree-corrected stochastic block models (Karrer & Newman 2011): nodes
belong to ``num_communities`` communities, each community maps to one of ``num_classes``
labels, an undirected edge picks its first endpoint with probability proportional to a node
weight ``w_i`` and its second endpoint inside the same community with probability
``intra_fraction`` (else anywhere), again proportional to ``w``.

* ``sbm_graph``: all weights equal (a plain SBM, Poisson degrees).
* ``powerlaw_graph``: ``w_i`` Pareto-distributed, so degrees follow a power law
  ``P(k) ~ k^-gamma`` -- the degree distribution of preferential attachment (Barabasi-Albert
  gives gamma = 3), produced in one vectorised pass (Chung-Lu expected-degree model) instead of a
  sequential attachment loop.

Features are ``snr * centroid[label] + N(0, 1)`` noise so that features alone are weakly
informative and neighbourhoods help. Node ids are randomly permuted, so communities are NOT
contiguous: cluster-aware reordering has something to recover.
"""

from __future__ import annotations

import numpy as np

from jaxsys.core.errors import ConfigError
from jaxsys.graphs.dataset import NodeDataset, make_node_dataset, split_masks

__all__ = ["powerlaw_graph", "sbm_graph"]


def _check(num_nodes, num_classes, num_communities, avg_degree, intra_fraction, num_features):
  if num_nodes < 2:
    raise ConfigError(f"{num_nodes=} must be >= 2")
  if num_classes < 2:
    raise ConfigError(f"{num_classes=} must be >= 2")
  if not num_classes <= num_communities <= num_nodes:
    raise ConfigError(f"{num_communities=} must lie in [num_classes={num_classes}, num_nodes={num_nodes}]")
  if avg_degree <= 0:
    raise ConfigError(f"{avg_degree=} must be positive")
  if not 0.0 <= intra_fraction <= 1.0:
    raise ConfigError(f"{intra_fraction=} must lie in [0, 1]")
  if num_features < 1:
    raise ConfigError(f"{num_features=} must be >= 1")


def _sample_in(cw, lo, hi, rng):
  """Indices sampled proportional to weight within sorted ranges [lo, hi) of cumsum ``cw``."""
  base = np.where(lo > 0, cw[np.maximum(lo - 1, 0)], 0.0)
  t = base + rng.random(lo.shape) * (cw[hi - 1] - base)
  return np.minimum(np.searchsorted(cw, t, side="right"), hi - 1)


def _dcsbm(num_nodes, weights, *, num_classes, num_communities, avg_degree, intra_fraction,
           num_features, snr, seed, name) -> NodeDataset:
  rng = np.random.default_rng(seed)
  # Contiguous communities of near-equal size in "generation order"; permuted at the end.
  comm = (np.arange(num_nodes) * num_communities) // num_nodes
  starts = np.searchsorted(comm, np.arange(num_communities))
  ends = np.append(starts[1:], num_nodes)
  cw = np.cumsum(weights)
  m = int(round(num_nodes * avg_degree / 2))
  src = _sample_in(cw, np.zeros(m, np.int64), np.full(m, num_nodes), rng)
  intra = rng.random(m) < intra_fraction
  c = comm[src]
  lo = np.where(intra, starts[c], 0)
  hi = np.where(intra, ends[c], num_nodes)
  dst = _sample_in(cw, lo, hi, rng)
  class_of_comm = rng.permutation(np.arange(num_communities) % num_classes)
  labels = class_of_comm[comm]
  centroids = rng.standard_normal((num_classes, num_features)) / np.sqrt(num_features)
  x = (snr * np.sqrt(num_features) * centroids[labels]
       + rng.standard_normal((num_nodes, num_features))).astype(np.float32)
  perm = rng.permutation(num_nodes)  # old id -> new id
  inv = np.empty_like(perm)
  inv[perm] = np.arange(num_nodes)
  x, labels = x[inv], labels[inv]
  src, dst = perm[src], perm[dst]
  num_val = min(500, num_nodes // 4)
  num_test = min(1000, num_nodes // 2)
  per_class = max(1, min(20, (num_nodes - num_val - num_test) // (2 * num_classes)))
  train, val, test = split_masks(num_nodes, labels, num_classes, train_per_class=per_class,
                                 num_val=num_val, num_test=num_test, seed=seed + 1)
  return make_node_dataset(x, src, dst, labels, train_mask=train, val_mask=val, test_mask=test,
                           num_classes=num_classes, name=name)


def sbm_graph(num_nodes: int, *, num_classes: int = 8, num_communities: int | None = None,
              avg_degree: float = 10.0, intra_fraction: float = 0.8, num_features: int = 32,
              snr: float = 0.5, seed: int = 0) -> NodeDataset:
  """Stochastic block model; ``avg_degree`` counts directed edges per node (before dedup).

  ``num_communities`` defaults to ``max(num_classes, num_nodes // 128)`` (communities of ~128
  nodes, the scale at which reordered adjacency blocks become dense).
  """
  num_communities = num_communities or max(num_classes, num_nodes // 128)
  _check(num_nodes, num_classes, num_communities, avg_degree, intra_fraction, num_features)
  return _dcsbm(num_nodes, np.ones(num_nodes), num_classes=num_classes,
                num_communities=num_communities, avg_degree=avg_degree,
                intra_fraction=intra_fraction, num_features=num_features, snr=snr, seed=seed,
                name=f"sbm{num_nodes}")


def powerlaw_graph(num_nodes: int, *, gamma: float = 2.5, num_classes: int = 8,
                   num_communities: int | None = None, avg_degree: float = 10.0,
                   intra_fraction: float = 0.8, num_features: int = 32, snr: float = 0.5,
                   max_weight_ratio: float = 100.0, seed: int = 0) -> NodeDataset:
  """Power-law degree graph (expected-degree / preferential-attachment degree law).

  Node weights ``w ~ Pareto(gamma - 1)`` truncated at ``max_weight_ratio`` times the minimum
  so hubs stay bounded for memory; ``gamma`` > 2 keeps the mean degree finite.
  """
  if gamma <= 2.0:
    raise ConfigError(f"{gamma=} must be > 2 (finite mean degree)")
  if max_weight_ratio < 1.0:
    raise ConfigError(f"{max_weight_ratio=} must be >= 1")
  num_communities = num_communities or max(num_classes, num_nodes // 128)
  _check(num_nodes, num_classes, num_communities, avg_degree, intra_fraction, num_features)
  rng = np.random.default_rng(seed + 12345)
  w = np.minimum((1.0 - rng.random(num_nodes)) ** (-1.0 / (gamma - 1.0)), max_weight_ratio)
  return _dcsbm(num_nodes, w, num_classes=num_classes, num_communities=num_communities,
                avg_degree=avg_degree, intra_fraction=intra_fraction,
                num_features=num_features, snr=snr, seed=seed, name=f"powerlaw{num_nodes}")
