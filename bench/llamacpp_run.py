"""llama.cpp run one prompt at a time, and what it printed read back: the invocations ``bench/llamacpp_check.py``
compares llama.cpp with specdraft by.

* :func:`completion_command` / :func:`speculative_command`: ``llama-completion`` (plain greedy decoding of the
  target) and ``llama-speculative-simple`` (``--spec-type draft-simple`` with a ``-md`` draft), flags pinned so that
  both print the same bytes for the same tokens;
* :func:`run_llama` runs one and :func:`parse_run` reads it into a :class:`LlamaRun` (output bytes, llama.cpp's own
  decode figures, the prompt's ids from ``--verbose-prompt``, the speculative counters of
  :func:`parse_speculative_simple`, each model's closing timings of :func:`parse_perf`), and
  :func:`specdraft.decoding.llama_cpp_price.alpha_from_acceptance_rate` turns its accepted / drafted into the speed model's α;
* :func:`speculative_matches_plain` / :func:`first_difference` compare two outputs; :func:`eog_tokens` and
  :func:`tool_version` ask a build what it is.

The parsers read the pinned version's output (``tests/data/llama_cpp`` holds captured runs; ``tests/test_llama_cpp.py``
reads them). Building and finding the tools, and what ``specdraft rank --engine llama.cpp`` runs, are
:mod:`specdraft.serving.llama_cpp`.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from specdraft.decoding.llama_cpp_price import alpha_from_acceptance_rate  # noqa: F401  (read from here by the bench and its tests)
from specdraft.serving.llama_cpp import LlamaCppError, LlamaCppTools, _run, _tail


@dataclass
class SpeculativeStats:
    """The statistics ``llama-speculative-simple`` prints when it finishes (pinned version).

    Attributes:
        n_input: prompt tokens (``encoded N tokens``); ``n_predict``: tokens generated (the first included).
        n_drafted: draft tokens proposed; ``n_accept``: of them accepted.
        decode_tps: the ``decoded N tokens in S seconds, speed: X t/s`` figure (tokens/s; ``None`` when absent).
    """

    n_input: int | None
    n_predict: int | None
    n_drafted: int
    n_accept: int
    decode_tps: float | None = None
    decoded: int | None = None
    decode_s: float | None = None

    @property
    def acceptance_rate(self) -> float:
        """n_accept / n_drafted (probability; 0 when nothing was drafted): what specdraft's accepted / proposed is."""
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0


def _last_int(pattern: str, text: str) -> int | None:
    found = re.findall(pattern, text)
    return int(found[-1]) if found else None


