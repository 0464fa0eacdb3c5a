"""Graph models: GNNs with A2Q / MEGA / Sylvie quantization (``gnn``), the TorchGT graph
transformer (``graph_transformer``) and the one node-classification loop they train on
(``node_classification``)."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "average_feature_bits": "gnn", "compression_ratio": "gnn", "feature_quantizers": "gnn", "GNN": "gnn",
    "GNNConfig": "gnn", "GNNTrainConfig": "gnn", "KINDS": "gnn", "masked_accuracy": "gnn", "NodeData": "gnn",
    "train_gnn": "gnn", "train_sylvie": "gnn", "weight_quantizers": "gnn",
    "add_virtual_node": "graph_transformer", "ATTENTION": "graph_transformer",
    "EncoderLayer": "graph_transformer", "GCN": "graph_transformer", "GraphTransformer": "graph_transformer",
    "GraphTransformerConfig": "graph_transformer", "laplacian_pe": "graph_transformer",
    "TASKS": "graph_transformer", "TOPOLOGY": "graph_transformer",
    "train_graph_transformer": "graph_transformer", "NodeTrainingRun": "node_classification",
    "run_node_training": "node_classification",
})
