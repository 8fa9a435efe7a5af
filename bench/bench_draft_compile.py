"""Does a static KV cache and ``torch.compile`` make the draft's one-token steps cheaper on CPU?

One-token steps of the draft after a ``--context``-token prefill (batch 1), each variant timed in turn within
every round so machine noise hits all alike (median over rounds of the mean of ``--steps`` steps):

* ``eager, dynamic cache``: what the decode loop runs today (``DynamicCache``, the model's forward as is);
* ``eager, static cache``: ``transformers.StaticCache`` (preallocated, written at ``cache_position``);
* ``compiled, static cache``: the forward through ``torch.compile`` (inductor, CPU C++ codegen), static shapes,
  so one graph serves every position; its first call (compilation) is timed separately.

Each for the bf16 draft and the cheapest lossless draft (int4 + a 32,768-row head). The compiled step's logits
are checked against the eager static step's (max |Δ| and argmax equality over the timed steps). Writes
``bench/results/draft-compile.json``.

    python bench/bench_draft_compile.py [--rounds 5 --steps 10 --context 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.core.embedded import DEFAULT_DRAFT
from specdraft.data.sources import encode_prompts, load_examples
from specdraft.decoding.calibration import machine_line
from specdraft.decoding.draft_model import default_head_corpus, frequent_tokens, prepare_draft
from specdraft.models.loading import load_model


class Stepper:
    """One-token steps of ``model`` after a prefill of ``context``, with a dynamic or a static cache, eager or
    compiled. ``run(n)`` takes n steps from the end of the context and returns their logits ``[n, V]``."""

    def __init__(self, model, context: list[int], static: bool, compiled: bool, max_len: int):
        from transformers import DynamicCache, StaticCache

        self.model, self.context, self.static, self.max_len = model, context, static, max_len
        self.make_cache = (lambda: StaticCache(config=model.config, max_cache_len=max_len)) if static else \
            (lambda: DynamicCache(config=model.config))
        self.forward = torch.compile(model.forward, dynamic=False) if compiled else model.forward
        self.compile_seconds = None
        if compiled:
            t0 = time.perf_counter()
            self.run(2)  # the first calls compile (prefill eager, then the one-token graph)
            self.compile_seconds = time.perf_counter() - t0

    @torch.no_grad()
    def run(self, n: int) -> tuple[float, torch.Tensor]:
        cache = self.make_cache()
        ids = torch.tensor([self.context])
        L = ids.shape[1]
        # The prefill runs eagerly (its shape differs from a step's): only the steps are compared.
        out = self.model(input_ids=ids, cache=cache, cache_position=torch.arange(L), use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        logits = []
        t0 = time.perf_counter()
        for i in range(n):
            out = self.forward(input_ids=tok, cache=cache, cache_position=torch.tensor([L + i]),
                               use_cache=True)
            step = out.logits[0, -1].float()
            logits.append(step)
            tok = step.argmax().view(1, 1)
        return (time.perf_counter() - t0) / n, torch.stack(logits)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="one-token steps per timing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--head-tokens", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    bf16, tok = load_model(args.draft, dtype="bfloat16", device="cpu")
    prompt = encode_prompts(tok, load_examples("humaneval", limit=1, offset=100))[0]
    context = (prompt * 4)[: args.context]
    ids = frequent_tokens(tok, n=args.head_tokens, token_lists=default_head_corpus(tok))
    drafts = {"bf16": bf16, "int4 + head": prepare_draft(bf16, "int4", head_tokens=ids)}
    max_len = args.context + args.steps + 8
    steppers, failures = {}, {}
    for dname, m in drafts.items():
        for label, static, compiled in (("eager, dynamic cache", False, False), ("eager, static cache", True, False),
                                        ("compiled, static cache", True, True)):
            name = f"{dname}: {label}"
            try:
                steppers[name] = Stepper(m, context, static, compiled, max_len)
            except Exception as e:  # noqa: BLE001 - a variant torch cannot compile is a finding, recorded
                failures[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                print(f"{name}: failed: {failures[name]}", flush=True)
            else:
                if compiled:
                    print(f"{name}: compiled in {steppers[name].compile_seconds:.1f} s", flush=True)

    samples: dict[str, list[float]] = {n: [] for n in steppers}
    logits: dict[str, torch.Tensor] = {}
    for r in range(args.rounds + 1):
        for name, s in steppers.items():
            t, lg = s.run(args.steps)
            if r:
                samples[name].append(t)
            logits[name] = lg
        if r:
            print(f"round {r}: " + ", ".join(f"{n} {v[-1] * 1e3:.1f} ms" for n, v in samples.items()), flush=True)
    step_ms = {n: sorted(v)[len(v) // 2] * 1e3 for n, v in samples.items()}
    checks = {}
    for dname in drafts:
        ref = logits.get(f"{dname}: eager, static cache")
        dyn = logits.get(f"{dname}: eager, dynamic cache")
        comp = logits.get(f"{dname}: compiled, static cache")
        if ref is not None and comp is not None:
            finite = torch.isfinite(ref)
            checks[dname] = {
                "compiled_vs_eager_static_max_abs_logit_diff": float((comp - ref)[finite].abs().max()),
                "compiled_vs_eager_static_argmax_equal": f"{int((comp.argmax(-1) == ref.argmax(-1)).sum())}/{len(ref)}",
                "static_vs_dynamic_argmax_equal": None if dyn is None else
                f"{int((dyn.argmax(-1) == ref.argmax(-1)).sum())}/{len(ref)}"}
    result = {
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"), "machine": machine_line(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "draft": args.draft, "context_tokens": len(context), "steps": args.steps, "rounds": args.rounds,
        "draft_step_ms_median": step_ms,
        "draft_step_ms_per_round": {n: [round(x * 1e3, 2) for x in v] for n, v in samples.items()},
        "compile_seconds": {n: s.compile_seconds for n, s in steppers.items() if s.compile_seconds is not None},
        "failures": failures, "checks": checks,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft-compile.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("draft_step_ms_median", "compile_seconds", "failures", "checks")},
                     indent=2))
    return result


if __name__ == "__main__":
    main()
