"""Structure of the package, read from the source with ``ast`` (nothing is imported).

* The decoder block is written once: only ``jaxsys/models/`` and ``jaxsys/nn/`` may reach into an
  attention layer's ``project_qkv`` or loop over a model's ``.layers`` to run blocks; everything
  else calls ``Decoder.forward_hidden`` (or the model's own methods).
* Public class names are unique across ``jaxsys/`` and ``pallas_kernels/``, so a name says which
  class it is without its module.

Each test lists every offending ``file:line``.
"""

from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxsys", "pallas_kernels")
BLOCK_OWNERS = ("jaxsys/models/", "jaxsys/nn/")  # where the decoder block may be written


def _sources(*packages):
  for package in packages:
    for path in sorted((ROOT / package).rglob("*.py")):
      rel = path.relative_to(ROOT).as_posix()
      yield rel, ast.parse(path.read_text(), filename=rel)


def _is_layers(node) -> bool:
  """``<expr>.layers`` (a model's block list)."""
  return isinstance(node, ast.Attribute) and node.attr == "layers"


def _iterates_layers(iterable) -> bool:
  """``<expr>.layers``, ``enumerate(<expr>.layers)`` or ``zip(..., <expr>.layers, ...)``."""
  if _is_layers(iterable):
    return True
  return (isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name)
          and iterable.func.id in ("enumerate", "zip", "reversed")
          and any(_is_layers(a) for a in iterable.args))


def block_loop_sites(tree: ast.AST) -> list[tuple[int, str]]:
  """``(line, what)`` of each ``.project_qkv`` use and each loop over ``<expr>.layers``."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr == "project_qkv":
      found.append((node.lineno, "uses .project_qkv"))
    elif isinstance(node, (ast.For, ast.AsyncFor)) and _iterates_layers(node.iter):
      found.append((node.lineno, "loops over .layers"))
    elif isinstance(node, ast.comprehension) and _iterates_layers(node.iter):
      found.append((node.iter.lineno, "loops over .layers (comprehension)"))
  return sorted(found)


def public_classes(tree: ast.AST) -> list[tuple[str, int]]:
  return [(n.name, n.lineno) for n in ast.walk(tree)
          if isinstance(n, ast.ClassDef) and not n.name.startswith("_")]


def test_detectors_see_what_they_look_for():
  src = ast.parse(
      "for i, layer in enumerate(model.layers):\n"
      "  q, k, v = layer.attn.project_qkv(x)\n"
      "for layer in self.model.layers:\n"
      "  pass\n"
      "hs = [f(l) for l in m.layers]\n"
      "for a, l in zip(xs, m.layers):\n"
      "  pass\n"
      "for x in layers:\n"          # a plain list, not a model's blocks
      "  pass\n"
      "class A: pass\n"
      "class _B: pass\n")
  assert [line for line, _ in block_loop_sites(src)] == [1, 2, 3, 5, 6]
  assert public_classes(src) == [("A", 10)]


def test_decoder_block_is_only_written_in_models_and_nn():
  offenders = [f"{rel}:{line}: {what}"
               for rel, tree in _sources("jaxsys") if not rel.startswith(BLOCK_OWNERS)
               for line, what in block_loop_sites(tree)]
  assert not offenders, (
      "the decoder block is re-implemented outside jaxsys/models and jaxsys/nn (call "
      "Decoder.forward_hidden instead):\n  " + "\n  ".join(offenders))


def test_public_class_names_are_unique():
  where = collections.defaultdict(list)
  for rel, tree in _sources(*PACKAGES):
    for name, line in public_classes(tree):
      where[name].append(f"{rel}:{line}")
  clashes = {name: sites for name, sites in sorted(where.items()) if len(sites) > 1}
  assert not clashes, "public classes sharing a name:\n  " + "\n  ".join(
      f"{name}: {', '.join(sites)}" for name, sites in clashes.items())
