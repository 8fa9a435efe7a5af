"""docs/architecture.md's module map, generated from ``src/specdraft``: every module (and package) with its line
count and the first sentence of its docstring, so the map cannot drift from the code.

    python bench/module_map.py           # rewrite the map in docs/architecture.md
    python bench/module_map.py --check   # exit 1 when docs/architecture.md's map differs from src/

``tests/test_docs.py`` runs the check; ``bench/run_all.py --render-only`` rewrites it with the other docs.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "specdraft"
DOC = ROOT / "docs" / "architecture.md"
START, END = "<!-- module-map:start -->", "<!-- module-map:end -->"


def first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph, on one line (``—`` without a docstring)."""
    if not doc:
        return "—"
    para = " ".join(doc.strip().split("\n\n", 1)[0].split())
    m = re.search(r"(?<!\bal)(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.(\s|$)", para)
    return (para[:m.start() + 1] if m else para).replace("|", "\\|")


def modules(src: Path = SRC) -> list[tuple[str, int, str]]:
    """``[(name, lines, first sentence), …]`` for every ``.py`` file under ``src``, a package's ``__init__.py`` named
    by its directory (``cli/``), in path order."""
    out = []
    for path in sorted(src.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(src)
        name = (str(rel.parent) + "/" if rel.name == "__init__.py" and rel.parent != Path(".")
                else "__init__.py" if rel.name == "__init__.py" else str(rel))
        text = path.read_text()
        out.append((name, len(text.splitlines()), first_sentence(ast.get_docstring(ast.parse(text)))))
    return out


def render_map(src: Path = SRC) -> str:
    mods = modules(src)
    rows = [f"| `{n}` | {lines:,} | {what} |" for n, lines, what in mods]
    total = sum(x[1] for x in mods)
    return "\n".join(["| module | lines | what it holds (its docstring's first sentence) |", "| --- | ---: | --- |",
                      *rows, "", f"{len(mods)} modules, {total:,} lines. Regenerate with `python bench/module_map.py`."])


def architecture_text(text: str, src: Path = SRC) -> str:
    """``text`` (docs/architecture.md) with its module map re-rendered from ``src``."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render_map(src)}\n{END}{tail}"


def write_architecture(doc: Path = DOC) -> None:
    doc.write_text(architecture_text(doc.read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="Only compare; exit 1 when the map is stale.")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    if args.check:
        stale = architecture_text(text) != text
        print(f"{DOC.name}: module map {'stale: run python bench/module_map.py' if stale else 'up to date'}")
        return int(stale)
    write_architecture()
    print(f"wrote the module map of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
