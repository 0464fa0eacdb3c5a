"""The library's public surface: every module declares ``__all__``, every name in it exists, and
package star imports give the API (no submodule names, no private names)."""

import ast
import importlib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p for pkg in ("jaxsys", "pallas_kernels") for p in (ROOT / pkg).rglob("*.py"))
MODULES = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in FILES]
PACKAGES = [m for m, p in zip(MODULES, FILES) if p.name == "__init__.py"]


def _declares_all(path: Path) -> bool:
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
      return True
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
      return True  # jaxsys._lazy sets the package's __all__ from its table
  return False


def _has_api(path: Path) -> bool:
  """A module with public functions/classes, or a package whose __init__ does more than document."""
  body = ast.parse(path.read_text()).body
  if path.name == "__init__.py":
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)
  return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_") for n in body)


def test_every_module_declares_all():
  missing = [m for m, p in zip(MODULES, FILES)
             if not any(part.startswith("_") for part in m.split(".")) and _has_api(p) and not _declares_all(p)]
  assert not missing, f"modules without __all__: {missing}"


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist(name):
  if name.endswith("__main__"):
    pytest.skip("script entry point")
  module = importlib.import_module(name)
  exported = getattr(module, "__all__", [])
  assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
  missing = [n for n in exported if not hasattr(module, n)]
  assert not missing, f"{name}.__all__ names missing attributes: {missing}"


@pytest.mark.parametrize("name", [p for p in PACKAGES if p not in ("jaxsys", "pallas_kernels")])
def test_star_import_gives_the_api(name):
  ns = {}
  exec(f"from {name} import *", ns)  # noqa: S102
  names = [k for k in ns if k != "__builtins__"]
  assert names, f"{name} exports nothing"
  private = [k for k in names if k.startswith("_")]
  modules = [k for k in names if isinstance(ns[k], types.ModuleType) and k != "masks"]
  assert not private and not modules, f"{name}: private {private}, submodules {modules}"
  listed = set(dir(importlib.import_module(name)))
  assert set(names) <= listed | {"masks"}, f"{name}: dir() hides {sorted(set(names) - listed)}"


def test_api_reference_builds(tmp_path):
  """``jaxsys docs`` writes the pdoc reference; every ``__all__`` name resolves in it."""
  pytest.importorskip("pdoc")
  from jaxsys.cli import build_api_docs
  out = build_api_docs(tmp_path / "api")
  assert (out / "index.html").exists()
  ops = (out / "jaxsys" / "ops.html").read_text()
  assert "attention" in ops and "quantized_aggregate" in ops
  engine = (out / "jaxsys" / "serving" / "engine.html").read_text()
  assert "ServingEngine" in engine and "continuous batching" in engine  # the module docstring


def _private_uses(code: str) -> list[str]:
  """Names a snippet reaches that start with ``_`` (not dunders): ``x._f``, ``from a._b import c``,
  ``from a import _c``, ``import a._b``. Names the snippet defines itself are its own business."""
  # namedtuple's documented methods carry an underscore so they cannot clash with field names
  public = {"_replace", "_asdict", "_fields", "_make"}
  private = lambda n: n.startswith("_") and not (n.startswith("__") and n.endswith("__")) and n not in public
  found = []
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Attribute) and private(node.attr):
      found.append(f".{node.attr}")
    elif isinstance(node, ast.ImportFrom):
      parts = (node.module or "").split(".") + [a.name for a in node.names]
      found += [f"from {node.module} import {a.name}" for a in node.names if any(map(private, parts))]
    elif isinstance(node, ast.Import):
      found += [a.name for a in node.names if any(map(private, a.name.split(".")))]
  return found


def _user_snippets():
  """(where, code): every Python block of the README and every notebook code cell (IPython magics
  and shell lines dropped)."""
  import json
  import re
  readme = (ROOT / "README.md").read_text()
  for i, m in enumerate(re.finditer(r"```python\n(.*?)```", readme, re.S)):
    yield f"README.md python block {i + 1}", m.group(1)
  for nb in sorted((ROOT / "colab").glob("*.ipynb")):
    for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
      if cell["cell_type"] == "code":
        src = "".join(cell["source"])
        yield f"{nb.name} cell {i}", "\n".join(x for x in src.splitlines() if not x.lstrip().startswith(("%", "!")))


def test_readme_and_notebooks_use_public_names_only():
  """What users copy from calls the public API only: no README block or notebook cell reaches a name
  that starts with ``_``."""
  bad = {where: uses for where, code in _user_snippets() if (uses := _private_uses(code))}
  assert not bad, f"private names in user-facing code: {bad}"


def test_private_name_check_can_fail():
  assert _private_uses("from jaxsys.parallel import api\napi._seq_spec(p, 4)") == ["._seq_spec"]
  assert _private_uses("from jaxsys._lazy import x\nimport jaxsys.core._c") == [
      "from jaxsys._lazy import x", "jaxsys.core._c"]
  assert _private_uses("import os\nos.__name__\n_local = 1\nt._replace(a=1)") == []


def test_moved_model_modules_keep_their_import_paths():
  """``jaxsys.models`` is one subpackage per family; each module's former path still imports (an
  alias of its new home, with the same objects), ``from ... import`` and attribute access alike."""
  import jaxsys.models as M
  for old, new in M.MOVED.items():
    alias, real = importlib.import_module(f"jaxsys.models.{old}"), importlib.import_module(f"jaxsys.models.{new}")
    names = getattr(real, "__all__", [])
    assert names and all(getattr(alias, n) is getattr(real, n) for n in names), old
  ns = {}
  exec("from jaxsys.models.decoder import Decoder\nfrom jaxsys.models import gguf", ns)  # noqa: S102
  assert ns["Decoder"] is M.Decoder and ns["gguf"].from_gguf is M.from_gguf
