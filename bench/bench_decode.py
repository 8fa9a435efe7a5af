"""Decoding benchmark: specdraft speculative vs target alone vs transformers assisted generation.

Embedded pair, batch 1, prompts interleaved (each prompt runs every contender back to back, so machine noise
hits all alike), tokens checked identical (greedy). Writes ``bench/results/decode-<mode>.json`` and prints a
markdown table; ``bench/run_all.py`` puts it into docs/benchmarks.md.

    python bench/bench_decode.py --mode greedy --num-prompts 16 --max-new-tokens 128 [--adaptive]
    python bench/bench_decode.py --mode sampled --temperature 0.7 --top-p 0.95
    python bench/bench_decode.py --draft smollm2-135m-instruct --map-vocab --gamma 3 --num-prompts 8

With ``--map-vocab`` (a draft of another tokenizer) the result goes to ``decode-<mode>-<draft>.json`` and
transformers runs its universal assisted generation (``tokenizer`` + ``assistant_tokenizer``, greedy only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

# Before torch loads OpenMP: threads that spin while waiting turn a busy shared machine into a pathology (one draft
# step measured 1.55 s with 2 spinning threads while other processes held a core, 87 ms with passive waiting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from specdraft.acceptance import AcceptanceCounts, best_gamma, expected_speedup
from specdraft.config import SamplingConfig
from specdraft.data import encode_prompts, load_examples
from specdraft.decode import left_pad, speculative_generate, target_generate
from specdraft.models import DEFAULT_DRAFT, DEFAULT_TARGET, load_model


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--mode", choices=["greedy", "sampled"], default="greedy")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-offset", type=int, default=100, help="HumanEval ids from here (held out)")
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
                    "VocabMapping (specdraft.vocab.build_vocab_mapping)")
    ap.add_argument("--mapped-proposals", choices=["text", "tokens"], default=None,
                    help="with --map-vocab: the draft proposes text (greedy default) or twin tokens")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    sampling = SamplingConfig() if args.mode == "greedy" else SamplingConfig(temperature=args.temperature,
                                                                            top_p=args.top_p)
    mapping = None
    if args.map_vocab:
        from specdraft.vocab import build_vocab_mapping

        mapping = build_vocab_mapping(args.target, args.draft)
        args.no_hf = args.no_hf or not sampling.greedy  # sampled USD prunes the draft's head in place
    target, tok = load_model(args.target, dtype=args.dtype, device="cpu")
    draft, dtok = load_model(args.draft, dtype=args.dtype, device="cpu")
    hf_tokenizers = {"tokenizer": tok, "assistant_tokenizer": dtok} if mapping is not None else {}
    examples = load_examples("humaneval", limit=args.num_prompts, offset=args.prompt_offset)
    prompts = encode_prompts(tok, examples)
    common = {"max_new_tokens": args.max_new_tokens, "real_vocab": len(tok), "sampling": sampling}

    # Warm-up (allocator, kernels) on a short prompt, not timed.
    w_ids, w_mask = left_pad([prompts[0][:32]], tok.pad_token_id)
    speculative_generate(target, draft, w_ids, w_mask, num_speculative_tokens=4, max_new_tokens=8,
                         real_vocab=len(tok), vocab_mapping=mapping)

    names = ["target", "specdraft", "specdraft_adaptive", "hf_assisted"]
    if args.no_hf:
        names.remove("hf_assisted")
    if not args.adaptive:
        names.remove("specdraft_adaptive")
    tokens = {n: 0 for n in names}
    seconds = {n: 0.0 for n in names}
    matches = {n: 0 for n in names}
    spec_counts = AcceptanceCounts(args.gamma)
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
        spec, sc = speculative_generate(target, draft, inp, mask, num_speculative_tokens=args.gamma,
                                        generator=g(), vocab_mapping=mapping,
                                        mapped_proposals=args.mapped_proposals, **common)
        spec_counts = spec_counts.merge(sc)
        outs["specdraft"] = (spec[0], sc.time_total)
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
        per_prompt.append(row)
        print(f"[{k + 1}/{len(prompts)}] {ex.id} " + "  ".join(
            f"{n}={row[n]['tokens_per_s']:.2f}" for n in names), flush=True)

    tps = {n: tokens[n] / seconds[n] for n in names}
    draft_step = spec_counts.time_draft / max(spec_counts.draft_calls, 1)
    target_pass = target_counts.time_target / max(target_counts.target_calls, 1)
    c = draft_step / target_pass
    # α for the analytic model = accepted / reached (per-token acceptance probability, Leviathan et al. §3.3).
    alpha = spec_counts.alpha
    bound = expected_speedup(alpha, args.gamma, c)
    g_best, bound_best = best_gamma(alpha, c)
    result = {
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {platform.processor() or 'cpu'}",
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
        "vocab_mapping": mapping.to_dict() if mapping is not None else None,
        "counts": {"specdraft": spec_counts.to_dict(), "target": target_counts.to_dict(),
                   **({"specdraft_adaptive": adaptive_counts.to_dict()} if "specdraft_adaptive" in names else {})},
        "per_prompt": per_prompt,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.draft}" + (f"-{args.mapped_proposals}" if args.mapped_proposals else "") if mapping else ""
    path = args.out / f"decode-{args.mode}{suffix}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "per_prompt"}, indent=2))
    return result


if __name__ == "__main__":
    main()
