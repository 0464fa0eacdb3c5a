"""Detection building blocks for DATE: boxes (IoU, GIoU, NMS), assignment (FCOS, POTO), losses.

The model (backbone, FPN, dual head, train loss, NMS-free decoding) is ``jaxsys.models.vision.date``;
the procedural data set is ``jaxsys.data.shapes``; COCO-style AP is ``jaxsys.eval.detection``.
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "check_boxes": "boxes", "cxcywh_to_xyxy": "boxes", "xyxy_to_cxcywh": "boxes",
    "box_area": "boxes", "iou": "boxes", "giou": "boxes", "pairwise_iou": "boxes",
    "pairwise_giou": "boxes", "nms": "boxes",
    "anchor_points": "assign", "regress_ranges_for": "assign", "center_region_mask": "assign",
    "Targets": "assign", "fcos_targets": "assign", "poto_quality": "assign",
    "hungarian_match": "assign", "poto_match": "assign", "one_to_one_targets": "assign",
    "sigmoid_focal_loss": "losses", "giou_loss": "losses", "iou_loss": "losses",
    "l1_loss": "losses", "one_to_one_loss": "losses", "one_to_many_loss": "losses",
})
