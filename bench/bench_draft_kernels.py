"""Per-step cost of the draft with each int8 / int4 kernel candidate, interleaved.

One-token steps of the draft after a 64-token prefill (batch 1, the decode loop's own cache code:
:func:`specdraft.decoding.calibration.pass_seconds`), each candidate timed in turn within every repeat so machine noise hits
all alike; then each candidate's teacher-forced top-1 agreement with the target (greedy α, over prompts) as a
check on what the rounding costs. Writes ``bench/results/draft-kernels.json``.

    python bench/bench_draft_kernels.py [--repeats 5] [--head-tokens 32768]

Candidates: the draft as loaded (bf16), weight-only int8 linears (``torch._weight_int8pack_mm``) and weight-only
int4 linears (``torch.ops.aten._weight_int4pack_mm_for_cpu``, groups of 32) of :mod:`specdraft.decoding.draft_model`,
torch's fbgemm dynamic int8 quantisation of the linears on a float32 copy (``torch.ao.quantization.quantize_dynamic``,
per-tensor and per-channel weight scales; deprecated in torch 2.13), optionally a plain float32 copy, and a trimmed
head (FR-Spec) on the int8 and int4 drafts. About 6 GB of memory.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdraft.data.sources import encode_prompts, load_examples
from specdraft.decoding.calibration import machine_line, pass_seconds
from specdraft.decoding.draft_model import default_head_corpus, frequent_tokens, prepare_draft
from specdraft.decoding.replay import predicted_alpha
from specdraft.models.loading import load_model


def fbgemm_dynamic(bf16_model, per_channel: bool):
    """torch's dynamic int8 quantisation of every nn.Linear (fbgemm) on a float32 copy (in place on the copy, to
    keep memory low); its deprecation warnings are silenced here and recorded in the result instead."""
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic

    qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = quantize_dynamic(copy.deepcopy(bf16_model).float(), {torch.nn.Linear: qconfig}, dtype=torch.qint8,
                             inplace=True)
    release()
    return q.eval(), sorted({str(w.category.__name__) + ": " + str(w.message).splitlines()[0] for w in caught})


def release() -> None:
    """Give freed memory back to the OS (glibc keeps freed blocks otherwise): the machine is shared."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def candidates(bf16, tok, head_tokens: int, with_float32: bool) -> dict:
    """name → a function building that candidate from the bf16 draft (built one at a time when memory matters)."""
    c = {"bf16 (as loaded)": lambda: bf16}
    if with_float32:
        c["float32 copy"] = lambda: copy.deepcopy(bf16).float()
    c["fbgemm dynamic int8, per-tensor (float32 copy)"] = lambda: fbgemm_dynamic(bf16, per_channel=False)[0]
    c["fbgemm dynamic int8, per-channel (float32 copy)"] = lambda: fbgemm_dynamic(bf16, per_channel=True)[0]
    c["int8 weight-only (_weight_int8pack_mm)"] = lambda: prepare_draft(bf16, "int8")
    c["int4 weight-only, groups of 32 (_weight_int4pack_mm_for_cpu)"] = lambda: prepare_draft(bf16, "int4")
    if head_tokens:
        ids = frequent_tokens(tok, n=head_tokens, token_lists=default_head_corpus(tok))
        c[f"int8 weight-only, head {head_tokens}"] = lambda: prepare_draft(bf16, "int8", head_tokens=ids)
        c[f"int4 weight-only, head {head_tokens}"] = lambda: prepare_draft(bf16, "int4", head_tokens=ids)
    return c


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--context", type=int, default=64, help="tokens read before the timed steps")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (10 steps of each candidate per round)")
    ap.add_argument("--head-tokens", type=int, default=32768, help="also time a trimmed head of N rows (0: skip)")
    ap.add_argument("--agreement-prompts", type=int, default=4, help="HumanEval prompts for top-1 agreement (0: skip)")
    ap.add_argument("--with-float32", action="store_true", help="also time a plain float32 copy (2 GB more)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    bf16, tok = load_model(args.draft, dtype="bfloat16", device="cpu")
    prompts = encode_prompts(tok, load_examples("humaneval", limit=max(args.agreement_prompts, 1), offset=100))
    context = (prompts[0] * 4)[: args.context]
    build = candidates(bf16, tok, args.head_tokens, args.with_float32)
    _, warned = fbgemm_dynamic(torch.nn.Sequential(torch.nn.Linear(8, 8)), per_channel=False)
    cands = {}
    for name, make in build.items():
        cands[name] = make()
        release()

    # Interleaved: every round times 10 one-token steps of each candidate.
    samples: dict[str, list[float]] = {n: [] for n in cands}
    for r in range(args.repeats + 1):
        for name, m in cands.items():
            t, _ = pass_seconds(m, context, [1], repeats=10, warmup=1, last_only=True)
            if r:  # the first round warms every candidate up
                samples[name].append(t[1])
        print(f"round {r}: " + ", ".join(f"{n} {v[-1] * 1e3:.1f} ms" for n, v in samples.items() if v), flush=True)
    step_ms = {n: sorted(v)[len(v) // 2] * 1e3 for n, v in samples.items()}
    del cands
    release()

    agreement = {}
    if args.agreement_prompts:  # one candidate in memory at a time next to the target
        target, _ = load_model(args.target, dtype="bfloat16", device="cpu")
        for name, make in build.items():
            m = make()
            a = predicted_alpha(target, m, prompts, real_vocab=len(tok), pad_id=tok.pad_token_id or 0)
            agreement[name] = a["top1_agreement"]
            print(f"{name}: top-1 agreement with the target {a['top1_agreement']:.4f} over {a['positions']} positions",
                  flush=True)
            del m
            release()
    result = {
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_line(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "draft": args.draft, "target": args.target, "context_tokens": len(context),
        "draft_step_ms_median": step_ms,
        "draft_step_ms_per_round": {n: [round(x * 1e3, 2) for x in v] for n, v in samples.items()},
        "top1_agreement_with_target": agreement,
        "agreement_positions": "teacher-forced over the prompt tokens of HumanEval 100..",
        "fbgemm_warnings": warned,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft-kernels.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("draft_step_ms_median", "top1_agreement_with_target")}, indent=2))
    return result


if __name__ == "__main__":
    main()
