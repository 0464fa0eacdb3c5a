"""Weights and tokenizers in and out of the decoder LM: Hugging Face folders and models (``hf``,
``_hf_config``), llama.cpp GGUF files (``gguf``), safetensors (``_safetensors``), the torch-free
``tokenizer`` and named real models fetched from the package registry (``pretrained``)."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "config_from_hf": "hf", "config_to_hf": "hf", "from_hf_model": "hf", "from_pretrained": "hf",
    "hf_state_dict": "hf", "load_state_dict": "hf", "lora_state_dict": "hf", "random_model": "hf",
    "save_lora_adapters": "hf", "save_pretrained": "hf", "config_from_gguf": "gguf", "from_gguf": "gguf",
    "load_tokenizer": "gguf", "READ_ARCHS": "gguf", "save_gguf": "gguf", "WRITE_DTYPES": "gguf",
    "cache_dir": "pretrained", "fetch": "pretrained", "fetch_command": "pretrained", "find": "pretrained",
    "load_pretrained": "pretrained", "main": "pretrained", "model_path": "pretrained",
    "MODELS": "pretrained", "PretrainedSpec": "pretrained", "register_cli": "pretrained",
    "bytes_to_unicode": "tokenizer", "PRE_SPLITS": "tokenizer", "Tokenizer": "tokenizer",
    "ARCH_CLASSES": "_hf_config", "MAX_HEADER_BYTES": "_safetensors", "read_header": "_safetensors",
    "TensorInfo": "_safetensors", "write_file": "_safetensors",
})
