"""Quantization: A2Q (learned per-node bits), MEGA (degree-aware bits, packed mixed-bit format,
condensed edge order), Sylvie's 1-bit communication quantizer, PalQuant, hash dropout.

Usage::

  from jaxsys.quant import a2q_quantize, pack_features, quantize_1bit
  xq = a2q_quantize(x, step[:, None], bits[:, None], False)
  packed = pack_features(x, bits_int, step, signed=False)
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "a2q_quantize": "a2q", "memory_penalty": "a2q", "nns_select": "a2q", "average_bits": "a2q",
    "round_bits": "a2q", "check_bits": "a2q",
    "PackedFeatures": "packing", "pack_codes": "packing", "pack_features": "packing",
    "unpack_codes": "packing", "dequantize": "packing",
    "degree_aware_bits": "mega", "degree_regularizer": "mega", "condensed_edge_order": "mega",
    "in_degree": "mega",
    "quantize_1bit": "comm", "dequantize_1bit": "comm", "OneBitPayload": "comm",
    "hash_dropout": "random",
    "PalQuantConfig": "palquant", "PalQuantNet": "palquant", "lsq_quantize": "palquant",
    "cyclic_shuffle": "palquant", "train_digits": "palquant",
})
