"""``jaxsys.cluster`` is the JAX-free simulator layer (its package docstring): importing every
module but ``demo_job`` loads neither JAX, Flax nor optax."""

import subprocess
import sys

CODE = """
import importlib, pkgutil, sys
import jaxsys.cluster as c
names = sorted(m.name for m in pkgutil.iter_modules(c.__path__) if m.name != "demo_job")
for name in names:
  importlib.import_module("jaxsys.cluster." + name)
c.simulate, c.ClusterSpec  # the lazy exports resolve
print(len(names), *sorted(m for m in ("jax", "flax", "optax") if m in sys.modules))
"""


def test_cluster_imports_no_jax():
  out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout.split()
  assert int(out[0]) >= 10 and out[1:] == [], out


def test_demo_job_is_the_exception():
  code = "import sys, jaxsys.cluster.demo_job; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == "True"
