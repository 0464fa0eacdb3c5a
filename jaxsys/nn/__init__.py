"""Flax NNX layers built on ``jaxsys.ops``, for use inside any ``nnx.Module``.

Every layer takes ``[..., features]`` inputs (graph layers ``[..., nodes, features]``; the A2Q
graph convolutions ``[nodes, features]``), ``dtype`` / ``param_dtype``, and carries
``logical_axes`` metadata on its parameters: :func:`shard_params` places a module on a mesh by
``jaxsys.core.mesh`` rules, and :func:`constrain` annotates activations.

Layers: :class:`Attention` (GQA + RoPE), :class:`RMSNorm`, :class:`Embed`, :class:`SwiGLU`,
:class:`GraphAttention`, :class:`GCNConv`, :class:`DegreeEncoding`, :class:`QuantLinear`,
:class:`QuantGCNConv`, :class:`QuantGINConv`, :class:`QuantGATConv`, :class:`LIF`,
:class:`SpikingLinear`, :class:`HashDropout` (``nnx.Dropout`` with a counter-hash mask: cheap on CPU).

LoRA on any of them (and on a user's own layer that reads its weight with ``w[...]``):
:func:`apply_lora` with a :class:`LoRAConfig` wraps projections in :class:`LoRAWeight` s whose
adapters are :class:`LoRAParam` s; :func:`merge_lora` folds them back; :func:`lora_state` /
:func:`load_lora_state` save and load the adapters alone; :func:`trainable_filter` is the nnx
filter ``jaxsys.train.train`` optimises (the adapters when present, minus frozen paths).
"""

from jaxsys._lazy import lazy_exports

_EXPORTS = {
    "RMSNorm": "layers", "Embed": "layers", "FLAX_RENAMES": "layers", "SwiGLU": "layers", "DecodeWeight": "layers",
    "constrain": "layers", "param": "layers", "param_specs": "layers", "shard_params": "layers",
    "RopeConfig": "rope", "apply_rope": "rope", "inv_frequencies": "rope", "rope_cos_sin": "rope",
    "Attention": "attention", "default_attention_fn": "attention",
    "GraphAttention": "graph", "GCNConv": "graph", "DegreeEncoding": "graph",
    "GraphInputs": "graph", "graph_inputs": "graph",
    "QuantLinear": "quantized", "QuantGCNConv": "quantized", "QuantGINConv": "quantized",
    "QuantGATConv": "quantized", "A2QConfig": "quantized",
    "HashDropout": "dropout",
    "LIF": "spiking", "LIFConfig": "spiking", "SpikingLinear": "spiking", "spike_count": "spiking",
    "apply_lora": "lora", "LoRAConfig": "lora", "LoRAParam": "lora", "LoRAWeight": "lora",
    "merge_lora": "lora", "lora_state": "lora", "load_lora_state": "lora",
    "trainable_filter": "lora",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
