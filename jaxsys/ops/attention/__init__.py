"""Attention: one op, one folder; a file per backend (``reference``, ``xla``, ``pallas``)."""

from jaxsys.ops.attention.api import attention

__all__ = ["attention"]
