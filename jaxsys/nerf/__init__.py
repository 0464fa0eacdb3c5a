"""SpikingNeRF building blocks: voxel grids, rays, TP/TCP packing, compositing, energy.

``grids`` (DVGO dense grids, density activation, occupancy mask), ``rays`` (camera rays,
box sampling, view encoding), ``packing`` (bucketed TP/TCP over ``jaxsys.ops.tcp``),
``render`` (volume compositing, PSNR, SSIM), ``energy`` (MAC/AC counts, pJ). The model that
puts them together is ``jaxsys.models.nerf.spiking_nerf``.
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Box": "grids", "VoxelGrid": "grids", "trilinear": "grids", "density_to_alpha": "grids",
    "density_shift": "grids", "occupancy_mask": "grids",
    "camera_rays": "rays", "sample_rays": "rays", "ray_box": "rays", "view_encoding": "rays",
    "RaySamples": "rays",
    "bucket": "packing", "plan": "packing",
    "alpha_weights": "render", "composite": "render", "psnr": "render", "ssim": "render",
    "OpCounts": "energy", "ann_ops": "energy", "snn_ops": "energy", "energy_pj": "energy",
})
