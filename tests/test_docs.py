"""The README and docs/ say what the result files and src/ say: their generated parts equal what bench/run_all.py and
bench/module_map.py render now, and no text carries history (issue numbers, rounds, dates) or a machine's own
paths. Fast: no models, only the JSON under bench/results and the source files."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import doctext
import module_map
import run_all

README = ROOT / "README.md"
DOCS = ROOT / "docs"
STALE = "stale: run `python bench/run_all.py --render-only`"


def test_the_readmes_terms_are_defined_before_their_first_use():
    """A newcomer met "mapped or re-indexed" in the first bullet and their meaning paragraphs later."""
    text = README.read_text()
    terms = text.index("Terms.")
    for term in ("as given", "mapped", "re-indexed", "mapped/text"):
        first = text.index(term)
        assert terms < first < text.index("\n\n", terms), term


def test_the_main_job_table_says_which_draft_each_acceptance_column_measures():
    """Its re-indexed before/after gain read as a contradiction of the README's verdict against the draft as given."""
    lines = run_all._render_main_job()
    if run_all._load("run-default.json")["vocab_swap"]:
        assert any(x.startswith("Columns:") and "*as given*" in x and "re-indexed copy" in x for x in lines)
        assert any("| re-indexed, before distillation |" in x for x in lines)


def test_the_readme_is_at_most_10_kb_and_keeps_the_commands_ci_relies_on():
    text = README.read_text()
    assert len(text.encode()) <= 10_240, len(text.encode())
    assert "make run" in text and "make test" in text  # .ci/run calls `make test`; the main job is `make run`
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_readmes_generated_blocks_equal_what_the_result_files_render():
    text = README.read_text()
    for name in run_all.README_BLOCKS:
        start, end = run_all._block(name)
        assert text.count(start) == 1 and text.count(end) == 1, name
        assert text.split(start, 1)[1].split(end, 1)[0].strip(), f"the {name} block is empty"
    assert run_all.readme_text(text) == text, STALE


def test_the_results_table_has_one_row_per_claim_with_the_result_files_figures():
    table = run_all.render_results_table()
    rows = [r for r in table.splitlines()[2:]]
    assert len(rows) == len(run_all.results_rows()) == 6
    # figures that the result files hold, rounded as rendered
    goal16 = run_all._load("decode-greedy-goal16.json")
    assert f"{goal16['speedup_vs_target']['specdraft_int4_head_adaptive_gamma']:.2f}x [" in rows[0]
    # The main job's two contenders come from one result file, counted and timed the same way.
    run = run_all._load("run-default.json")["sets"]["held_out"]
    assert "as given" in rows[3] and f"{run['speed']['original']['speedup']:.2f}x [" in rows[3]
    assert f"{run['as_given_alpha']:.3f} per reached" in rows[3]
    assert "re-indexed + distilled" in rows[4] and f"{run['speed']['distilled']['speedup']:.2f}x [" in rows[4]
    assert rows[3].split(" | ")[1] == rows[4].split(" | ")[1]  # the same "what ran"
    assert "no draft pays in llama.cpp yet" in rows[-1]
    for word in ("met", "missed", "goal"):
        assert word not in table.lower().split(), word


def test_the_readmes_results_table_is_the_main_jobs_recommendation_from_one_result_file():
    r = run_all._load("run-default.json")
    table = run_all.render_engine_table()
    rows = [x for x in table.splitlines() if x.startswith("| ")][2:]
    assert [x.split(" | ")[0].lstrip("| ") for x in rows] == [c["label"] for c in r["recommendation"]]
    speeds = [c["speedup"] or 0.0 for c in r["recommendation"]]
    assert speeds == sorted(speeds, reverse=True)  # fastest first
    first = r["recommendation"][0]
    assert f"{first['speedup']:.2f}x [{first['speedup_ci95'][0]:.2f}, {first['speedup_ci95'][1]:.2f}]" in rows[0]
    assert f"{r['sets']['held_out']['speed']['target_tokens_per_s']:.1f} tok/s" in table
    assert run_all.render_engine_table("absent.json") == ""


