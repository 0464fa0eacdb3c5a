"""Full models: the decoder LM (Llama / Qwen2 / Mistral family, Hugging Face weights) and others.

``from_pretrained`` / ``from_hf_model`` / ``save_pretrained`` convert Hugging Face checkpoints;
``random_model`` builds a random model from a transformers config; ``load_tiny_lm`` returns the
small long-context model shipped in ``jaxsys/assets/tiny_lm``.
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "DecoderConfig": "_decoder_config",
    "Decoder": "decoder", "CausalLM": "decoder", "DecoderLayer": "decoder",
    "DecoderOutput": "decoder", "replace_config": "decoder", "default_positions": "decoder",
    "from_pretrained": "hf", "from_hf_model": "hf", "save_pretrained": "hf",
    "random_model": "hf", "config_from_hf": "hf", "config_to_hf": "hf",
    "hf_state_dict": "hf", "load_state_dict": "hf",
    "load_tiny_lm": "tiny", "TINY_LM_PATH": "tiny", "exact_match": "tiny",
})
