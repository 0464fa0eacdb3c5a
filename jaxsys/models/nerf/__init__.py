"""Radiance fields: SpikingNeRF (``spiking_nerf``: model, energy and training recipe; its voxel
grids, ray sampling and rendering live in ``jaxsys.nerf``)."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "coarse_mask": "spiking_nerf", "CoarseGrids": "spiking_nerf", "ColorMLP": "spiking_nerf",
    "fit": "spiking_nerf", "init_from_coarse": "spiking_nerf", "lattice_alpha": "spiking_nerf",
    "make_optimizer": "spiking_nerf", "MODES": "spiking_nerf", "NEURONS": "spiking_nerf",
    "OccupancyMask": "spiking_nerf", "render": "spiking_nerf", "render_views": "spiking_nerf",
    "renderer": "spiking_nerf", "RenderOut": "spiking_nerf", "sample_mask": "spiking_nerf",
    "SpikingNeRF": "spiking_nerf", "SpikingNeRFConfig": "spiking_nerf", "ViewStats": "spiking_nerf",
})
