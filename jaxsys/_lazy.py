"""Lazy re-exports: a package lists ``name -> submodule`` and imports on first use."""

import importlib


def lazy_exports(package: str, table: dict[str, str]):
  """Returns ``(__getattr__, __dir__)`` for a package exporting ``table`` lazily.

  ``table`` maps an exported name to the submodule (relative to ``package``) defining it.
  """

  def __getattr__(name):
    if name in table:
      module = importlib.import_module(f"{package}.{table[name]}")
      return getattr(module, name)
    try:
      return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"{package}.{name}":
        raise
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  def __dir__():
    return sorted(table)

  return __getattr__, __dir__
