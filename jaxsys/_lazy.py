"""Lazy re-exports: a package lists ``name -> submodule`` and imports on first use; modules that
moved keep their old import paths (:func:`moved_modules`)."""

import importlib
import importlib.abc
import importlib.util
import sys
import types


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


class _Alias(types.ModuleType):
  """A module that forwards every attribute to the module it stands for (one object per class)."""

  def __init__(self, name: str, target: str):
    super().__init__(name)
    self.__dict__["_target"] = target

  def __getattr__(self, name):
    return getattr(importlib.import_module(self.__dict__["_target"]), name)

  def __dir__(self):
    return dir(importlib.import_module(self.__dict__["_target"]))


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Resolves ``old.module.path`` imports to the modules they moved to (see :func:`moved_modules`)."""

  def __init__(self):
    self.aliases: dict[str, str] = {}

  def find_spec(self, name, path=None, target=None):
    if name not in self.aliases:
      return None
    return importlib.util.spec_from_loader(name, self)

  def create_module(self, spec):
    return _Alias(spec.name, self.aliases[spec.name])

  def exec_module(self, module):
    pass


_FINDER = _AliasFinder()


def moved_modules(package: str, table: dict[str, str]):
  """Keeps the import paths of modules that moved: ``import package.old`` (and ``from
  package.old import x``) gives a module forwarding to ``package.new`` for every ``old -> new``
  of ``table`` (both relative to ``package``), importing it on first use; the classes and
  functions are the moved module's own objects."""
  _FINDER.aliases.update({f"{package}.{old}": f"{package}.{new}" for old, new in table.items()})
  if _FINDER not in sys.meta_path:
    sys.meta_path.append(_FINDER)
