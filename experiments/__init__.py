"""Experiments: one script per headline result, registered under a short name.

Each module ``experiments/<name>.py`` defines ``run(quick: bool, out_dir: str) -> list[Row]``
(it writes ``<out_dir>/<name>/result.json`` and plots through ``jaxsys.core.results``) and is
runnable alone as ``python -m experiments.<name> [--quick] [--out DIR]``.
``jaxsys reproduce`` runs every registered experiment in its own process. The registry lives in
``jaxsys.experiments`` (the library's namespace: a user's own ``experiments`` package cannot
shadow it) and is re-exported here.
"""

from jaxsys.experiments import REGISTRY  # noqa: F401
