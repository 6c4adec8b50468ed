"""``up``'s check of ``--job MODULE:NAME`` before it starts anything, without importing.

Importing the job means importing torch: seconds that would delay every run's first
step, since the children import it again. So ``up`` reads instead: the module must be
found (the working directory, the job's own folder, is importable), and its source must
define ``NAME`` at top level (an assignment, a def or class, an import). A typo is
refused in a moment, with the names that are there; whether ``NAME`` is a Job is the
coordinator's check, made before it touches Redis (``up`` passes its one line on).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys

DEFAULT_JOB = "flodl_bus.examples.digits:job"


def _top_level_names(source: str) -> set[str] | None:
    """Names a module's source binds at top level; None when it cannot be told (a star
    import or a module ``__getattr__`` can provide any name)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            return None  # names bound conditionally: let the import decide
    return names


def check_job_ref(ref: str) -> str | None:
    """Why ``MODULE:NAME`` cannot name a job, found without importing the module (so a
    typo fails in a moment, not after three processes imported torch); None if it may."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        return f"--job {ref!r}: expected MODULE:NAME, e.g. {DEFAULT_JOB}"
    cwd = os.getcwd()  # importable, as load_job makes it (the job's own folder)
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        spec, why = None, f" ({exc})"
    else:
        why = ""
    if spec is None:
        return (
            f"--job {ref!r}: no module {module_name}{why}; use an absolute module name that "
            "is installed or on PYTHONPATH"
        )
    origin = spec.origin
    if not origin or not origin.endswith(".py"):
        return None  # compiled or namespace: only the import can tell
    try:
        with open(origin, encoding="utf-8") as f:
            names = _top_level_names(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None  # the import will say what is wrong with it
    if names is not None and attr not in names:
        public = sorted(n for n in names if not n.startswith("_"))
        shown = ", ".join(public[:8]) + (", ..." if len(public) > 8 else "")
        return (
            f"--job {ref!r}: {module_name} has no attribute {attr!r}"
            + (f" (it defines {shown})" if shown else "")
            + "; name a Job (or a zero-argument function returning one) defined there"
        )
    return None
