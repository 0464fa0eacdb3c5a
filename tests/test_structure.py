"""Structure of the package, read from the source with ``ast`` (nothing is imported).

* The decoder block is written once: only ``jaxsys/models/`` and ``jaxsys/nn/`` may reach into an
  attention layer's ``project_qkv`` or loop over a model's ``.layers`` to run blocks; everything
  else calls ``Decoder.forward_hidden`` (or the model's own methods).
* Public class names are unique across ``jaxsys/`` and ``pallas_kernels/``, so a name says which
  class it is without its module.
* No package exports a function or class under the name of one of its submodules (the attribute
  would be the function on one access and the module after an import).

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


def _defines(tree: ast.AST, name: str) -> bool:
  """Whether a module binds ``name`` at top level (def, class, assignment or import)."""
  for node in tree.body:
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    if isinstance(node, defs) and node.name == name:
      return True
    if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
        (a.asname or a.name) == name for a in node.names):
      return True
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      if any(isinstance(t, ast.Name) and t.id == name for t in targets):
        return True
  return False


def _lazy_tables(tree: ast.AST):
  """``{name: submodule}`` literals passed to ``lazy_exports(__name__, {...})``."""
  for node in ast.walk(tree):
    if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports"
        and len(node.args) == 2 and isinstance(node.args[1], ast.Dict)):
      for k, v in zip(node.args[1].keys, node.args[1].values):
        if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
          yield k.lineno, k.value, v.value


def shadowed_submodules(package_dir: pathlib.Path, root: pathlib.Path = ROOT):
  """``[(line, name)]`` where ``package/__init__.py`` exports a non-module under a submodule's
  name."""
  init = package_dir / "__init__.py"
  subs = {p.stem for p in package_dir.glob("*.py") if p.stem != "__init__"}
  subs |= {d.name for d in package_dir.iterdir() if (d / "__init__.py").is_file()}
  pkg = package_dir.relative_to(root).as_posix().replace("/", ".")
  tree = ast.parse(init.read_text())
  found = []
  for node in tree.body:
    if isinstance(node, ast.ImportFrom):
      for a in node.names:
        bound = a.asname or a.name
        is_the_module = node.module == pkg and a.name == bound  # ``from pkg import sub``
        if bound in subs and not is_the_module:
          found.append((node.lineno, bound))
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in subs:
      found.append((node.lineno, node.name))
  for line, name, module in _lazy_tables(tree):
    path = package_dir / (module.replace(".", "/") + ".py")
    if name in subs and path.is_file() and _defines(ast.parse(path.read_text()), name):
      found.append((line, name))
  return sorted(found)


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


def test_shadow_detector(tmp_path):
  pkg = tmp_path / "p"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "api.py").write_text("def sub(): pass\ndef gen(): pass\n")
  (pkg / "gen.py").write_text("def gen(): pass\n")
  (pkg / "other.py").write_text("")
  (pkg / "__init__.py").write_text(
      "from p import other\n"                  # the module itself: fine
      "from p.api import sub\n"                # a function over the subpackage
      "__getattr__, __dir__ = lazy_exports(__name__, {\n"
      "  'gen': 'gen',\n"                       # function gen in module gen
      "  'other': 'other',\n"                   # module listed by name: fine
      "})\n")
  assert shadowed_submodules(pkg, root=tmp_path) == [(2, "sub"), (4, "gen")]


def test_decoder_block_is_only_written_in_models_and_nn():
  offenders = [f"{rel}:{line}: {what}"
               for rel, tree in _sources("jaxsys") if not rel.startswith(BLOCK_OWNERS)
               for line, what in block_loop_sites(tree)]
  assert not offenders, (
      "the decoder block is re-implemented outside jaxsys/models and jaxsys/nn (call "
      "Decoder.forward_hidden instead):\n  " + "\n  ".join(offenders))


def test_no_export_shadows_a_submodule():
  offenders = []
  for package in PACKAGES:
    for init in sorted((ROOT / package).rglob("__init__.py")):
      rel = init.relative_to(ROOT).as_posix()
      offenders += [f"{rel}:{line}: {name!r} is a submodule and an exported function/class"
                    for line, name in shadowed_submodules(init.parent)]
  assert not offenders, ("rename the module or the export:\n  " + "\n  ".join(offenders))


def test_public_class_names_are_unique():
  where = collections.defaultdict(list)
  for rel, tree in _sources(*PACKAGES):
    for name, line in public_classes(tree):
      where[name].append(f"{rel}:{line}")
  clashes = {name: sites for name, sites in sorted(where.items()) if len(sites) > 1}
  assert not clashes, "public classes sharing a name:\n  " + "\n  ".join(
      f"{name}: {', '.join(sites)}" for name, sites in clashes.items())


def test_every_checkpoint_goes_through_the_verified_checkpointer():
  """Raw orbax checkpointers skip atomic finalisation and hash verification: only
  ``jaxsys/core/checkpoint.py`` may construct one."""
  import re
  raw = re.compile(r"\b(StandardCheckpointer|PyTreeCheckpointer|CheckpointManager|ocp\.Checkpointer)\s*\(")
  offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "jaxsys").rglob("*.py"))
               if p.name != "checkpoint.py" and raw.search(p.read_text())]
  offenders += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "experiments").rglob("*.py"))
                if raw.search(p.read_text())]
  assert not offenders, offenders


# ----------------------------------------------------------------------------- import direction

# DESIGN's layer order, bottom to top (a module imports its own package or a lower rank, at module
# level and inside functions alike). Two refinements of DESIGN's levels, where the code's one
# dependency between peers runs one way only: quant < ops < graphs, vision (ops' quantized
# aggregation reads quant's packed-feature format; graphs validate ids with ops' checks), and
# nerf < data (the scene renderer uses nerf's pinhole camera).
LAYER_RANK = {"_lazy": -1, "core": 0, "quant": 0.5, "ops": 1, "graphs": 1.5, "vision": 1.5, "nerf": 2,
              "parallel": 2, "data": 2.5, "nn": 3, "train": 4, "models": 5, "decoding": 6, "eval": 6,
              "serving": 7, "speculative": 7, "rl": 8, "experiments": 9, "cli": 10}
BESIDE = {"cluster": ("core", "train", "_lazy")}   # beside the stack: imports only these


def _layer(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if parts[0] == "jaxsys" and len(parts) > 1 else None


def upward_imports(rel: str, tree: ast.AST) -> list[tuple[int, str]]:
  """``(line, "a -> b")`` for each import in ``jaxsys/<a>/...`` of a package it may not use."""
  me = rel.split("/")[1].removesuffix(".py")
  if me == "__init__":
    return []
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      mods = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      mods = [node.module] + [f"jaxsys.{a.name}" for a in node.names if node.module == "jaxsys"]
    else:
      continue
    for m in mods:
      other = _layer(m)
      if other is None or other == me:
        continue
      if me in BESIDE:
        ok = other in BESIDE[me]
      elif other in BESIDE:
        ok = LAYER_RANK.get(me, -1) >= LAYER_RANK["experiments"]
      else:
        ok = LAYER_RANK[other] < LAYER_RANK[me]
      if not ok:
        found.append((node.lineno, f"{me} -> {m}"))
  return sorted(found)


def test_imports_run_down_the_layers():
  bad = [f"{rel}:{line} {what}" for rel, tree in _sources("jaxsys") for line, what in upward_imports(rel, tree)]
  assert not bad, "imports against DESIGN's layer order:\n" + "\n".join(bad)


def test_import_direction_detector():
  src = ast.parse("from jaxsys.serving import x\n"
                  "def f():\n  import jaxsys.speculative.tree\n  from jaxsys.core import errors\n"
                  "from jaxsys import rl\n")
  assert upward_imports("jaxsys/decoding/cache.py", src) == [
      (1, "decoding -> jaxsys.serving"), (3, "decoding -> jaxsys.speculative.tree"), (5, "decoding -> jaxsys.rl")]
  assert upward_imports("jaxsys/cluster/sim.py", ast.parse("from jaxsys.train import x\nimport jaxsys.ops\n")) == [
      (2, "cluster -> jaxsys.ops")]
  assert set(LAYER_RANK) | set(BESIDE) >= {p.name.removesuffix(".py") for p in (ROOT / "jaxsys").iterdir()
                                           if p.name not in ("__init__.py", "__pycache__", "py.typed", "assets")}


def test_one_sampling_filter():
  """Top-p needs a cumulative sum over sorted probabilities: only the one filter
  (``jaxsys.decoding.sampling._filter``) computes one among the packages that sample."""
  sampling = "jaxsys/decoding/sampling.py"
  found = []
  for rel, tree in _sources("jaxsys"):
    if rel.split("/")[1] not in ("decoding", "serving", "speculative", "rl", "models") or rel == sampling:
      continue
    found += [f"{rel}:{n.lineno}" for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and n.attr == "cumsum"]
  assert not found, "a second top-p filter:\n" + "\n".join(found)
  tree = ast.parse((ROOT / sampling).read_text())
  owners = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
            and any(isinstance(n, ast.Attribute) and n.attr == "cumsum" for n in ast.walk(f))]
  assert owners == ["_filter"], owners


def _impl_choices(tree: ast.AST) -> list[int]:
  """Lines comparing a variable named ``impl`` (or ``*_impl``) with a string: choosing an
  implementation, which is the dispatcher's job (``jaxsys.core.dispatch``)."""
  def named_impl(x):
    name = x.id if isinstance(x, ast.Name) else (x.attr if isinstance(x, ast.Attribute) else "")
    return name == "impl" or name.endswith("_impl")
  return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
          and any(named_impl(x) for x in [n.left, *n.comparators])
          and any(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in [n.left, *n.comparators])]


