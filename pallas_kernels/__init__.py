"""Pallas kernels only: no Flax, no model code. Each kernel has an XLA twin in ``jaxsys.ops``.

Kernels run compiled on GPU (Triton) / TPU (Mosaic) and with ``interpret=True`` on CPU.
"""
