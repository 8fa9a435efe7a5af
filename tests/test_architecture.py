"""The house's shape: specdraft's import graph has no circle and no arrow running up a layer.

The layers are written once, in docs/architecture.md's table; every import of a ``specdraft`` module is an arrow,
top-level and function-level alike (a lazy import still couples the two modules).
"""

from __future__ import annotations

import ast
import graphlib
import json
import re
import subprocess
import sys
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
    """The layers table between ``<!-- layers:start -->`` and ``<!-- layers:end -->``: module (dotted under its
    folder, ``core.config``) → layer number; a row's folder cell is ``core/`` or ``—`` for the package's top (where
    ``cli`` stands for the package and its modules)."""
    table = re.search(r"<!-- layers:start -->(.*?)<!-- layers:end -->", text, re.DOTALL)
    assert table, "docs/architecture.md lost its layers table (<!-- layers:start --> … <!-- layers:end -->)"
    out: dict[str, int] = {}
    for row in table.group(1).splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        folder = re.fullmatch(r"`(\w+)/`", cells[1])
        prefix = folder.group(1) + "." if folder else ""
        if folder:
            assert folder.group(1) not in out, f"folder {folder.group(1)}/ is placed in two layers"
            out[folder.group(1)] = int(cells[0])
        for name in re.findall(r"`(\w+)`", cells[3]):
            assert prefix + name not in out, f"{prefix + name} is placed in two layers"
            out[prefix + name] = int(cells[0])
    return out


def folder_of(module: str) -> str:
    """``core.config`` → ``core``; a module at the package's top (``testing``, ``cli.pair``) → ``''``."""
    head = module.partition(".")[0]
    return head if "." in module and head != "cli" else ""


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


def sideways(graph: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    """Imports between two folders of one layer (``measuring/`` and ``training/`` are peers: neither reads the other)."""
    return [f"{m} → {t}" for m, targets in graph.items() for t in sorted(targets)
            if folder_of(m) and folder_of(t) and folder_of(m) != folder_of(t)
            and layer_of(m, table) == layer_of(t, table)]


def test_no_module_imports_one_from_a_peer_folder_of_its_layer():
    found = sideways(import_graph(), layers(ARCHITECTURE.read_text(encoding="utf-8")))
    assert not found, "imports between folders of one layer:\n" + "\n".join(found)


def test_the_folders_are_the_layers_and_each_says_what_it_holds_and_may_import():
    table = layers(ARCHITECTURE.read_text(encoding="utf-8"))
    folders = sorted(p.name for p in SRC.iterdir() if p.is_dir() and p.name not in {"cli", "__pycache__"})
    assert folders == sorted(k for k in table if "." not in k and (SRC / k).is_dir() and k != "cli"), (
        "every folder of src/specdraft is one row of docs/architecture.md's layers table")
    for folder in folders:
        doc = ast.get_docstring(ast.parse((SRC / folder / "__init__.py").read_text(encoding="utf-8"))) or ""
        assert "May import" in doc and len(doc.splitlines()) <= 15, f"{folder}/__init__.py: say what lives there " \
            "and what it may import, in at most 15 lines"
        assert (SRC / folder / "__init__.py").read_text(encoding="utf-8").count("import ") == doc.count("import "), (
            f"{folder}/__init__.py holds its docstring only (no re-exports: a module is imported by its own path)")


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
    table = layers("<!-- layers:start -->\n| 0 | — | x | `config` |\n| 4 | — | x | `pipeline` |\n| 5 | — | x | `cli` |\n"
                   "<!-- layers:end -->")
    assert layer_of("cli.pair", table) == 5 and layer_of("clip", table) is None
    assert arrows_up(graph, table) == ["config (layer 0) → pipeline (layer 4)"]


def test_the_checks_find_an_import_between_peer_folders_and_place_modules_by_folder(tmp_path):
    """The negative control for folders: two folders of one layer importing each other are found; a module is placed
    under its folder's name, so a table row of another folder does not place it."""
    pkg = tmp_path / "specdraft"
    for folder in ("core", "training", "measuring"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text('"""x"""\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "io.py").write_text("")
    (pkg / "training" / "distill.py").write_text("from specdraft.measuring.evaluate import run\n")
    (pkg / "measuring" / "evaluate.py").write_text("from specdraft.core.io import x\n")
    graph = import_graph(pkg)
    table = layers("<!-- layers:start -->\n| 0 | `core/` | x | `io` |\n| 5 | `training/` | x | `distill` |\n"
                   "| 5 | `measuring/` | x | `evaluate` |\n| 7 | — | x | `cli`, `testing` |\n<!-- layers:end -->")
    assert table["training.distill"] == 5 and "distill" not in table and table["testing"] == 7
    assert sideways(graph, table) == ["training.distill → measuring.evaluate"]
    assert arrows_up(graph, table) == []


# What `specdraft --help` and vLLM's two entry points import at start-up, torch-free: these modules alone keep their
# imports of heavier rooms inside functions. Adding one here is a choice the test makes visible.
STARTUP = ("specdraft.cli", "specdraft.serving.vllm_plugin", "specdraft.vllm_proposer")
STARTUP_ROOMS = {"core.acceptance", "core.config", "core.embedded", "data.prompts", "data.sources",
                 "serving.vllm_plugin", "serving.vllm_proposer", "vllm_proposer"}


def function_level_imports(path: Path) -> list[str]:
    """``line: statement`` for every ``specdraft`` import inside a function of the module at ``path``."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for st in ast.walk(fn):
                if isinstance(st, ast.ImportFrom) and (st.module or "").startswith("specdraft") or isinstance(
                        st, ast.Import) and any(a.name.startswith("specdraft") for a in st.names):
                    found.append(f"{st.lineno}: {ast.unparse(st)}")
    return sorted(set(found), key=lambda line: int(line.split(":")[0]))


def test_start_up_imports_no_torch_and_only_the_named_rooms():
    code = (f"import {', '.join(STARTUP)}, sys, json; print(json.dumps([sorted(m for m in sys.modules "
            "if m.startswith('specdraft.')), [m for m in ('torch', 'transformers') if m in sys.modules]]))")
    loaded, heavy = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                              check=True).stdout)
    assert heavy == []
    rooms = {m.removeprefix("specdraft.") for m in loaded} - {"cli", "core", "data", "serving"}
    assert {m for m in rooms if not m.startswith("cli.")} == STARTUP_ROOMS


def test_every_other_module_imports_specdraft_at_its_top():
    late = {}
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path, SRC)
        if name.startswith("cli") or name in STARTUP_ROOMS or name in {"", "__main__"}:
            continue
        if found := function_level_imports(path):
            late[name] = found
    assert not late, f"imports inside functions (move them to the module's top): {late}"


def test_a_function_level_import_is_found(tmp_path):
    """The negative control: an import inside a nested function is found, a top-level one is not."""
    (mod := tmp_path / "m.py").write_text("from specdraft.core.io import x\n\n\ndef f():\n    def g():\n"
                                          "        from specdraft.core.stats import y\n")
    assert function_level_imports(mod) == ["6: from specdraft.core.stats import y"]
