"""Lazy re-exports: a package lists ``name -> submodule`` and imports on first use."""

import importlib
import sys


def lazy_exports(package: str, table: dict[str, str], also=()):
  """Returns ``(__getattr__, __dir__)`` for a package exporting ``table`` lazily.

  ``table`` maps an exported name to the submodule (relative to ``package``) defining it;
  ``also`` names what the package imports eagerly and exports too. The package's ``__all__``
  becomes the sorted exported names (unless it sets its own), so ``from package import *`` gives
  the API, not submodule names.
  """
  exported = sorted({*table, *also})
  module = sys.modules.get(package)
  if module is not None and "__all__" not in vars(module):
    module.__all__ = exported

  def __getattr__(name):
    if name in table:
      value = getattr(importlib.import_module(f"{package}.{table[name]}"), name)
      # cached in the package: later lookups skip __getattr__, and tools that read the
      # package's __dict__ (pdoc) find the resolved object
      setattr(sys.modules[package], name, value)
      return value
    try:
      return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"{package}.{name}":
        raise
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  def __dir__():
    return exported

  return __getattr__, __dir__
