"""Flax NNX layers built on ``jaxsys.ops``: RMSNorm, RoPE, SwiGLU MLP, GQA attention.

Parameters carry ``logical_axes`` metadata; :func:`shard_params` places a module on a mesh by
``jaxsys.core.mesh`` rules, and :func:`constrain` annotates activations.
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "RMSNorm": "layers", "Embed": "layers", "SwiGLU": "layers", "constrain": "layers",
    "param": "layers", "param_specs": "layers", "shard_params": "layers",
    "RopeConfig": "rope", "apply_rope": "rope", "inv_frequencies": "rope",
    "rope_cos_sin": "rope",
    "Attention": "attention", "default_attention_fn": "attention",
    "LIF": "spiking", "LIFConfig": "spiking", "SpikingLinear": "spiking", "spike_count": "spiking",
})
