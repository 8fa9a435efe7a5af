"""vLLM's CPU engine serving the embedded Qwen2.5-Coder-1.5B target with SmolLM2-135M, a draft of another tokenizer:
as given (drafting through text, specdraft's ``custom_class`` proposer), re-indexed into the target's tokenizer
(vLLM's ``draft_model``), and the target alone — acceptance and tokens/s.

Run from specdraft's ``.venv``; every vLLM run starts with ``--vllm-python`` (``.venv-vllm``, see the Makefile's
test-vllm) in a fresh process, as bench/vllm_check.py does::

    nice .venv/bin/python bench/vllm_serving_bench.py --vllm-python .venv-vllm/bin/python \\
        --prompts 8 --max-new-tokens 128 --out runs/vllm-serving-bench --docs

Writes ``bench/results/vllm-serving-cpu.json`` (``--results``) and, with ``--docs``, the table between the markers
of docs/serving.md. Prompts: HumanEval's held-out rows (``humaneval:100:N``) with the target's chat template;
greedy; γ 5; the speculators are exported by ``specdraft.serving.export.export_draft`` (float32, the cache's dtype, so both
vLLM drafts compute what specdraft evaluates) and served with the settings :func:`specdraft.serving.export.vllm_serve`
prints. Timings are only meaningful on a quiet machine (no other job on its cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "smollm2-135m-instruct"
GAMMA = 5
CONFIGS = ("alone", "as-given", "re-indexed")
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
DOCS_START, DOCS_END = "<!-- vllm-serving-bench:start -->", "<!-- vllm-serving-bench:end -->"
ROOT = Path(__file__).resolve().parents[1]


def build(out: Path, n_prompts: int, kv_gib: int, as_given_distilled: Path | None = None) -> dict:
    """Export both speculators (the re-indexed draft first written by ``save_vocab_swap``), and with
    ``as_given_distilled`` that draft as given too (a draft of the draft's tokenizer, distilled as given), and encode
    the prompts."""
    from specdraft.data.prompts import load_prompts
    from specdraft.data.sources import encode_prompts
    from specdraft.models.loading import load_tokenizer, resolve
    from specdraft.models.vocab import save_vocab_swap
    from specdraft.serving.export import export_draft, vllm_serve

    target = resolve(TARGET)
    swapped = out / "draft-reindexed"
    if not (swapped / "config.json").is_file():
        save_vocab_swap(DRAFT, TARGET, swapped, overwrite=True)
    runs = {}
    drafts = [("as-given", resolve(DRAFT)), ("re-indexed", str(swapped))]
    if as_given_distilled is not None:
        drafts.append(("as-given-distilled", str(as_given_distilled)))
    for name, draft in drafts:
        res = export_draft(draft, TARGET, out / f"spec-{name}", num_speculative_tokens=GAMMA, overwrite=True)
        serve = vllm_serve(res.out)
        runs[name] = {"speculator": str(res.out), "verdict": res.compat_verdict, "drafting": serve.drafting,
                      "command": serve.command, "target": serve.target,
                      "speculative_config": serve.speculative_config, "additional_config": serve.additional_config}
    examples = load_prompts(f"humaneval:100:{n_prompts}", held_out=True)
    prompts = encode_prompts(load_tokenizer(TARGET), examples)
    return {"target": target, "runs": runs, "prompts": prompts, "prompt_ids": [e.id for e in examples],
            "kv_gib": kv_gib}


def run_vllm(plan: dict, config: str, max_new_tokens: int) -> dict:
    """One configuration in this (child) process: load, one warm-up request, then the prompts one at a time
    (batch 1, as a single user), each timed; the spec-decode counters from vLLM's metrics."""
    from vllm import LLM, SamplingParams

    engine = {"dtype": "float32", "max_model_len": 4096, "enforce_eager": True, "max_num_seqs": 1, "seed": 0,
              "disable_log_stats": False}
    t0 = time.time()
    if config == "alone":
        llm = LLM(model=plan["target"], **engine)
    else:
        run = plan["runs"][config]
        extra = {"additional_config": run["additional_config"]} if run["additional_config"] else {}
        llm = LLM(model=run["target"], speculative_config=run["speculative_config"], **engine, **extra)
    load_s = time.time() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=False)
    llm.generate([{"prompt_token_ids": plan["prompts"][0]}], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    base = _counters(llm)
    rows = []
    for ids in plan["prompts"]:
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        rows.append({"tokens": list(out.outputs[0].token_ids), "seconds": time.perf_counter() - t})
    counters = {k: v - base.get(k, 0) for k, v in _counters(llm).items()}
    emitted, seconds = sum(len(r["tokens"]) for r in rows), sum(r["seconds"] for r in rows)
    return {"config": config, "load_s": round(load_s, 1), "rows": rows, "emitted": emitted, "seconds": seconds,
            "tokens_per_s": emitted / seconds if seconds else None,
            "drafted": counters.get("vllm:spec_decode_num_draft_tokens"),
            "accepted": counters.get("vllm:spec_decode_num_accepted_tokens")}


def _counters(llm) -> dict:
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}