def parse_speculative_simple(text: str) -> SpeculativeStats:
    """:class:`SpeculativeStats` from ``llama-speculative-simple``'s log (stderr, prefixes stripped), e.g.::

        encoded   10 tokens in    0.009 seconds, speed: 1055.520 t/s
        decoded  47 tokens in   0.254 seconds, speed:  185.073 t/s
        n_draft   = 3
        n_predict = 48
        n_drafted = 57
        n_accept  = 28
        accept    = 49.123%

    The last occurrence of each counter is read (the statistics block is printed once, at the end).

    Raises:
        LlamaCppError: no ``n_drafted`` / ``n_accept`` in the text (the run did not finish, or drafting was off).
    """
    drafted, accepted = _last_int(r"n_drafted\s*=\s*(\d+)", text), _last_int(r"n_accept\s*=\s*(\d+)", text)
    if drafted is None or accepted is None:
        raise LlamaCppError("llama-speculative-simple printed no n_drafted / n_accept: it did not finish (see its "
                            "log) or nothing was drafted (--spec-type draft-simple missing?)")
    speed = re.findall(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s", text)
    decoded, secs, tps = (int(speed[-1][0]), float(speed[-1][1]), float(speed[-1][2])) if speed else (None,) * 3
    return SpeculativeStats(n_input=_last_int(r"encoded\s+(\d+)\s+tokens in", text),
                            n_predict=_last_int(r"n_predict\s*=\s*(\d+)", text), n_drafted=drafted,
                            n_accept=accepted, decode_tps=tps, decoded=decoded, decode_s=secs)


@dataclass
class LlamaRun:
    """One run of ``llama-completion`` or ``llama-speculative-simple`` on one prompt.

    Attributes:
        command: the argv run.
        output: what it printed as the conversation, bytes: the prompt's pieces then the generated pieces (special
            tokens as their text; the program's own framing — blank lines, ``[end of text]`` — removed), exactly as
            both programs print them, so the two compare byte for byte.
        log: its stderr (llama.cpp's log), text.
        seconds: wall time of the process, seconds.
        decode_tokens / decode_s: llama.cpp's own decode figures (``llama-completion``: the context's ``eval time``
            of its one-token steps; ``llama-speculative-simple``: ``decoded N tokens in S seconds``), tokens and
            seconds; ``None`` when not printed.
        prompt_ids: the prompt as llama.cpp tokenized it (``--verbose-prompt``, ``llama-completion`` only).
        prompt_echo: the bytes of the prompt's pieces (the start of ``output``) where known.
        speculative: :func:`parse_speculative_simple`'s counters (``llama-speculative-simple`` only).
        perf: llama.cpp's own timings by model (:func:`parse_perf`): what a refit of the speed model's calibration
            can split a round by (the target's verification passes, the draft's steps).
        returncode: the exit status; ``attempts``: runs it took (:func:`run_llama`).
    """

    command: list[str]
    output: bytes
    log: str
    seconds: float
    returncode: int
    decode_tokens: int | None = None
    decode_s: float | None = None
    prompt_ids: list[int] | None = None
    prompt_echo: bytes | None = None
    speculative: SpeculativeStats | None = None
    attempts: int = 1
    perf: dict[str, dict[str, float]] | None = None

    @property
    def complete(self) -> bool:
        """Its closing figures were printed (a speculative run's counters; a plain run's prompt and timings)."""
        if Path(self.command[0]).name == "llama-speculative-simple":
            return self.speculative is not None
        return self.prompt_ids is not None and self.decode_s is not None

    @property
    def decode_tps(self) -> float | None:
        """decode_tokens / decode_s, tokens/s."""
        return self.decode_tokens / self.decode_s if self.decode_tokens and self.decode_s else None

    @property
    def generated(self) -> bytes | None:
        """``output`` after the prompt's echo (``None`` when the echo is not known)."""
        if self.prompt_echo is None or not self.output.startswith(self.prompt_echo):
            return None
        return self.output[len(self.prompt_echo):]


def completion_command(tools: LlamaCppTools, model: str | os.PathLike, prompt: str, n_predict: int,
                       threads: int = 2, ctx_size: int = 2048, kv_type: str | None = None,
                       flash_attn: str | None = None) -> list[str]:
    """``llama-completion`` decoding ``prompt`` greedily (``--temp 0``) for ``n_predict`` tokens, ``prompt`` taken as
    given (no chat template of llama.cpp's: ``-no-cnv``; no escape processing), special tokens printed as text
    (``--special``, as ``llama-speculative-simple`` prints them) and the prompt's ids logged (``--verbose-prompt``).
    ``kv_type``: the KV cache's type (``-ctk``/``-ctv``; llama.cpp's default f16 when ``None``); ``flash_attn``:
    ``-fa on|off|auto`` (default auto, which on CPU turns it on — and its kernel rounds Q to f16)."""
    return [str(tools["llama-completion"]), "-m", str(model), "-p", prompt, "--no-escape", "-no-cnv", "--special",
            "--verbose-prompt", "-n", str(n_predict), "--temp", "0", "-t", str(threads), "-c", str(ctx_size)] + (
        ["-ctk", kv_type, "-ctv", kv_type] if kv_type else []) + (["-fa", flash_attn] if flash_attn else [])


def speculative_command(tools: LlamaCppTools, target: str | os.PathLike, draft: str | os.PathLike, prompt: str,
                        n_predict: int, n_max: int = 3, threads: int = 2, ctx_size: int = 2048,
                        p_min: float | None = None, kv_type: str | None = None,
                        flash_attn: str | None = None, n_min: int | None = None) -> list[str]:
    """``llama-speculative-simple`` with ``draft`` as its ``-md`` draft (``--spec-type draft-simple``), greedy, at most
    ``n_max`` drafts per round, the drafting flags pinned as the printed commands pin them
    (:func:`specdraft.decoding.llama_cpp_price.llama_cpp_draft_args`; ``n_min`` / ``p_min`` ``None``: what the forecasts assume,
    :data:`specdraft.decoding.llama_cpp_price.LLAMA_CPP_N_MIN` / :data:`specdraft.decoding.llama_cpp_price.LLAMA_CPP_P_MIN`); ``kv_type``: both models'
    KV cache type (``-ctk/-ctv/-ctkd/-ctvd``; f16 when ``None``);
    ``flash_attn``: ``-fa`` (see :func:`completion_command`).

    It prints from ``n_predict + 1`` to ``n_predict + n_max + 1`` tokens for ``-n n_predict`` (pinned version,
    examples/speculative-simple: it stops once more than ``n_predict`` were emitted, and a round whose budget is
    used up drafts a full ``n_max`` — the draft's limit 0 means none): compare its output with a prefix of
    ``llama-completion -n n_predict + n_max + 1`` (:func:`speculative_matches_plain`)."""
    from specdraft.decoding.llama_cpp_price import LLAMA_CPP_N_MIN, LLAMA_CPP_P_MIN, llama_cpp_draft_args

    cmd = [str(tools["llama-speculative-simple"]), "-m", str(target), "--spec-type", "draft-simple", "-md",
           str(draft), *llama_cpp_draft_args(n_max, LLAMA_CPP_N_MIN if n_min is None else n_min,
                                             LLAMA_CPP_P_MIN if p_min is None else p_min),
           "-p", prompt, "--no-escape", "-n", str(n_predict),
           "--temp", "0", "-t", str(threads), "-td", str(threads), "-c", str(ctx_size)]
    cmd += ["-fa", flash_attn] if flash_attn else []
    return cmd + (["-ctk", kv_type, "-ctv", kv_type, "-ctkd", kv_type, "-ctvd", kv_type] if kv_type else [])


_ENTRY = re.compile(r"[ \t]*(\d+) -> '")
_ENTRY_END_NEXT = re.compile(r"'\n(?=[ \t]*\d+ -> ')")
_ENTRY_END = re.compile(r"'\n")
_EVAL = re.compile(r"(?:common_perf_print|llama_perf_context_print):\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs")
# Each log line starts with the time since start and the level ("0.04.487.016 I "); continuation lines do not.
_LOG_PREFIX = re.compile(r"(?m)^\d+\.\d+\.\d+\.\d+ [A-Z] ")
END_OF_TEXT = b" [end of text]\n"


def strip_log_prefixes(log: str) -> str:
    """llama.cpp's log (stderr) without the ``0.04.487.016 I `` time-and-level prefix of each line."""
    return _LOG_PREFIX.sub("", log)


def parse_eog_tokens(log: str) -> dict[int, str]:
    """The end-of-generation tokens the model loader lists (``print_info: EOG token = 4 '<eos>'``, logged at
    verbosity 4): id → text."""
    return {int(i): t for i, t in re.findall(r"EOG token\s*=\s*(\d+) '(.*)'", strip_log_prefixes(log))}


def eog_tokens(tools: LlamaCppTools, gguf: str | os.PathLike) -> dict[int, str]:
    """llama.cpp's end-of-generation tokens of ``gguf`` (:func:`parse_eog_tokens` of a one-token
    ``llama-completion -lv 4``): what ends a generation in both programs, and what ``llama-completion --special``
    prints before ``[end of text]``.

    Raises:
        LlamaCppError: the run failed.
    """
    proc = _run([str(tools["llama-completion"]), "-m", str(gguf), "-p", "a", "-n", "1", "-no-cnv", "--temp", "0",
                 "-c", "64", "-t", "1", "-lv", "4", "--no-warmup"], errors="replace")
    if proc.returncode != 0:
        raise LlamaCppError(f"llama-completion could not load {gguf} (exit {proc.returncode}): {_tail(proc)}")
    return parse_eog_tokens(proc.stderr)


def parse_verbose_prompt(log: str) -> tuple[list[int], bytes] | None:
    """``llama-completion --verbose-prompt``'s prompt block: the ids and the bytes of their pieces (``None`` when
    absent or cut short). Read from the line ``number of tokens in prompt = N`` and the N ``id -> 'piece'`` entries
    after it; a piece may hold newlines (an entry ends at the ``'`` + newline that the next entry follows)."""
    m = re.search(r"number of tokens in prompt = (\d+)\n", log)
    if m is None:
        return None
    n, pos, ids, pieces = int(m.group(1)), m.end(), [], []
    for k in range(n):
        head = _ENTRY.match(log, pos)
        if head is None:
            return None
        nxt = _ENTRY_END_NEXT.search(log, head.end()) if k + 1 < n else _ENTRY_END.search(log, head.end())
        if nxt is None:
            return None
        ids.append(int(head.group(1)))
        pieces.append(log[head.end():nxt.start()])
        pos = nxt.start() + 2  # past the closing quote and its newline
    return ids, "".join(pieces).encode("utf-8", "surrogateescape")


_PERF = re.compile(r"(?:common_perf_print|llama_perf_context_print):\s+(prompt eval|eval|sampling) time =\s*([\d.]+) ms"
                   r"(?: /\s*(\d+) (?:tokens|runs))?")


def parse_perf(log: str) -> dict[str, dict[str, float]]:
    """llama.cpp's closing timings (``common_perf_print`` / ``llama_perf_context_print`` lines), by model: a
    ``llama-speculative-simple`` log prints the draft's under ``draft:`` and the target's under ``target:``, a
    ``llama-completion`` log the target's alone. Per model: ``prompt_eval_ms`` / ``prompt_eval_tokens`` (batched
    passes: the target's verifications, the draft's re-reading of accepted tokens), ``eval_ms`` / ``eval_runs``
    (one-token steps), ``sampling_ms``; a model whose lines were not printed (a lost log tail) is absent."""
    out: dict[str, dict[str, float]] = {}
    who = "target"
    for line in log.splitlines():
        if line.strip() in ("draft:", "target:"):
            who = line.strip()[:-1]
            continue
        m = _PERF.search(line)
        if m is None:
            continue
        key = m.group(1).replace(" ", "_")
        out.setdefault(who, {})[f"{key}_ms"] = float(m.group(2))
        if m.group(3) is not None:
            out[who][f"{key}_{'tokens' if key == 'prompt_eval' else 'runs'}"] = int(m.group(3))
    return out


def parse_run(cmd: list[str], stdout: bytes, stderr: bytes, returncode: int, seconds: float = 0.0,
              eog_pieces: tuple[bytes, ...] = ()) -> LlamaRun:
    """A :class:`LlamaRun` from what ``llama-completion`` or ``llama-speculative-simple`` (told apart by
    ``cmd[0]``'s name) printed. ``eog_pieces``: the texts of the end-of-generation tokens, removed from the end of
    ``llama-completion``'s output together with its ``[end of text]`` (``llama-speculative-simple`` prints neither)."""
    # surrogateescape: the prompt's pieces in the log are byte fragments too (byte-fallback tokens); they must
    # encode back to the very bytes of stdout.
    out, log = stdout, strip_log_prefixes(stderr.decode("utf-8", "surrogateescape"))
    run = LlamaRun(command=cmd, output=out, log=log, seconds=seconds, returncode=returncode, perf=parse_perf(log))
    if Path(cmd[0]).name == "llama-speculative-simple":
        # stdout: "\n\n", the prompt's pieces, the generated pieces, "\n\n" before the statistics and "\n\n" at exit.
        # The last may be lost (see run_llama): a lost one leaves the output shorter by a generated "\n\n" at worst.
        out = out.removeprefix(b"\n\n")
        run.output = out.removesuffix(b"\n\n\n\n") if out.endswith(b"\n\n\n\n") else out.removesuffix(b"\n\n")
        try:
            run.speculative = parse_speculative_simple(log)
            run.decode_tokens, run.decode_s = run.speculative.decoded, run.speculative.decode_s
        except LlamaCppError:
            pass
    else:
        # stdout: the prompt's pieces, the generated ones (an end-of-generation token's text and " [end of text]\n"
        # when one came), "\n\n" — printed before the timings, so present whenever they are.
        out = out.removesuffix(b"\n\n")
        if out.endswith(END_OF_TEXT):
            out = out.removesuffix(END_OF_TEXT)
            out = next((out.removesuffix(p) for p in eog_pieces if p and out.endswith(p)), out)
        run.output = out
        evals = _EVAL.findall(log)
        if evals:
            ms, runs = evals[-1]
            run.decode_tokens, run.decode_s = int(runs), float(ms) / 1e3
        prompt = parse_verbose_prompt(log)
        if prompt is not None:
            run.prompt_ids, run.prompt_echo = prompt
    return run


def run_llama(cmd: list[str], timeout_s: float = 600, eog_pieces: tuple[bytes, ...] = (),
              attempts: int = 3) -> LlamaRun:
    """Run a ``completion_command`` or ``speculative_command`` (:func:`parse_run`); returns the :class:`LlamaRun`,
    also when it failed (read ``returncode`` and ``complete``).

    llama.cpp's tools print through a logging thread that is not flushed at exit (common/log.cpp, pinned version:
    "this design may cause logs to be lost if not flushed before the program exits"); on a busy machine the end of
    a run's output is sometimes missing although it exited 0. A run whose closing figures are missing is run again,
    up to ``attempts`` times in all (``LlamaRun.attempts``). Everything before the figures went through the same
    queue before them, so a run with its figures has its whole output.
    """
    import time

    for attempt in range(1, attempts + 1):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, check=False, capture_output=True, timeout=timeout_s)
        run = parse_run(cmd, proc.stdout, proc.stderr, proc.returncode, time.perf_counter() - t0, eog_pieces)
        run.attempts = attempt
        if run.returncode != 0 or run.complete:
            return run
    return run


def speculative_matches_plain(speculative: bytes, plain: bytes) -> int | None:
    """Where a speculative run's output first differs from the plain run's (both :attr:`LlamaRun.output`, the
    plain one asked for at least as many tokens, see :func:`speculative_command`); ``None`` when it is a prefix of
    the plain output — that is, equal up to where it stopped."""
    if plain.startswith(speculative):
        return None
    return first_difference(speculative, plain)


def first_difference(a: bytes, b: bytes) -> int | None:
    """The first byte offset where ``a`` and ``b`` differ (the shorter one's length when one is a prefix of the
    other); ``None`` when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tool_version(tools: LlamaCppTools) -> str | None:
    """``llama-bench --version``'s first line (llama.cpp's build number and commit), ``None`` when it fails."""
    try:
        proc = _run([str(tools["llama-bench"]), "--version"], timeout=30)
    except (OSError, subprocess.TimeoutExpired, LlamaCppError):
        return None
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return next((ln.strip() for ln in lines if "version" in ln), lines[0].strip() if lines else None)
