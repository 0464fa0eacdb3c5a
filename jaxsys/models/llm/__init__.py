"""The LLM family: the decoder LM (``decoder``, config in ``_decoder_config``), the EAGLE drafter
(``drafter``), the tiny long-context LM (``tiny``), supervised fine-tuning (``sft``: chat data,
packing, ``finetune`` on the one train loop); ``interop/``: Hugging Face, GGUF, safetensors, the
torch-free tokenizer and named real models."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "CausalLM": "decoder", "Decoder": "decoder", "DecoderConfig": "decoder", "DecoderLayer": "decoder",
    "DecoderOutput": "decoder", "default_positions": "decoder", "pack_for_decode": "decoder",
    "replace_config": "decoder", "check_compatible": "drafter", "drafter_loss": "drafter",
    "DrafterConfig": "drafter", "DraftVocab": "drafter", "EagleDrafter": "drafter",
    "TARGET_FIELDS": "drafter", "top_token_ids": "drafter", "exact_match": "tiny", "load_tiny_lm": "tiny",
    "TINY_LM_PATH": "tiny", "batches": "sft", "finetune": "sft", "pack": "sft", "PackedData": "sft",
    "read_chats": "sft", "ROLES": "sft", "tokenize_chat": "sft", "ARCHS": "_decoder_config",
    "DTYPES": "_decoder_config", "LAYER_TYPES": "_decoder_config",
})
