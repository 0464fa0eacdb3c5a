"""Full models: the decoder LM (Llama / Qwen2 / Mistral family, Hugging Face weights) and others.

``from_pretrained`` / ``from_hf_model`` / ``save_pretrained`` convert Hugging Face checkpoints;
``random_model`` builds a random model from a transformers config; ``load_tiny_lm`` returns the
small long-context model shipped in ``jaxsys/assets/tiny_lm``.

``from_gguf`` / ``save_gguf`` read and write llama.cpp GGUF files (``jaxsys.models.gguf``);
``load_pretrained("smollm2-135m-instruct")`` returns a named real model and its tokenizer,
fetched once with ``jaxsys fetch smollm2-135m-instruct`` (``jaxsys.models.pretrained``).
``Tokenizer`` (``jaxsys.models.tokenizer``) is the torch-free tokenizer of GGUF files and HF folders.
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "DecoderConfig": "_decoder_config",
    "Decoder": "decoder", "CausalLM": "decoder", "DecoderLayer": "decoder",
    "DecoderOutput": "decoder", "replace_config": "decoder", "default_positions": "decoder",
    "from_pretrained": "hf", "from_hf_model": "hf", "save_pretrained": "hf",
    "random_model": "hf", "config_from_hf": "hf", "config_to_hf": "hf",
    "hf_state_dict": "hf", "load_state_dict": "hf",
    "from_gguf": "gguf", "save_gguf": "gguf", "config_from_gguf": "gguf", "load_tokenizer": "gguf",
    "load_pretrained": "pretrained", "fetch": "pretrained", "Tokenizer": "tokenizer",
    "load_tiny_lm": "tiny", "TINY_LM_PATH": "tiny", "exact_match": "tiny",
    "SpikingNeRF": "spiking_nerf", "SpikingNeRFConfig": "spiking_nerf",
    "DATE": "date", "DATEConfig": "date", "date_loss": "date", "make_date_train_step": "date",
    "train_detector": "date", "make_detect_fn": "date", "predict_dataset": "date",
})
