"""The ``mesh_kind`` fixture: each parallel program once per kind of mesh (see _sp_helpers)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _sp_helpers import MESH_KINDS  # noqa: E402


@pytest.fixture(params=MESH_KINDS)
def mesh_kind(request):
  return request.param