def test_the_transcript_is_rendered_from_the_main_jobs_result():
    r = run_all._load("run-default.json")
    t = run_all.render_transcript()
    assert t.startswith("```text") and t.endswith("```")
    assert f"specdraft run — {r['target']} ← {r['draft']}" in t
    assert t.splitlines()[4] == "What to serve where (fastest first)"
    assert r["recommendation"][0]["command"].split("--draft ")[0] in t and "--draft runs/default/export/" in t
    for stage, seconds in r["stages"].items():
        assert f"  {stage:<12} {seconds:7.1f} s" in t
    assert run_all.render_transcript("absent.json") == ""


def test_docs_benchmarks_md_equals_what_the_result_files_render():
    text = (DOCS / "benchmarks.md").read_text()
    assert run_all.render() == text, STALE
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads[:2] == ["## Summary", "## Method"]
    assert run_all.render_results_table() in text and run_all.render_engine_table() in text


def test_the_llama_cpp_block_of_docs_serving_md_equals_its_result():
    text = (DOCS / "serving.md").read_text()
    assert run_all.serving_text(text) == text, STALE
    assert text.splitlines()[0] == "# Serving a speculator: vLLM and llama.cpp"


def test_the_module_map_in_docs_architecture_md_matches_src():
    text = (DOCS / "architecture.md").read_text()
    assert module_map.architecture_text(text) == text, "stale: run `python bench/module_map.py`"
    assert module_map.main(["--check"]) == 0
    for path in (ROOT / "src" / "specdraft").rglob("*.py"):
        name = path.name if path.name != "__init__.py" or path.parent.name == "specdraft" else path.parent.name + "/"
        assert f"| `{name}` |" in text or f"`{path.relative_to(ROOT / 'src' / 'specdraft')}`" in text, path


def test_the_module_map_names_every_module_with_its_lines_and_first_sentence(tmp_path):
    pkg = tmp_path / "specdraft"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package. More text."""\n')
    (pkg / "cli" / "__init__.py").write_text('"""The typer app: one command per stage.\n\nDetails."""\nx = 1\n')
    (pkg / "a.py").write_text('"""Counts first, e.g. accepted / proposed. Then ratios."""\n\n\ny = 2\n')
    (pkg / "b.py").write_text("z = 3\n")
    assert module_map.modules(pkg) == [("__init__.py", 1, "The package."),
                                       ("a.py", 4, "Counts first, e.g. accepted / proposed."), ("b.py", 1, "—"),
                                       ("cli/", 4, "The typer app: one command per stage.")]
    assert "4 modules, 10 lines." in module_map.render_map(pkg)


def test_every_module_over_800_lines_states_why_in_its_docstring():
    import ast

    for path in sorted((ROOT / "src" / "specdraft").rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 800:
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert "**Size.**" in doc and "800 lines" in doc, f"{path.name}: split it or say why it is one module"


# ----------------------------------------------------------------------------------------- no history, no machines

def _texts(*roots: str) -> list[Path]:
    out = []
    for root in roots:
        p = ROOT / root
        out += [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.suffix in (".py", ".md")
                                              and "__pycache__" not in x.parts)
    return out


def _hits(paths: list[Path], find) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{i}: {hit}" for p in paths for i, line in enumerate(p.read_text().splitlines(), 1)
            for hit in find(line)]


def _history(line: str) -> list[str]:
    # A result record's "date" field (a fixture shaped like bench/results/*.json) is data, not history.
    if '"date":' in line:
        return []
    return doctext.history_hits(line)


def test_the_history_patterns_find_issue_numbers_rounds_and_dates_and_not_flags():
    n, day = 21, f"{2026}-{12}-0{1}"  # built, so that this file's own scan does not find them
    assert doctext.history_hits(f"as issue {n} said; Round {n}'s road; measured {day}") == [f"issue {n}",
                                                                                           f"Round {n}", day]
    assert doctext.history_hits("--rounds 5, every round, 12 rounds of 5") == []
    assert doctext.machine_paths("run `/root/.cache/x` or /work/main/.venv/bin/python, not ~/.cache or DIR/x") == [
        "/root/.cache/x", "/work/main/.venv/bin/python"]
    assert doctext.placeholders("/work/main/.venv/bin/python bench/x.py -m /root/.cache/specdraft/gguf/t.gguf") == (
        "python bench/x.py -m ~/.cache/specdraft/gguf/t.gguf")
    assert doctext.without_history(f"a (round {n}): x, measured {day} morning; issue {n} item 4: y") == "a: x; y"
    assert doctext.without_history(f"forecast ({day}; 32 sequences)") == "forecast (32 sequences)"


@pytest.mark.parametrize("root", ["README.md", "docs", "bench", "src", "tests"])
def test_no_issue_number_round_or_date_in_code_tests_bench_or_docs(root):
    assert _hits(_texts(root), _history) == []


def test_no_machines_own_absolute_path_in_the_readme_or_docs():
    assert _hits(_texts("README.md", "docs"), doctext.machine_paths) == []


def test_every_library_name_a_doc_mentions_is_held_by_the_module_it_is_named_under():
    """docs named library functions under modules that no longer held them (a moved function left its old path in
    cli.md and serving.md); every `specdraft.module.Name` in the README and docs/, and every public name of the
    README's command table, now imports."""
    import importlib
    import re

    names = set()
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        names |= set(re.findall(r"specdraft(?:\.[a-z_]+)+\.[A-Za-z_][A-Za-z_0-9]*", path.read_text()))
    table = README.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    names |= {f"specdraft.{m}" for row in table.splitlines()[2:] for m in re.findall(r"`(\w+)`", row.split("|")[3])}
    assert len(names) > 30
    missing = []
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert not missing, f"docs name what their modules do not hold: {missing}"