def table(report: dict) -> str:
    """The markdown table of docs/serving.md (generated from the results, never typed)."""
    res = report["results"]
    alone = res.get("alone", {})
    lines = [(f"{report['n_prompts']} HumanEval held-out prompts × {report['max_new_tokens']} new tokens, greedy, "
              f"γ = {GAMMA}, batch 1, float32, vLLM CPU ({report['versions'].get('cpus')} CPUs)."), "",
             "| configuration | drafting | acceptance (accepted / drafted) | tokens/s | vs target alone [95% CI, paired over prompts] | output = target alone |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for config in [c for c in (*CONFIGS, "as-given-distilled") if c in res]:
        r = res.get(config)
        if "error" in r:
            lines.append(f"| {config} | | failed | | | |")
            continue
        acc = f"{r['accepted'] / r['drafted']:.3f} ({r['accepted']}/{r['drafted']})" if r.get("drafted") else "—"
        speed = f"{r['tokens_per_s']:.2f}" if r.get("tokens_per_s") else "—"
        ratio = "—"
        if config != "alone" and alone.get("rows"):
            from specdraft.core.stats import paired_ratio_ci  # tokens/s over tokens/s, paired by prompt

            e = paired_ratio_ci([len(x["tokens"]) for x in r["rows"]], [x["seconds"] for x in r["rows"]],
                                [len(x["tokens"]) for x in alone["rows"]], [x["seconds"] for x in alone["rows"]])
            ratio = f"{e.value:.2f}× [{e.low:.2f}, {e.high:.2f}]"
        same = "—" if config == "alone" or "rows" not in alone else \
            f"{sum(a['tokens'] == b['tokens'] for a, b in zip(r['rows'], alone['rows']))}/{len(r['rows'])}"
        drafting = {"alone": "—", "as-given": "text (custom_class)", "re-indexed": "token ids (draft_model)",
                    "as-given-distilled": "text (custom_class), distilled as given"}[config]
        lines.append(f"| {config} | {drafting} | {acc} | {speed} | {ratio} | {same} |")
    return "\n".join(lines)


def write_docs(md: str) -> None:
    """The table between docs/serving.md's markers."""
    doc = ROOT / "docs/serving.md"
    head, _, rest = doc.read_text().partition(DOCS_START)
    _, _, tail = rest.partition(DOCS_END)
    doc.write_text(f"{head}{DOCS_START}\n{md}\n{DOCS_END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/vllm-serving-bench"))
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB).")
    ap.add_argument("--results", type=Path, default=ROOT / "bench/results/vllm-serving-cpu.json")
    ap.add_argument("--docs", action="store_true", help="Rewrite the table in docs/serving.md.")
    ap.add_argument("--render", action="store_true", help="Print (and with --docs write) the table of --results "
                    "again, running nothing.")
    ap.add_argument("--as-given-distilled", type=Path, default=None, metavar="DIR",
                    help="Also serve this draft of the draft's own tokenizer (a speculator distilled as given).")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"Which configurations to run, comma-separated (of {', '.join(CONFIGS)}).")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.render:
        md = table(json.loads(args.results.read_text()))
        print(md)
        if args.docs:
            write_docs(md)
        return 0
    out = args.out.absolute()
    env = os.environ | ENV | {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    if args.child:
        plan = json.loads((out / "plan.json").read_text())
        (out / f"vllm-{args.child}.json").write_text(json.dumps(run_vllm(plan, args.child, args.max_new_tokens)))
        return 0
    os.environ.update(env)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    plan = build(out, args.prompts, args.kv_gib, args.as_given_distilled)
    (out / "plan.json").write_text(json.dumps(plan))
    results = {}
    configs = args.configs.split(",") + (["as-given-distilled"] if args.as_given_distilled else [])
    for config in configs:
        log = out / f"vllm-{config}.log"
        with open(log, "w") as fh:
            rc = subprocess.run([args.vllm_python, __file__, "--out", str(out), "--child", config,
                                 "--max-new-tokens", str(args.max_new_tokens)], check=False, stdout=fh,
                                stderr=subprocess.STDOUT, env=env).returncode
        path = out / f"vllm-{config}.json"
        results[config] = json.loads(path.read_text()) if rc == 0 and path.is_file() else {"error": f"rc {rc}",
                                                                                            "log": str(log)}
        print(f"{config}: {results[config].get('error', 'done')}", flush=True)
    sys.path.insert(0, str(ROOT / "bench"))
    from vllm_check import versions

    report = {"command": " ".join(sys.argv), "target": TARGET, "draft": DRAFT, "gamma": GAMMA,
              "n_prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "prompt_ids": plan["prompt_ids"],
              "runs": plan["runs"], "results": results, "versions": versions(), "seconds": round(time.time() - t0, 1)}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=2))
    md = table(report)
    print(md)
    if args.docs:
        write_docs(md)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
