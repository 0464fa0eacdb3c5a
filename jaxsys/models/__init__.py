"""Full models, one subpackage per family, each with its recipe beside it:

* ``models.llm``: the decoder LM (Llama / Qwen2 / Mistral family: ``decoder``, its config), the
  EAGLE drafter (``drafter``), the tiny long-context LM shipped in ``jaxsys/assets/tiny_lm``
  (``tiny``) and supervised fine-tuning (``sft``); ``models.llm.interop``: Hugging Face
  (``hf``), GGUF (``gguf``), safetensors, the torch-free ``tokenizer`` and named real models
  (``pretrained``: SmolLM2-135M-Instruct).
* ``models.vlm``: the video-language model of LongVILA / MR-SP.
* ``models.graph``: GNNs (A2Q, MEGA, Sylvie), the graph transformer (TorchGT) and the one
  node-classification loop.
* ``models.vision``: DATE, NMS-free detection.
* ``models.nerf``: SpikingNeRF.

The names below are exported here too (imported on first use): ``from_pretrained`` /
``from_hf_model`` / ``save_pretrained`` convert Hugging Face checkpoints; ``random_model`` builds a
random model from a transformers config; ``from_gguf`` / ``save_gguf`` read and write llama.cpp
GGUF files; ``load_pretrained("smollm2-135m-instruct")`` returns a named real model and its
tokenizer, fetched once with ``jaxsys fetch smollm2-135m-instruct``. The modules' former paths
(``jaxsys.models.decoder``, ``jaxsys.models.gguf``, ...) still import, as aliases of their new
homes.
"""

from jaxsys._lazy import lazy_exports, moved_modules

MOVED = {
    "_decoder_config": "llm._decoder_config", "decoder": "llm.decoder", "drafter": "llm.drafter",
    "tiny": "llm.tiny", "sft": "llm.sft",
    "hf": "llm.interop.hf", "_hf_config": "llm.interop._hf_config", "_safetensors": "llm.interop._safetensors",
    "gguf": "llm.interop.gguf", "pretrained": "llm.interop.pretrained", "tokenizer": "llm.interop.tokenizer",
    "gnn": "graph.gnn", "graph_transformer": "graph.graph_transformer",
    "node_classification": "graph.node_classification",
    "date": "vision.date", "spiking_nerf": "nerf.spiking_nerf",
}
moved_modules(__name__, MOVED)

__getattr__, __dir__ = lazy_exports(__name__, {
    "DecoderConfig": "llm._decoder_config",
    "Decoder": "llm.decoder", "CausalLM": "llm.decoder", "DecoderLayer": "llm.decoder",
    "DecoderOutput": "llm.decoder", "replace_config": "llm.decoder", "default_positions": "llm.decoder",
    "from_pretrained": "llm.interop.hf", "from_hf_model": "llm.interop.hf", "save_pretrained": "llm.interop.hf",
    "random_model": "llm.interop.hf", "config_from_hf": "llm.interop.hf", "config_to_hf": "llm.interop.hf",
    "hf_state_dict": "llm.interop.hf", "load_state_dict": "llm.interop.hf",
    "from_gguf": "llm.interop.gguf", "save_gguf": "llm.interop.gguf", "config_from_gguf": "llm.interop.gguf",
    "load_tokenizer": "llm.interop.gguf",
    "load_pretrained": "llm.interop.pretrained", "fetch": "llm.interop.pretrained",
    "Tokenizer": "llm.interop.tokenizer",
    "load_tiny_lm": "llm.tiny", "TINY_LM_PATH": "llm.tiny", "exact_match": "llm.tiny",
    "SpikingNeRF": "nerf.spiking_nerf", "SpikingNeRFConfig": "nerf.spiking_nerf",
    "DATE": "vision.date", "DATEConfig": "vision.date", "date_loss": "vision.date",
    "make_date_train_step": "vision.date", "train_detector": "vision.date", "make_detect_fn": "vision.date",
    "predict_dataset": "vision.date",
})
