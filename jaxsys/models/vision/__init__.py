"""Vision models: DATE, end-to-end NMS-free detection (``date``: model, loss, train step and
recipe; its building blocks live in ``jaxsys.vision``)."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "ConvGNReLU": "date", "DATE": "date", "date_loss": "date", "DATEConfig": "date", "DATEHead": "date",
    "decode_ltrb": "date", "DetectionBackbone": "date", "DetectionFPN": "date",
    "make_date_train_step": "date", "make_detect_fn": "date", "predict_dataset": "date",
    "select_detections": "date", "STRIDES": "date", "train_detector": "date",
})
