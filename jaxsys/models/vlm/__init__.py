"""The video-language model of LongVILA (MM-SP) and MR-SP: frame encoder, projector and decoder LM
(``model``; ``from jaxsys.models.vlm import VLM`` as before, imported on first use)."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "FrameEncoder": "model", "Projector": "model", "rebuild": "model", "VisionBlock": "model",
    "VLM": "model", "vlm_loss": "model", "VLMConfig": "model", "with_rope_theta": "model",
})
