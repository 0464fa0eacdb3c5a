"""jaxsys.eval: evaluations (video needle-in-a-haystack grids, detection AP, accuracy harnesses)."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "vniah_grid": "vniah",
    "plot_heatmap": "vniah",
    "Grid": "vniah",
    "coco_ap": "detection", "pycocotools_ap": "detection", "duplicate_rate": "detection",
    "from_batch": "detection",
})
