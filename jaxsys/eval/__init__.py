"""jaxsys.eval: evaluations (video needle-in-a-haystack grids, accuracy harnesses)."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "vniah_grid": "vniah",
    "plot_heatmap": "vniah",
    "Grid": "vniah",
})