def test_every_vllm_command_in_the_docs_and_src_is_the_tested_server_form():
    """docs/serving.md showed `vllm serve …` while specdraft prints, and make test-vllm runs, the server module
    (specdraft.serving.export.VLLM_SERVER): the pinned CPU build's `vllm` script cannot find its own distribution."""
    from specdraft.serving.export import VLLM_SERVER

    assert VLLM_SERVER == "python -m vllm.entrypoints.openai.api_server"
    texts = [README, *DOCS.glob("*.md"), *(ROOT / "src" / "specdraft").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
    said = [f"{p.relative_to(ROOT)}:{i}" for p in texts for i, line in enumerate(p.read_text().splitlines(), 1)
            if "vllm serve" in line]
    assert not said, said


def test_the_readme_tells_the_runs_check_stage_from_specdraft_check_on_the_embedded_pair():
    """The quickstart said "check ~5 s": the main job's check stage, which compares tokenizers and loads no model,
    while `specdraft check` without arguments loads both embedded models and continues each."""
    text = README.read_text()
    note = next(line for line in run_all._quickstart().splitlines() if line.startswith("# default preset"))
    assert "check stage ~" in note and note in text
    assert "(`check`\nloads both, 1–2 min)" in text


def test_the_committed_gpu_check_is_rendered_into_docs_benchmarks_md():
    """The README's Limits pointed at GPU results that docs/benchmarks.md (the command behind each figure) lacked."""
    r = run_all._load("gpu_check.json")
    text = (DOCS / "benchmarks.md").read_text()
    assert f"{r['device']}, torch {r['torch']}" in text
    rows = [x for x in run_all._render_gpu_check() if x.startswith("| greedy |")]
    assert len(rows) == sum(len(r[k]["gammas"]) for k in ("greedy_fp32", "greedy_bf16"))


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces → ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_into_architecture_md_names_one_of_its_headings():
    """Docstrings link their evidence as ``docs/architecture.md#specdraftcoresampling``: a section renamed or a module
    moved would leave the link pointing nowhere."""
    text = (DOCS / "architecture.md").read_text()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
    assert github_anchor("### specdraft.core.sampling".lstrip("# ")) == "specdraftcoresampling"
    sources = [*(DOCS.parent / "src").rglob("*.py"), *DOCS.glob("*.md"), README]
    links = {(p.name, a.rstrip(".")) for p in sources for a in re.findall(r"architecture\.md#([\w.-]+)", p.read_text())}
    assert len(links) >= 5
    assert [link for link in sorted(links) if link[1] not in anchors] == []


def test_the_stages_table_of_architecture_md_lists_the_pipelines_declarations_in_order():
    """The stage list is declared once (``PIPELINE``); the table a reader meets first must follow it."""
    from specdraft.run.pipeline import STAGES

    text = (DOCS / "architecture.md").read_text().split("## The stages", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", text, re.MULTILINE) == list(STAGES)
