"""Attention: one op, one folder; a file per backend (``reference``, ``xla``, ``pallas``)."""

from jaxsys.ops.attn.api import attention

__all__ = ["attention"]