def test_dispatch_is_decided_in_the_dispatcher():
  """Above the ops layer no caller picks an implementation (``impl == "auto"`` and the like): it
  passes ``impl`` on, and a kernel that cannot run a case refuses it inside the dispatcher."""
  assert _impl_choices(ast.parse('x = "xla" if impl == "auto" and s else impl\n')) == [1]
  found = []
  for rel, tree in _sources("jaxsys"):
    if rel.startswith(("jaxsys/ops/", "jaxsys/core/dispatch.py")):
      continue
    found += [f"{rel}:{ln}" for ln in _impl_choices(tree)]
  assert not found, "an implementation chosen outside the dispatcher:\n" + "\n".join(found)


def _python_training_loops(tree: ast.AST) -> list[int]:
  """Lines inside a ``for`` / ``while`` loop that assign an optimizer state from a step call
  (``params, opt_state, ... = step(...)``): a hand-written training loop."""
  found = []
  for loop in ast.walk(tree):
    if isinstance(loop, (ast.For, ast.While)):
      found += [n.lineno for n in ast.walk(loop) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                and any(isinstance(t, ast.Tuple) and any(isinstance(e, ast.Name) and e.id in ("opt", "opt_state")
                                                         for e in t.elts) for t in n.targets)]
  return sorted(set(found))


