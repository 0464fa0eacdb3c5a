"""Graphs: datasets (bundled Planetoid Cora, synthetic SBM / power-law), ``jraph.GraphsTuple``
padding to buckets, METIS partitioning, cluster reordering, block layouts and ECR.

Usage::

  from jaxsys import graphs
  ds = graphs.load_planetoid("cora")                       # NodeDataset
  parts = graphs.metis_partition(ds.senders, ds.receivers, ds.num_nodes, 8)
  ds_r, order = graphs.cluster_reorder(ds, 8)              # clusters contiguous
  padded = graphs.pad_graph(ds.graph, *graphs.graph_buckets(ds.num_nodes, ds.num_edges))
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "NodeDataset": "dataset", "make_node_dataset": "dataset", "make_graph": "dataset",
    "canonical_edges": "dataset", "add_self_loops": "dataset", "degrees": "dataset",
    "check_edges": "dataset", "check_graph": "dataset", "split_masks": "dataset",
    "load_planetoid": "planetoid", "convert_planetoid": "planetoid",
    "sbm_graph": "synthetic", "powerlaw_graph": "synthetic",
    "next_bucket": "padding", "graph_buckets": "padding", "pad_graph": "padding",
    "node_mask": "padding", "edge_mask": "padding", "pad_dataset": "padding",
    "metis_partition": "partition", "Reordering": "partition", "cluster_permutation": "partition",
    "reorder_dataset": "partition", "cluster_reorder": "partition",
    "GraphTileLayout": "blocks", "block_layout": "blocks", "ReformConfig": "blocks",
    "ReformedGraph": "blocks", "reform": "blocks",
    "tune_threshold": "tuner", "TunerResult": "tuner", "TunerRecord": "tuner",
    "masked_node_cross_entropy": "node_loss", "masked_accuracy": "node_loss",
})
