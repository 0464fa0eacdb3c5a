"""The registry of the experiment scripts (the top-level ``experiments/`` folder) that
``jaxsys reproduce`` runs, each in its own process as ``python -P -m <module>`` (``-P``: the
current directory is not on ``sys.path``, so a user's own ``experiments`` package cannot shadow
the installed scripts).
"""

__all__ = ["REGISTRY"]

# name -> (module, system, one-line description). Order is the order of the table.
REGISTRY: dict[str, tuple[str, str, str]] = {
    "attention": ("experiments.attention", "foundation", "blockwise / block-sparse attention vs naive and peers"),
    "decode_speed": ("experiments.decode_speed", "decoder LM", "greedy decode tokens/s, jaxsys vs transformers"),
    "real_lm": ("experiments.real_lm", "decoder LM", "SmolLM2-135M: decode/prefill vs llama.cpp, passkey, bf16/int8 weights"),
    "tiny_lm": ("experiments.tiny_lm", "decoder LM", "tiny trained model: recall vs context length, RoPE scaling"),
    "mmsp": ("experiments.mmsp", "LongVILA MM-SP", "sequence-parallel attention: comm bytes, memory, step time, balance"),
    "vniah": ("experiments.vniah", "LongVILA MM-SP", "video needle-in-a-haystack before/after long-context extension"),
    "mrsp": ("experiments.mrsp", "LongVILA-R1 MR-SP", "video GRPO: cached embeddings + SP passes, step time, memory, reward"),
    "lserve": ("experiments.lserve", "LServe", "sparse decode/prefill attention and engine vs dense"),
    "serving": ("experiments.serving", "LServe", "OpenAI-compatible server under Poisson load over HTTP"),
    "tlt": ("experiments.tlt", "TLT", "speculative decoding acceptance and GRPO rollout speedup"),
    "torchgt": ("experiments.torchgt", "TorchGT", "graph transformer accuracy and attention scaling"),
    "gnn_quant": ("experiments.gnn_quant", "A2Q / MEGA / Sylvie / PalQuant", "quantized GNNs and 1-bit communication"),
    "cluster": ("experiments.cluster", "Helios / Acme / SchedMate", "scheduling, energy saving, fault tolerance"),
    "spiking_nerf": ("experiments.spiking_nerf", "SpikingNeRF", "spiking vs ANN colour MLP: PSNR, energy, TP vs TCP packing"),
    "date": ("experiments.date", "DATE", "dual-assignment NMS-free detection: steps to AP, NMS-free AP, inference time"),
}
