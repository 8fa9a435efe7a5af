"""The house's shape: specdraft's import graph has no circle and no arrow running up a layer.

The layers are written once, in docs/architecture.md's table; every import of a ``specdraft`` module is an arrow,
top-level and function-level alike (a lazy import still couples the two modules).
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "specdraft"
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def module_name(path: Path, src: Path) -> str:
    """``specdraft/cli/pair.py`` → ``cli.pair``; a package's ``__init__.py`` → the package's name ('' for the root)."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module → the specdraft modules it imports (``from specdraft.x import y`` and ``from specdraft import x``
    alike; the package root, which holds only lazy re-exports and the version, is not an arrow)."""
    files = {module_name(p, src): p for p in src.rglob("*.py")}
    modules = set(files) - {""}
    graph: dict[str, set[str]] = {}
    for m in sorted(modules):
        found: set[str] = set()
        for node in ast.walk(ast.parse(files[m].read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{files[m]}: relative import; write `from specdraft.… import …`"
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name != src.name and not name.startswith(src.name + "."):
                    continue
                name = name.removeprefix(src.name).removeprefix(".")
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name:
                    found.add(name)
        graph[m] = found - {m}
    return graph


def layers(text: str) -> dict[str, int]:
    """The layers table between ``<!-- layers:start -->`` and ``<!-- layers:end -->``: module → layer number
    (``cli`` stands for the package and its modules)."""
    table = re.search(r"<!-- layers:start -->(.*?)<!-- layers:end -->", text, re.DOTALL)
    assert table, "docs/architecture.md lost its layers table (<!-- layers:start --> … <!-- layers:end -->)"
    out: dict[str, int] = {}
    for row in table.group(1).splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`([\w.]+)`", cells[2]):
            assert name not in out, f"{name} is placed in two layers"
            out[name] = int(cells[0])
    return out


def layer_of(module: str, table: dict[str, int]) -> int | None:
    return table.get(module, table.get(module.partition(".")[0]) if "." in module else None)


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of ``graph`` (its modules in import order), or [] when it has none."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


def arrows_up(graph: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    """Every import of a module placed in a higher layer than the importer, as ``a (layer i) → b (layer j)``."""
    return [f"{m} (layer {layer_of(m, table)}) → {t} (layer {layer_of(t, table)})"
            for m, targets in graph.items() for t in sorted(targets)
            if None not in (layer_of(m, table), layer_of(t, table)) and layer_of(t, table) > layer_of(m, table)]


def test_the_import_graph_has_no_circle():
    found = circle(import_graph())
    assert not found, "import circle: " + " → ".join(found)


def test_every_module_is_placed_in_exactly_one_layer_of_the_architecture_table():
    table, graph = layers(ARCHITECTURE.read_text(encoding="utf-8")), import_graph()
    unplaced = [m for m in graph if layer_of(m, table) is None]
    assert not unplaced, f"add these modules to docs/architecture.md's layers table: {unplaced}"
    gone = sorted(set(table) - set(graph))
    assert not gone, f"docs/architecture.md's layers table names modules that no longer exist: {gone}"


def test_no_module_imports_one_from_a_higher_layer():
    up = arrows_up(import_graph(), layers(ARCHITECTURE.read_text(encoding="utf-8")))
    assert not up, "arrows up a layer:\n" + "\n".join(up)


def test_the_checks_find_the_circle_and_the_arrow_up_of_a_package_built_to_have_them(tmp_path):
    """The negative control: a function-level import closes a circle and runs up a layer; both are found."""
    pkg = tmp_path / "specdraft"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "config.py").write_text("def f():\n    from specdraft.pipeline import run\n")
    (pkg / "pipeline.py").write_text("from specdraft import config\n\ndef run():\n    pass\n")
    (pkg / "cli" / "__init__.py").write_text("from specdraft.pipeline import run\n")
    (pkg / "cli" / "pair.py").write_text("import specdraft.cli\nfrom specdraft import __version__\n")
    graph = import_graph(pkg)
    assert graph == {"config": {"pipeline"}, "pipeline": {"config"}, "cli": {"pipeline"}, "cli.pair": {"cli"}}
    assert sorted(circle(graph)[:2]) == ["config", "pipeline"]
    table = layers("<!-- layers:start -->\n| 0 | x | `config` |\n| 4 | x | `pipeline` |\n| 5 | x | `cli` |\n"
                   "<!-- layers:end -->")
    assert layer_of("cli.pair", table) == 5 and layer_of("clip", table) is None
    assert arrows_up(graph, table) == ["config (layer 0) → pipeline (layer 4)"]
