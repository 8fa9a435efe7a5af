"""Decoding benchmark: specdraft speculative vs target alone vs transformers assisted generation.

Embedded pair, batch 1, prompts interleaved (each prompt runs every contender back to back, so machine noise
hits all alike), tokens checked identical (greedy). Writes ``bench/results/decode-<mode>.json`` and prints a
markdown table; ``bench/run_all.py`` puts it into docs/benchmarks.md.

    python bench/bench_decode.py --mode greedy --num-prompts 16 --max-new-tokens 128 [--adaptive]
    python bench/bench_decode.py --mode sampled --temperature 0.7 --top-p 0.95
    python bench/bench_decode.py --draft smollm2-135m-instruct --map-vocab --gamma 3 --num-prompts 8

With ``--map-vocab`` (a draft of another tokenizer) the result goes to ``decode-<mode>-<draft>.json`` and
transformers runs its universal assisted generation (``tokenizer`` + ``assistant_tokenizer``, greedy only).

A cheaper draft: ``--variants int8 int4 head int8+head int4+head`` adds one contender per draft option
(:mod:`specdraft.decoding.draft_model`; ``head`` = the 32,768 most frequent target tokens, ``--head-tokens``), and
``--adaptive-gamma plain int4+head`` one more per listed variant with the adaptive γ policy (:mod:`specdraft.decoding.speed`).
Before decoding, the speed model is measured once: the target's t(k) for k = 1..max(γ, 8)+1 and each variant's
draft step d; every contender's ``predicted_speedup`` (at its measured α) is stored next to the measured one, with
an ``ablation`` table (c, acceptance, speed-up, prediction error per contender). ``--name`` sets the file name:

    python bench/bench_decode.py --num-prompts 8 --max-new-tokens 64 --variants int8 int4 head int8+head int4+head \
        --adaptive-gamma int4+head --name ablation                       # → decode-greedy-ablation.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.core.acceptance import AcceptanceCounts, best_gamma, expected_speedup
from specdraft.core.config import SamplingConfig
from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdraft.core.sampling import output_width
from specdraft.data.sources import encode_prompts, held_out_offset, load_examples
from specdraft.decoding.calibration import machine_line, pass_seconds
from specdraft.decoding.decode import speculative_generate, target_generate
from specdraft.decoding.draft_model import (
    TrimmedHead,
    default_head_corpus,
    frequent_tokens,
    prepare_draft,
    quantize_int4,
    quantize_int8,
)
from specdraft.decoding.speed import SpeedModel
from specdraft.measuring.evaluate import _first_difference, top2_margin
from specdraft.models.loading import load_model
from specdraft.models.tokens import left_pad

VARIANTS = ("int8", "int4", "head", "int8+head", "int4+head")


def build_variants(draft, tok, names, head_tokens: int) -> dict:
    """name → draft model. Variants with a trimmed head share every other module with their body (the plain or the
    quantised draft) instead of copying it: the machine is shared, and the head is the only part that differs."""
    bodies = {"plain": draft}
    for q in ("int8", "int4"):
        if any(n.split("+")[0] == q for n in names):
            bodies[q] = prepare_draft(draft, q)
    ids = frequent_tokens(tok, n=head_tokens, token_lists=default_head_corpus(tok)) if any(
        "head" in n for n in names) else None
    out = {}
    for n in names:
        q = n.split("+")[0] if n != "head" else "plain"
        if "head" not in n:
            out[n] = bodies[q]
            continue
        head = TrimmedHead(draft.get_output_embeddings(), ids, output_width(draft))
        if q != "plain":  # the trimmed head's projection, quantised like the body
            (quantize_int8 if q == "int8" else quantize_int4)(head)
        variant = copy.copy(bodies[q])  # shallow: shares the decoder layers and embeddings
        variant._modules = dict(variant._modules)
        variant.config = copy.deepcopy(variant.config)
        variant.config.tie_word_embeddings = False
        variant.set_output_embeddings(head)
        out[n] = variant.eval()
    gc.collect()  # give the quantisation's temporaries back to the OS: the machine is shared
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return out


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--mode", choices=["greedy", "sampled"], default="greedy")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-offset", type=int, default=None, help="prompt ids from here (default: held out; "
                    "HumanEval 100)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=5, help="draft tokens per round (γ)")
    ap.add_argument("--adaptive", action="store_true",
                    help="also run γ ≤ 10 with a draft confidence threshold of 0.4 (transformers' default style)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers assisted generation")
    ap.add_argument("--map-vocab", action="store_true", help="the draft has another tokenizer: decode through a "
                    "VocabMapping (specdraft.models.vocab.build_vocab_mapping)")
    ap.add_argument("--mapped-proposals", choices=["text", "tokens"], default=None,
                    help="with --map-vocab: the draft proposes text (greedy default) or twin tokens")
    ap.add_argument("--prompts", default="humaneval", help="embedded prompt set (humaneval, mt-bench)")
    ap.add_argument("--variants", nargs="*", default=[], choices=VARIANTS,
                    help="also decode with these cheaper drafts (one contender each)")
    ap.add_argument("--adaptive-gamma", nargs="*", default=[], choices=("plain", *VARIANTS),
                    help="also decode with these drafts and the adaptive γ policy")
    ap.add_argument("--head-tokens", type=int, default=32768, help="rows kept by the 'head' variants (FR-Spec)")
    ap.add_argument("--name", default=None, help="result file decode-<mode>-<name>.json")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    if args.map_vocab and any("head" in v for v in args.variants + args.adaptive_gamma):
        ap.error("a trimmed head keeps target tokens: it needs a draft of the target's tokenizer (not --map-vocab)")
    if args.prompt_offset is None:
        args.prompt_offset = held_out_offset(args.prompts)

    torch.set_num_threads(args.threads)
    sampling = SamplingConfig() if args.mode == "greedy" else SamplingConfig(temperature=args.temperature,
                                                                            top_p=args.top_p)
    mapping = None
    if args.map_vocab:
        from specdraft.models.vocab import build_vocab_mapping

        mapping = build_vocab_mapping(args.target, args.draft)
        args.no_hf = args.no_hf or not sampling.greedy  # sampled USD prunes the draft's head in place
    target, tok = load_model(args.target, dtype=args.dtype, device="cpu")
    draft, dtok = load_model(args.draft, dtype=args.dtype, device="cpu")
    hf_tokenizers = {"tokenizer": tok, "assistant_tokenizer": dtok} if mapping is not None else {}
    examples = load_examples(args.prompts, limit=args.num_prompts, offset=args.prompt_offset)
    prompts = encode_prompts(tok, examples)
    common = {"max_new_tokens": args.max_new_tokens, "real_vocab": len(tok), "sampling": sampling}

    # Warm-up (allocator, kernels) on a short prompt, not timed.
    w_ids, w_mask = left_pad([prompts[0][:32]], tok.pad_token_id)
    speculative_generate(target, draft, w_ids, w_mask, num_speculative_tokens=4, max_new_tokens=8,
                         real_vocab=len(tok), vocab_mapping=mapping)

    # The cheaper drafts and the speed model: t(k) of the target once, d of every draft, on the median prompt.
    drafts = build_variants(draft, tok, sorted(set(args.variants) | set(args.adaptive_gamma) - {"plain"}),
                            args.head_tokens)
    drafts["plain"] = draft
    calib = sorted(prompts, key=len)[len(prompts) // 2]
    max_k = max(args.gamma, 8) + 1
    t_k, t_prefill = pass_seconds(target, calib, range(1, max_k + 1), repeats=3)
    speed = {}
    d_calib = mapping.reencode_batch_for_draft([calib])[0] if mapping is not None else calib
    for v, m in drafts.items():
        d, d_prefill = pass_seconds(m, d_calib, [1], repeats=5, last_only=True)
        speed[v] = SpeedModel.from_measurements(t_k, d[1], target_prefill_s=t_prefill, draft_prefill_s=d_prefill,
                                                context=len(calib))
        print(f"speed model {v}: d = {d[1] * 1e3:.1f} ms, t(1) = {t_k[1] * 1e3:.1f} ms, t({args.gamma + 1}) = "
              f"{t_k[args.gamma + 1] * 1e3:.1f} ms, c = {speed[v].cost_ratio:.3f}", flush=True)
    # contender name → (draft variant, adaptive γ?)
    spec_runs = {"specdraft": ("plain", False)}
    spec_runs |= {f"specdraft_{v.replace('+', '_')}": (v, False) for v in args.variants}
    spec_runs |= {("specdraft" if v == "plain" else f"specdraft_{v.replace('+', '_')}") + "_adaptive_gamma": (v, True)
                  for v in args.adaptive_gamma}

    names = ["target", *spec_runs, "specdraft_adaptive", "hf_assisted"]
    if args.no_hf:
        names.remove("hf_assisted")
    if not args.adaptive:
        names.remove("specdraft_adaptive")
    tokens = {n: 0 for n in names}
    seconds = {n: 0.0 for n in names}
    matches = {n: 0 for n in names}
    counts = {n: AcceptanceCounts(args.gamma) for n in spec_runs}
    adaptive_counts = AcceptanceCounts(10)
    target_counts = AcceptanceCounts(1)
    per_prompt = []
    for k, (ex, ids) in enumerate(zip(examples, prompts)):
        inp, mask = left_pad([ids], tok.pad_token_id)
        row = {"id": ex.id}
        g = lambda k=k: torch.Generator().manual_seed(1000 + k)
        base, bc = target_generate(target, inp, mask, generator=g(), **common)
        target_counts = target_counts.merge(bc)
        outs = {"target": (base[0], bc.time_total)}
        for n, (v, adaptive) in spec_runs.items():
            spec, sc = speculative_generate(target, drafts[v], inp, mask, num_speculative_tokens=args.gamma,
                                            generator=g(), vocab_mapping=mapping,
                                            mapped_proposals=args.mapped_proposals,
                                            speed_model=speed[v] if adaptive else None, **common)
            counts[n] = counts[n].merge(sc)
            outs[n] = (spec[0], sc.time_total)
        if "specdraft_adaptive" in names:
            ad, ac = speculative_generate(target, draft, inp, mask, num_speculative_tokens=10,
                                          draft_confidence_threshold=0.4, generator=g(), vocab_mapping=mapping,
                                          **common)
            adaptive_counts = adaptive_counts.merge(ac)
            outs["specdraft_adaptive"] = (ad[0], ac.time_total)
        if "hf_assisted" in names:
            t0 = time.perf_counter()
            with torch.no_grad():
                hf = target.generate(input_ids=inp, attention_mask=mask, assistant_model=draft,
                                     max_new_tokens=args.max_new_tokens, do_sample=not sampling.greedy,
                                     temperature=sampling.temperature if not sampling.greedy else None,
                                     top_p=sampling.top_p if not sampling.greedy else None, top_k=None,
                                     pad_token_id=tok.pad_token_id, **hf_tokenizers)
            outs["hf_assisted"] = (hf[0, inp.shape[1]:].tolist(), time.perf_counter() - t0)
        for n, (out, s) in outs.items():
            tokens[n] += len(out)
            seconds[n] += s
            matches[n] += out == base[0]
            row[n] = {"tokens": len(out), "seconds": round(s, 3), "tokens_per_s": round(len(out) / s, 3),
                      "matches_target": out == base[0]}
            pos = _first_difference(base[0], out) if sampling.greedy else None
            if pos is not None and pos < min(len(base[0]), len(out)):
                # As specdraft eval does: the target's top-2 logit margin there tells a bf16 near-tie from a bug.
                row[n]["first_difference"] = {"position": pos, "target_token": base[0][pos], "token": out[pos],
                                              "target_top2_margin": top2_margin(target, list(ids) + base[0][:pos])}
        per_prompt.append(row)
        print(f"[{k + 1}/{len(prompts)}] {ex.id} " + "  ".join(
            f"{n}={row[n]['tokens_per_s']:.2f}" for n in names), flush=True)

    tps = {n: tokens[n] / seconds[n] for n in names}
    spec_counts = counts["specdraft"]
    target_pass = target_counts.time_target / max(target_counts.target_calls, 1)
    c = spec_counts.time_draft / max(spec_counts.draft_calls, 1) / target_pass
    ablation = {}
    for n, (v, adaptive) in spec_runs.items():
        k = counts[n]
        measured = tps[n] / tps["target"]
        # The speed model's prediction at the contender's measured α (prefill included). The adaptive policy varies
        # k per round, so its prediction uses the mean proposals per round as γ (rounded).
        g_used = args.gamma if not adaptive else max(0, round(sum(k.proposed) / max(k.rounds, 1)))
        predicted = speed[v].predict(k.alpha, g_used, tokens[n], len(prompts)) if g_used else None
        ablation[n] = {
            "draft": v, "gamma_policy": "adaptive" if adaptive else "fixed",
            "draft_step_ms": 1e3 * k.time_draft / max(k.draft_calls, 1),
            "cost_ratio_c": k.time_draft / max(k.draft_calls, 1) / target_pass,
            "cost_ratio_c_speed_model": speed[v].cost_ratio,
            "acceptance_rate": k.acceptance_rate, "alpha": k.alpha, "mean_accepted_length": k.mean_accepted_length,
            "proposed_per_round": sum(k.proposed) / max(k.rounds, 1),
            "speedup_vs_target": measured,
            "predicted_speedup": predicted,
            "prediction_error": predicted / measured - 1 if predicted else None,
            "best_gamma_speed_model": speed[v].best_gamma(k.alpha)[0],
            "identical_to_target": f"{matches[n]}/{len(prompts)}",
        }
        print(f"{n}: {measured:.2f}x measured, predicted {predicted or float('nan'):.2f}x, acceptance "
              f"{k.acceptance_rate:.3f}, c {ablation[n]['cost_ratio_c']:.3f}", flush=True)
    # α for the analytic model = accepted / reached (per-token acceptance probability, Leviathan et al. §3.3).
    alpha = spec_counts.alpha
    bound = expected_speedup(alpha, args.gamma, c)
    g_best, bound_best = best_gamma(alpha, c)
    result = {
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_line() + f", {platform.processor() or 'cpu'}",
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "python": platform.python_version()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tokens_per_s": tps,
        "speedup_vs_target": {n: tps[n] / tps["target"] for n in names},
        "speedup_vs_hf_assisted": ({n: tps[n] / tps["hf_assisted"] for n in names}
                                   if "hf_assisted" in names else None),
        "identical_to_target": {n: f"{matches[n]}/{len(prompts)}" for n in names},
        "acceptance_rate": spec_counts.acceptance_rate,
        "alpha": alpha,
        "mean_accepted_length": spec_counts.mean_accepted_length,
        "cost_ratio_c": c,
        "analytic_speedup": bound,
        "share_of_bound": (tps["specdraft"] / tps["target"]) / bound,
        "best_gamma": g_best,
        "analytic_speedup_best_gamma": bound_best,
        # The speed model (measured t(k) and d; specdraft.decoding.speed) for the plain draft at its measured α.
        "predicted_speedup": ablation["specdraft"]["predicted_speedup"],
        "prediction_error": ablation["specdraft"]["prediction_error"],
        "speed_models": {v: m.to_dict() for v, m in speed.items()},
        "ablation": ablation,
        "vocab_mapping": mapping.to_dict() if mapping is not None else None,
        "counts": {**{n: k.to_dict() for n, k in counts.items()}, "target": target_counts.to_dict(),
                   **({"specdraft_adaptive": adaptive_counts.to_dict()} if "specdraft_adaptive" in names else {})},
        "per_prompt": per_prompt,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.draft}" + (f"-{args.mapped_proposals}" if args.mapped_proposals else "") if mapping else ""
    suffix += f"-{args.name}" if args.name else ""
    path = args.out / f"decode-{args.mode}{suffix}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "per_prompt"}, indent=2))
    return result


if __name__ == "__main__":
    main()
