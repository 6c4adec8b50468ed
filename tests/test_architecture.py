"""The folder tree is the architecture: imports only point down the planes.

The import graph is read from the source with ``ast`` (module-level and function-level
imports alike, ``TYPE_CHECKING`` ones too: a type is a dependency) and folded onto the
top-level units of ``flodl_bus`` (a package or a top-level module). Each unit sits on one
layer; a unit may import its own modules and any unit on a lower layer, nothing on its own
layer or above. See ARCHITECTURE.md.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

import flodl_bus

PACKAGE = Path(flodl_bus.__file__).parent

#: Lowest first. ``flodl_bus`` is the package's own ``__init__`` (the version only);
#: ``options`` is what every command line shares (log levels, a one-line parser);
#: ``settings`` the run knobs the coordinator, the ranks and the launcher all read.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer.split())
    for layer in (
        "flodl_bus exits protocol options",
        "stop_signals partition job bus",
        "params record settings agent",
        "worker coordinator",
        "replay launch examples",
        "bench",
        "cli",
    )
)
LEVEL = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}

#: Arrows still being removed by the redesign, each with the helper removing it. Empty:
#: every arrow of issue 18 is gone. A new entry needs a reason and an owner.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


class Arrow(NamedTuple):
    src: str  # importing unit
    dst: str  # imported unit
    module: str  # importing module
    target: str  # imported module
    line: int


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(root: Path, module: str) -> str:
    parts = module.split(".")
    return root.name if len(parts) == 1 else parts[1]


def _is_module(root: Path, dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:])
    base = root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _targets(root: Path, module: str, is_pkg: bool, node: ast.AST) -> list[str]:
    """The modules of ``root``'s package that one import statement names."""
    top = root.name
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == top or a.name.startswith(top + ".")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        here = module.split(".") if is_pkg else module.split(".")[:-1]
        base = here[: len(here) - node.level + 1]
        dotted = ".".join(base + ([node.module] if node.module else []))
    else:
        dotted = node.module or ""
    if dotted != top and not dotted.startswith(top + "."):
        return []
    # ``from pkg import name``: a submodule when ``name`` is one, else pkg itself.
    return [
        f"{dotted}.{a.name}" if _is_module(root, f"{dotted}.{a.name}") else dotted
        for a in node.names
    ]


def arrows(root: Path) -> list[Arrow]:
    """Every import from one top-level unit of the package at ``root`` into another."""
    out = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(root, path)
        src = _unit(root, module)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _targets(root, module, path.name == "__init__.py", node):
                dst = _unit(root, target)
                if dst != src:
                    out.append(Arrow(src, dst, module, target, getattr(node, "lineno", 0)))
    return out


def units(root: Path) -> set[str]:
    found = {root.name}
    for path in root.iterdir():
        if path.is_dir() and (path / "__init__.py").is_file():
            found.add(path.name)
        elif path.suffix == ".py" and path.name != "__init__.py":
            found.add(path.stem)
    return found


def upward(found: list[Arrow], level: dict[str, int]) -> list[Arrow]:
    """Arrows that do not point strictly down (same layer counts: peers stay apart)."""
    return [a for a in found if level[a.dst] >= level[a.src]]


def cycles(found: list[Arrow]) -> list[list[str]]:
    """Every cycle of the unit graph, each as the path that closes it."""
    graph: dict[str, set[str]] = {}
    for a in found:
        graph.setdefault(a.src, set()).add(a.dst)
    out: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                out.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return out


def _show(found: list[Arrow]) -> str:
    return "\n".join(
        f"  {a.module}:{a.line} imports {a.target} ({a.src} -> {a.dst})" for a in found
    )


# ----------------------------------------------------------------------------- the package


def test_every_package_and_top_level_module_has_a_layer() -> None:
    missing = units(PACKAGE) - set(LEVEL)
    assert not missing, f"place {sorted(missing)} in LAYERS (and ARCHITECTURE.md)"


def test_imports_only_point_down_the_layers() -> None:
    bad = [a for a in upward(arrows(PACKAGE), LEVEL) if (a.src, a.dst) not in ALLOWED]
    assert not bad, "imports that point up or sideways:\n" + _show(bad)


