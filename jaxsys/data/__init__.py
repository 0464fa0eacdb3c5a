"""Synthetic tasks deterministic by seed (retrieval, copy, arithmetic) and input pipelines."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "VOCAB": "synthetic", "Vocab": "synthetic", "Example": "synthetic", "TASKS": "synthetic",
    "make_example": "synthetic", "examples": "synthetic", "reward": "synthetic",
    "training_batch": "synthetic", "token_names": "synthetic", "detokenize": "synthetic",
    "save_tokenizer": "synthetic", "passkey_text": "synthetic", "passkey_prompts": "synthetic", "PASSKEY_FILLER": "synthetic",
    "make_scene": "scenes", "render_dataset": "scenes",
    "ShapesConfig": "shapes", "Shapes": "shapes", "make_shapes": "shapes", "CLASSES": "shapes",
})
