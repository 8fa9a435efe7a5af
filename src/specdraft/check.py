"""``specdraft check``: both models' facts, the tokenizer comparison, a greedy continuation from each."""

from __future__ import annotations

from typing import Any


def model_facts(model, tokenizer) -> dict[str, Any]:
    """Parameters, dtype, architecture and vocabulary sizes of a loaded model."""
    cfg = model.config
    return {
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "model_type": cfg.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "config_vocab_size": cfg.vocab_size,
        "tokenizer_len": len(tokenizer),
        "layers": getattr(cfg, "num_hidden_layers", None),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "tie_word_embeddings": getattr(cfg, "tie_word_embeddings", None),
    }


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """``max_new_tokens`` greedy tokens after ``prompt`` rendered with the chat template (if any)."""
    import torch

    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    enc = {k: v.to(model.device) for k, v in enc.items()}
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def run_check(target_path: str, draft_path: str, prompt: str, max_new_tokens: int = 16, dtype: str = "auto",
              target_name: str | None = None, draft_name: str | None = None, console=None) -> dict[str, Any]:
    """Compare tokenizers (before loading weights), then load both models and continue ``prompt`` greedily.

    Returns:
        ``{"target": facts, "draft": facts, "compat": CompatReport dict, "continuations": {...}}``.
        On a tokenizer ``mismatch`` the models are not loaded (``facts`` hold only tokenizer figures).
    """
    from rich.table import Table

    from specdraft.compat import check_compatible, print_report
    from specdraft.models import load_model

    report: dict[str, Any] = {"target_ref": target_name or target_path, "draft_ref": draft_name or draft_path}
    compat = check_compatible(target_path, draft_path)
    report["compat"] = compat.to_dict()
    if console is not None:
        print_report(compat, console)
    if compat.verdict == "mismatch":
        return report
    facts, conts = {}, {}
    for role, path in (("target", target_path), ("draft", draft_path)):
        model, tok = load_model(path, dtype=dtype)
        facts[role] = model_facts(model, tok)
        conts[role] = greedy_continuation(model, tok, prompt, max_new_tokens)
        del model
    report.update(facts)
    report["prompt"] = prompt
    report["continuations"] = conts
    if console is not None:
        table = Table(title="Models")
        table.add_column("")
        table.add_column(f"target: {report['target_ref']}")
        table.add_column(f"draft: {report['draft_ref']}")
        for k in facts["target"]:
            fmt = (lambda v: f"{v / 1e6:,.1f} M") if k == "parameters" else str
            table.add_row(k, fmt(facts["target"][k]), fmt(facts["draft"][k]))
        console.print(table)
        console.print(f"[bold]Prompt:[/] {prompt}")
        for role in ("target", "draft"):
            console.print(f"[bold]{role} ({max_new_tokens} greedy tokens):[/] {conts[role]!r}")
    return report