def test_the_allow_list_holds_only_arrows_that_still_exist() -> None:
    present = {(a.src, a.dst) for a in upward(arrows(PACKAGE), LEVEL)}
    stale = ALLOWED - present
    assert not stale, f"remove {sorted(stale)} from ALLOWED: those arrows are gone"


def test_no_package_cycle() -> None:
    assert cycles(arrows(PACKAGE)) == []


def test_nothing_below_bench_imports_bench_or_cli() -> None:
    top = {"bench", "cli"}
    bad = [a for a in arrows(PACKAGE) if a.dst in top and a.src not in top]
    assert not bad, _show(bad)


def _coordinator_arrows() -> list[Arrow]:
    """Imports between the coordinator's own modules (TYPE_CHECKING ones too), each
    module its own unit: the core and its parts."""
    root = PACKAGE / "coordinator"
    out = []
    for path in sorted(root.glob("*.py")):
        module = f"flodl_bus.coordinator.{path.stem}"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _targets(PACKAGE, module, path.name == "__init__.py", node):
                if target.startswith("flodl_bus.coordinator.") and target != module:
                    dst = target.split(".")[2]
                    out.append(Arrow(path.stem, dst, module, target, getattr(node, "lineno", 0)))
    return out


#: what the core is made of: each takes a narrow view of the core's state (a Protocol of
#: its own module) and never imports the core back (issue 27)
CORE_PARTS = ("bridge", "checkpoint", "dispatch", "partition", "reduce")


def test_the_cores_parts_take_narrow_views_and_never_import_the_core() -> None:
    found = _coordinator_arrows()
    back = [a for a in found if a.src in CORE_PARTS and a.dst == "core"]
    assert not back, "parts importing the core (give them a view instead):\n" + _show(back)
    # the core holds its parts (the bridge through the dispatch)
    assert {a.dst for a in found if a.src == "core"} >= set(CORE_PARTS) - {"bridge"}


def test_the_coordinator_modules_form_a_tree_without_cycles() -> None:
    assert cycles(_coordinator_arrows()) == []


# ----------------------------------------------------------------------------- the checker


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return root


def test_the_checker_sees_function_level_relative_and_from_package_imports(
    tmp_path: Path,
) -> None:
    root = _tree(
        tmp_path,
        {
            "low/a.py": """
                def late() -> None:
                    from pkg.high import b  # an arrow up, hidden in a function
                """,
            "low/c.py": "from ..high.b import thing\n",
            "low/d.py": "from pkg import high\n",
            "high/b.py": "from pkg.low import a\nthing = 1\n",
            "tool.py": "import pkg.low.a\n",
        },
    )
    level = {"pkg": 0, "low": 0, "high": 1, "tool": 2}
    found = arrows(root)
    assert {(a.module, a.target) for a in found} == {
        ("pkg.low.a", "pkg.high.b"),
        ("pkg.low.c", "pkg.high.b"),
        ("pkg.low.d", "pkg.high"),
        ("pkg.high.b", "pkg.low.a"),
        ("pkg.tool", "pkg.low.a"),
    }
    assert {(a.module, a.line) for a in upward(found, level)} == {
        ("pkg.low.a", 3),
        ("pkg.low.c", 1),
        ("pkg.low.d", 1),
    }
    assert cycles(found) == [["high", "low", "high"]]
    assert units(root) == {"pkg", "low", "high", "tool"}


def test_the_checker_refuses_an_arrow_between_peers_of_one_layer(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"left/x.py": "import pkg.right.y\n", "right/y.py": ""})
    bad = upward(arrows(root), {"pkg": 0, "left": 1, "right": 1})
    assert [(a.src, a.dst) for a in bad] == [("left", "right")]


@pytest.mark.parametrize("unit", sorted(LEVEL))
def test_each_layer_entry_names_a_real_unit(unit: str) -> None:
    assert unit in units(PACKAGE), f"{unit} in LAYERS is not a unit of flodl_bus"