def test_one_training_loop_family():
  """Training loops are the family's: ``jaxsys.train.train`` (language models),
  ``core.step.run_steps`` (every other recipe) and the node-classification ``lax.scan``; no other
  module steps an optimizer in a Python loop."""
  assert _python_training_loops(ast.parse("for i in range(3):\n  p, opt, loss = step(p, opt)\n")) == [2]
  owners = ("jaxsys/train.py", "jaxsys/core/step.py")
  found = [f"{rel}:{ln}" for rel, tree in _sources("jaxsys") if rel not in owners
           for ln in _python_training_loops(tree)]
  assert not found, "a training loop outside the family:\n" + "\n".join(found)


def _calls(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
  out = []
  for n in ast.walk(tree):
    if isinstance(n, ast.Call):
      f = n.func
      name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
      if name in names:
        out.append((n.lineno, name))
  return out


def test_one_on_device_decode_loop():
  """Decoding loops are the decoding core's ``while_running`` (one ``lax.while_loop``), and the
  rollout engine's step functions run only inside ``speculative.fused``'s loops: no Python loop
  dispatches decode steps one at a time."""
  python_loop = ast.parse("for _ in range(n):\n  s = dec.vanilla_step(m, s, c)\n")
  assert _calls(python_loop, {"vanilla_step"}) == [(2, "vanilla_step")]  # the detector sees one
  loops, steps = [], []
  for rel, tree in _sources("jaxsys"):
    if rel.split("/")[1] not in ("decoding", "serving", "speculative", "rl"):
      continue
    if rel != "jaxsys/decoding/core.py":
      loops += [f"{rel}:{ln} {name}" for ln, name in _calls(tree, {"while_loop", "fori_loop"})]
    if rel not in ("jaxsys/speculative/fused.py", "jaxsys/speculative/decode.py"):
      steps += [f"{rel}:{ln} {name}" for ln, name in
                _calls(tree, {"vanilla_step", "drafter_sync", "verify", "draft"})]
  assert not loops, "a second decode loop:\n" + "\n".join(loops)
  assert not steps, "a decode step called outside the on-device loops:\n" + "\n".join(steps)


OPTAX_OPTIMIZERS = {"adam", "adamw", "sgd", "lion", "lamb", "rmsprop", "adagrad", "adafactor", "nadam",
                    "radam", "adamax", "novograd", "fromage", "lars", "yogi", "sm3", "noisy_sgd"}


def _optax_optimizer_calls(tree: ast.AST) -> list[tuple[int, str]]:
  return [(n.lineno, n.func.attr) for n in ast.walk(tree)
          if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in OPTAX_OPTIMIZERS
          and isinstance(n.func.value, ast.Name) and n.func.value.id == "optax"]


def test_one_optimizer_construction():
  """Every optimizer is built by ``jaxsys.core.optim.OptimizerConfig.build`` (library and
  experiments): no other module calls an optax optimizer constructor."""
  probe = ast.parse("tx = optax.multi_transform({'a': optax.adamw(1e-3), 'b': adam(1e-3)}, labels)")
  assert _optax_optimizer_calls(probe) == [(1, "adamw")]  # optax's, not a local helper's
  found = [f"{rel}:{ln} optax.{name}" for root in ("jaxsys", "experiments") for rel, tree in _sources(root)
           if rel != "jaxsys/core/optim.py" for ln, name in _optax_optimizer_calls(tree)]
  assert not found, "an optimizer built outside jaxsys.core.optim:\n" + "\n".join(found)


PREFILL_VIEWS = {"Prefill", "PagedPrefill", "PagedChunk"}  # the cache views a prompt is written through
PREFILL_HOMES = {"jaxsys/decoding/core.py": {"Prefill"},              # contiguous KV cache
                 "jaxsys/serving/prefill.py": {"PagedPrefill", "PagedChunk"}}  # paged pools (LServe)


def test_one_prefill():
  """A prompt enters a cache in one place per cache type: the decoding core's ``prefill`` (the
  contiguous cache of generate, rollouts and video GRPO) and ``serving.prefill`` (the paged pools);
  both are the model's own ``forward_hidden`` over a cache view. No other module builds a view."""
  assert _calls(ast.parse("h, c = m.forward_hidden(t, cache=views.Prefill(c))"), PREFILL_VIEWS) == [(1, "Prefill")]
  found: dict = {}
  for rel, tree in _sources("jaxsys"):
    for ln, name in _calls(tree, PREFILL_VIEWS):
      found.setdefault(rel, set()).add(name)
      assert name in PREFILL_HOMES.get(rel, ()), f"a second prefill: {rel}:{ln} builds {name}"
  assert found == PREFILL_HOMES


# ----------------------------------------------------------------------------- node classification

CROSS_ENTROPY = {"softmax_cross_entropy_with_integer_labels", "softmax_cross_entropy", "log_softmax"}
NODE_LOSS = "jaxsys/graphs/node_loss.py"  # the one masked node cross-entropy
GRAPH_STACK = ("jaxsys.graphs", "jaxsys.models.graph.gnn", "jaxsys.models.graph", "jaxsys.parallel.graph",
               "jaxsys.nn.graph", "jaxsys.ops.graph_attn", "jaxsys.ops.quantized_agg")
# where the five copies lived: (package root, file name), found by name so a move keeps them
FORMER_COPIES = (("jaxsys/models", "gnn.py"), ("jaxsys/models", "graph_transformer.py"),
                 ("jaxsys/parallel", "graph.py"), ("jaxsys/parallel", "graph_comm.py"),
                 ("experiments", "torchgt.py"))


def node_classification_cross_entropies(tree: ast.AST) -> list[tuple[int, str]]:
  """Cross-entropy calls in a module that uses the graph stack (imports from ``GRAPH_STACK`` or
  ``from jaxsys import graphs``, at any depth): each is a masked node cross-entropy written again."""
  return _calls(tree, CROSS_ENTROPY) if _imports_graph_stack(tree) else []


def test_one_masked_node_cross_entropy():
  """Node classification's loss is ``jaxsys.graphs.node_loss.masked_node_cross_entropy``: no
  module on the graph stack calls a cross-entropy itself, and each former copy calls the one."""
  copy = ast.parse("def f(model, x, inputs, y, m):\n  from jaxsys.graphs import inputs\n"
                   "  ce = optax.softmax_cross_entropy_with_integer_labels(model(x, inputs), y)\n"
                   "  return jnp.sum(ce * m) / jnp.sum(m)\n")
  assert node_classification_cross_entropies(copy) == [(3, "softmax_cross_entropy_with_integer_labels")]
  lm_loss = ast.parse("import optax\nce = optax.softmax_cross_entropy(logits, targets)\n")
  assert node_classification_cross_entropies(lm_loss) == []  # token losses are not node losses
  found = []
  for package in ("jaxsys", "experiments"):
    for rel, tree in _sources(package):
      if rel != NODE_LOSS:
        found += [f"{rel}:{ln} {name}" for ln, name in node_classification_cross_entropies(tree)]
  assert not found, "a second masked node cross-entropy:\n" + "\n".join(found)
  missing = []
  for root, name in FORMER_COPIES:
    paths = sorted((ROOT / root).rglob(name))
    assert paths, f"{root}/**/{name} not found"
    if not any(_calls(ast.parse(p.read_text()), {"masked_node_cross_entropy"}) for p in paths):
      missing.append(f"{root}/**/{name}")
  assert not missing, "former copies that no longer call masked_node_cross_entropy: " + ", ".join(missing)


NODE_LOOP = "run_node_training"  # jaxsys/models/graph/node_classification.py: the one loop


def node_training_loops(tree: ast.AST) -> list[tuple[int, str]]:
  """In a module on the graph stack: compiled step loops, and train steps built without the one
  loop (``make_train_step`` in a module that never calls ``run_node_training``)."""
  if not _imports_graph_stack(tree):
    return []
  found = _calls(tree, {"scan", "fori_loop", "while_loop"})
  if not _calls(tree, {NODE_LOOP}):
    found += _calls(tree, {"make_train_step"})
  return sorted(found)


def _imports_graph_stack(tree: ast.AST) -> bool:
  for n in ast.walk(tree):
    if isinstance(n, ast.Import) and any(a.name.startswith(GRAPH_STACK) for a in n.names):
      return True
    if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and (
        n.module.startswith(GRAPH_STACK) or (n.module == "jaxsys" and any(a.name == "graphs" for a in n.names))):
      return True
  return False


def test_one_node_classification_loop():
  """The graph models' recipes (GNN / A2Q, graph transformer, Sylvie) train on
  ``jaxsys.models.graph.node_classification.run_node_training``: no model module on the graph stack
  compiles its own step loop or builds a train step it does not run there."""
  own = ast.parse("from jaxsys.graphs import node_loss\nstep = make_train_step(f, tx)\n"
                  "out = jax.lax.scan(body, s, xs)\n")
  assert node_training_loops(own) == [(2, "make_train_step"), (3, "scan")]
  found = [f"{rel}:{ln} {name}" for rel, tree in _sources("jaxsys") if rel.startswith("jaxsys/models/")
           for ln, name in node_training_loops(tree)]
  assert not found, "a second node-classification loop:\n" + "\n".join(found)
  users = {rel for rel, tree in _sources("jaxsys") if rel.startswith("jaxsys/models/") and _calls(tree, {NODE_LOOP})}
  assert len(users) >= 2, users  # the GNN and the graph-transformer recipes
