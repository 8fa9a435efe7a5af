"""The shipping commands: ``export`` (write a draft as a speculator checkpoint or a llama.cpp GGUF) and ``inspect``
(read one back)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from specdraft.cli.errors import check_out
from specdraft.cli.options import (
    GGUF_TARGET_NOTE,
    SpeculatorGammaOpt,
    config_option,
    draft_option,
    dtype_option,
    out_option,
    overwrite_option,
    target_option,
)
from specdraft.cli.render import (
    console,
    print_export,
    print_gguf,
    print_inspect,
    quiet_transformers,
    resolve_with_progress,
)
from specdraft.core.config import ExportConfig, ExportDtype, ExportFormat, GgufType, speculative_tokens


def export(
    draft: str = draft_option(...),
    target: str = target_option(..., GGUF_TARGET_NOTE),
    out: Path = out_option(..., "export"),
    gamma: SpeculatorGammaOpt = None,
    overwrite: bool = overwrite_option("export"),
    dtype: ExportDtype = dtype_option(ExportConfig, "export"),
    format: ExportFormat = config_option(ExportConfig, "format"),
    # None, not f16: a --gguf-type given with --format speculator is refused, one not given is not.
    gguf_type: GgufType | None = config_option(ExportConfig, "gguf_type", default=None, show_default=False),
    llama_cpp: str | None = config_option(ExportConfig, "llama_cpp", metavar="PATH"),
    llama_quantize: str | None = config_option(ExportConfig, "llama_quantize", metavar="PATH"),
) -> None:
    """Package a draft as a speculator checkpoint or llama.cpp GGUF.

    The speculator drafts for --target (its verifier: only its config and tokenizer are read) and is written into --out,
    which must not exist or be empty (--format gguf: the .gguf file to write). A speculator: the same weights
    (byte-identical unless --dtype casts them), config.json plus three speculators_* keys naming the verifier, the
    draft's tokenizer files; prints the config diff and the vLLM commands. A draft of another tokenizer is written as
    given (its own tokenizer, drafting through text: vLLM serves it with specdraft's proposer); llama.cpp and vLLM's
    draft_model need it re-indexed first (specdraft vocab-swap). --format gguf: one GGUF written by
    llama.cpp's own converter, refused where llama.cpp would refuse the pair; unpriced (no acceptance is measured),
    it prints the rank command that forecasts the draft, the target-alone llama-server and the draft's, labelled."""
    from specdraft.serving.export import export_draft

    quiet_transformers()
    gguf = {"gguf_type": gguf_type, "llama_cpp": llama_cpp, "llama_quantize": llama_quantize}
    if format == "gguf" or any(v is not None for v in gguf.values()):
        # Refuse a misplaced flag before an embedded draft's cache is built (export_draft checks the same again).
        ExportConfig(draft=draft, verifier=target, out=out, dtype=dtype, format=format,
                     **{k: v for k, v in gguf.items() if v is not None})
    check_out(out, file=format == "gguf", overwrite=overwrite)
    resolve_with_progress(draft, "--draft")  # builds an embedded model's cache with a progress bar on first use
    res = export_draft(draft, target, out, num_speculative_tokens=speculative_tokens(gamma), overwrite=overwrite,
                       dtype=dtype, format=format, **gguf,
                       progress=lambda line: console.print(f"[dim]{escape(line)}…[/]"))
    if format == "gguf":
        print_gguf(res)
    else:
        print_export(res)


def inspect_speculator(
    speculator: Annotated[str, typer.Argument(help="Speculator directory (or any model reference).")],
) -> None:
    """Print a speculator checkpoint's metadata and serve commands.

    The verifier, γ, proposal methods, draft architecture and weight files, as a table; then the vLLM commands.
    Exits 2 when the checkpoint holds no weights."""
    from specdraft.models.loading import resolve
    from specdraft.models.speculator import load_speculator_config
    from specdraft.models.weights import weight_files

    path = Path(resolve(speculator))
    cfg = load_speculator_config(path)
    weights = weight_files(path)  # none, or a shard its index names missing: exit 2 before the serve commands
    print_inspect(path, cfg, weights)
