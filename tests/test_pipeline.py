"""The main job: every stage on tiny models, resume after an interrupted stage, and the real pair (ci preset)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest

from specdraft.data.prompts import load_prompts, parse_source
from specdraft.data.sources import Example
from specdraft.run.pipeline import estimate_dump_bytes, make_config, prompt_overlap, run_pipeline
from specdraft.run.runner import PipelineError
from specdraft.testing import add_default_system_turn, patch_everywhere, save_tiny_pair


def _examples(words, prefix):
    return [Example(f"{prefix}-{w}", [{"role": "user", "content": f"a b {w}"}]) for w in words]


def test_parse_source_and_overlap():
    assert parse_source("humaneval:100:4") == ("humaneval", 100, 4, 1)
    assert parse_source("mt-bench:3") == ("mt-bench", 3, None, 1)
    assert parse_source("conversations") == ("conversations", 0, None, 1)
    assert parse_source("mt-bench:0:27:3") == ("mt-bench", 0, 27, 3)

    spread = load_prompts(["mt-bench:0:27:3"])
    assert len(spread) == 27 and len({e.meta["category"] for e in spread}) == 8
    assert len(load_prompts(["conversations"], unique=True)) == len(
        {json.dumps(e.prompt_messages) for e in load_prompts(["conversations"])})
    train, ev = _examples("cdef", "t"), _examples("efgh", "e")
    assert prompt_overlap(train, ev) == ["e-e", "e-f"]


def test_tiny_pipeline_runs_every_stage_and_resumes(tmp_path, monkeypatch):
    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    cfg = make_config("tiny", target=tdir, draft=ddir)
    train, ev, ood = _examples("cdefghij", "t"), _examples("klm", "e"), _examples("nop", "o")
    out = tmp_path / "run"

    import specdraft.training.distill as distill_mod

    real = distill_mod.run_distill
    calls = {"n": 0}

    def flaky(*a, **k):  # the first distill attempt dies (as a killed run would)
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    patch_everywhere(monkeypatch, distill_mod, "run_distill", flaky)
    with pytest.raises(PipelineError) as e:
        run_pipeline(cfg, out, command="specdraft run --out X", eval_examples=ev, train_examples=train,
                     ood_examples=ood)
    assert "stage 'distill' failed" in str(e.value) and "specdraft run --out X" in str(e.value)
    for stage in ("check", "eval_before", "dump"):
        assert (out / stage / "stage.json").is_file()
    assert not (out / "distill" / "stage.json").exists()

    logs = []
    report = run_pipeline(cfg, out, log=logs.append, eval_examples=ev, train_examples=train, ood_examples=ood)
    assert report["eval_after"]["sets"]["ood"]["prompts"] == 3 and "out-of-domain" in (out / "report.md").read_text()
    assert any("[dump] done earlier" in m for m in logs) and any("[check] done earlier" in m for m in logs)
    assert report["timings"]["dump"]["skipped"] and not report["timings"]["distill"]["skipped"]
    assert report["speed"]["lossless"] and report["speed"]["prompts"] == 3
    held = report["eval_before"]["sets"]["held_out"]
    assert held["prompts"] == 3 and held["method"] == "replayed"
    # The answers are written by the target alone, the set's prompts in one batch, and are its own greedy answers
    # decoded one at a time (float32: exact); the counts are the draft's as given, replayed at fixed γ.
    assert held["decoder_label"] == "the target alone, one batch of 3 rows" and held["replay_check"] is None
    assert held["decoded_tokens"] == sum(map(len, held["answers"])) and held["decode_seconds"] > 0
    import torch

    from specdraft.data.sources import encode_prompts
    from specdraft.decoding.decode import target_generate
    from specdraft.measuring.evaluate import eos_ids
    from specdraft.models.loading import load_model
    from specdraft.testing import replay_greedy

    target, ttok = load_model(tdir, dtype="float32")
    prompts = encode_prompts(ttok, ev)
    for ids, ans in zip(prompts, held["answers"], strict=True):
        base, _ = target_generate(target, torch.tensor([ids]), max_new_tokens=8, eos_token_id=eos_ids(target),
                                  real_vocab=len(ttok))
        assert ans == base[0]
    draft = load_model(ddir, dtype="float32")[0]
    replayed = replay_greedy(draft, prompts, held["answers"], 3, 8, eos_ids(target), real_vocab=len(ttok))
    assert [r["accepted"] for r in held["rows"]] == [sum(c.accepted) for c in replayed]
    assert report["eval_after"]["sets"]["held_out"]["method"] == "replayed"
    assert set(report["speed"]["contenders"]) == {"target", "speculative:original", "speculative:distilled"}
    spec = out / "export" / "speculator"
    conf = json.loads((spec / "config.json").read_text())
    assert conf["speculators_config"]["verifier"]["name_or_path"] == tdir
    # The token ranking beside the export is counted over the dump's target-written answers (the tokens after each
    # trained position) and the embedded training prompts.
    from specdraft.decoding.draft_model import default_head_corpus, rank_tokens
    from specdraft.models.dump_reader import TeacherDataset
    from specdraft.models.loading import load_tokenizer

    saved_rank = json.loads((spec / "head_tokens.json").read_text())["ranked_token_ids"]
    dump, tok = TeacherDataset(out / "dump"), load_tokenizer(tdir)
    answers = [[int(x["input_ids"][j + 1]) for j in range(len(x["input_ids"]) - 1) if x["loss_mask"][j]]
               for x in map(dump.tokens, range(len(dump)))]
    assert sum(map(len, answers)) > 0
    assert saved_rank == rank_tokens(tok, token_lists=answers + default_head_corpus(tok))
    assert saved_rank != rank_tokens(tok, token_lists=default_head_corpus(tok))  # the answers counted
    assert report["export"]["head_tokens_file"] == str((spec / "head_tokens.json").resolve())
    md = (out / "report.md").read_text()
    assert "before distillation" in md and "vllm.entrypoints.openai.api_server --model" in md
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / "report.json").read_text())
    after = lambda r: r["eval_after"]["sets"]["held_out"]["acceptance_rate"]
    before = lambda r: r["eval_before"]["sets"]["held_out"]["acceptance_rate"]
    assert after(saved) == after(report)
    # Statistics and the learning curve reach the report: the paired gain over the same 3 prompts, and
    # held-out α from step 0 to the last step.
    # One table per section, under its title (not the title repeated in every row).
    assert "acceptance, fixed γ 3**\n\n| measure | before distillation | after distillation |" in md
    assert "| gain per proposed (paired) | — | " in md and "| accepted, per proposed | " in md
    assert "fixed γ 3] " not in md
    assert "Intervals in brackets are 95% bootstrap CIs over prompts" in md
    # The page leads with the answers; every held-out set is timed (out-of-domain too) with the configuration named.
    assert md.index("**Can these two work together?** yes") < md.index("| measure |")
    for q in ("How much faster will it be?", "Can the draft agree more?", "Is it lossless on this pair?",
              "Can I ship it?"):
        assert f"**{q}**" in md, q
    assert report["speed"]["other_sets"]["ood"]["prompts"] == 3 and report["speed"]["other_sets"]["ood"]["lossless"]
    assert "out-of-domain set, 3 prompts: speed, interleaved" in md and "adaptive γ ≤ 3" in md
    assert report["speed"]["draft_configuration"]["original"]["requested"] == "auto"
    gain = saved["acceptance_gain"]["held_out"]
    assert gain["prompts"] == 3 and gain["ci"][0] <= gain["value"] <= gain["ci"][1]
    assert gain["value"] == pytest.approx(after(saved) - before(saved))
    onp = report["distill"]["on_policy"]  # the tiny preset trains half on the draft's own answers
    assert onp["sequences"] == 3 and onp["refresh_steps"] == [0, 2] and onp["teacher_seconds"] > 0
    assert "On-policy: λ = 0.5" in md
    # The forecast ran before the dump, on the 3 held-out answers, and is printed beside the measured gain.
    head = report["headroom"]
    assert head["sequences"] == 3 and head["positions"] == sum(
        len(a) for a in report["eval_before"]["sets"]["held_out"]["answers"])
    assert 1 - head["greedy"] == pytest.approx(head["greedy_learnable"] + head["greedy_uncertain"])
    assert head["verdict"] in md and (out / "headroom" / "report.json").is_file()
    assert list(report["timings"]).index("headroom") < list(report["timings"]).index("dump")
    curve = report["distill"]["curve"]
    assert [p["step"] for p in curve] == [0, cfg.distill.max_steps] and 0 <= curve[-1]["eval_alpha"] <= 1
    # A third run does nothing but the report.
    logs.clear()
    run_pipeline(cfg, out, log=logs.append, eval_examples=ev, train_examples=train, ood_examples=ood)
    assert sum("done earlier" in m for m in logs) == 8


def test_overlap_refused_when_asked(tmp_path):
    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    cfg = make_config("tiny", target=tdir, draft=ddir, refuse_overlap=True)
    with pytest.raises(PipelineError, match="also occur"):
        run_pipeline(cfg, tmp_path / "run", eval_examples=_examples("cd", "e"), train_examples=_examples("cx", "t"))


@pytest.mark.real
def test_real_pair_pipeline_ci_preset(tmp_path):
    cfg = make_config("ci")
    report = run_pipeline(cfg, tmp_path / "run")
    assert report["check"]["verdict"] == "identical"
    assert report["speed"]["lossless"]
    assert report["dump"]["sequences"] == 3
    assert report["distill"]["steps"] == 2
    assert report["eval_before"]["sets"]["held_out"]["acceptance_rate"] > 0.3
    assert (tmp_path / "run" / "export" / "speculator" / "model.safetensors").is_file()


def test_run_cli_on_tiny_pair(tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    train, ev = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"a b {w}"}) + "\n" for w in "cdefghij"))
    ev.write_text("".join(json.dumps({"prompt": f"a b {w}"}) + "\n" for w in "klm"))
    args = ["run", "--target", tdir, "--draft", ddir, "--train-prompts", str(train), "--eval-prompts", f"{ev}",
            "--preset", "tiny", "--out", str(tmp_path / "run")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "vllm.entrypoints.openai.api_server --model" in r.output and (tmp_path / "run" / "report.md").is_file()
    r2 = CliRunner().invoke(app, args)
    assert r2.exit_code == 0 and r2.output.count("with the same inputs") == 8
    # A resumed run's report names its own time and the stages' recorded total (not a misleading "0.0 min").
    assert "every stage's own time sums to" in (tmp_path / "run" / "report.md").read_text()
    bad = CliRunner().invoke(app, [*args[:-2], "--out", str(tmp_path / "run2"), "--preset", "nope"])
    assert bad.exit_code != 0 and "--preset" in bad.output


def _pair_of_two_tokenizers(root, target_layers: int, draft_writes_text: bool = False):
    """A tiny target (300-token BPE) and a one-layer draft of another BPE (360 tokens), saved under ``root``. With
    ``draft_writes_text`` the draft's head rows of the bytes no UTF-8 text starts with are zero, so its greedy answers
    are text (an answer is cut at its first ill-formed byte)."""
    import torch

    from specdraft.testing import tiny_bpe_tokenizer, tiny_model

    tdir, ddir = root / "target", root / "draft"
    for vocab, tok, d, seed, layers in ((300, tiny_bpe_tokenizer(300), tdir, 0, target_layers),
                                        (360, tiny_bpe_tokenizer(360, seed=1), ddir, 1, 1)):
        model = tiny_model("llama", vocab, seed=seed, layers=layers)
        if draft_writes_text and d == ddir:
            with torch.no_grad():
                model.lm_head.weight[[i for i in range(vocab) if "\ufffd" in tok.decode([i])]] = 0.0
        model.save_pretrained(d)
        tok.save_pretrained(d)
    return tdir, ddir


def test_tiny_pipeline_with_a_draft_of_another_tokenizer(tmp_path):
    from specdraft.models.check import check_compatible

    tdir, ddir = _pair_of_two_tokenizers(tmp_path / "models", target_layers=3)
    train, ev = _examples("cdefghij", "t"), _examples("klm", "e")
    cfg = make_config("tiny", target=str(tdir), draft=str(ddir))
    with pytest.raises(PipelineError, match="--vocab-swap"):  # refused by default, with the way forward named
        run_pipeline(cfg, tmp_path / "refused", eval_examples=ev, train_examples=train)
    cfg = make_config("tiny", target=str(tdir), draft=str(ddir), vocab_swap=True)
    report = run_pipeline(cfg, tmp_path / "run", eval_examples=ev, train_examples=train)
    assert report["check"]["verdict"] == "mismatch"
    assert report["speed"]["lossless"]
    # The draft as given is counted through the mapping by its drafter's rounds along the target's answers.
    assert report["eval_before"]["sets"]["held_out"]["method"] == "replayed"
    assert report["eval_before"]["sets"]["held_out"]["replay_check"] is None
    swap = report["vocab_swap"]
    assert swap["width"] == 300 and swap["copied"] + swap["initialised"] == 300
    # The re-indexed draft is counted before training on the very answers eval_before wrote (replayed, paired):
    # the distillation gain's baseline is the draft that was trained, not the mapped one.
    from specdraft.core.stats import paired_gain_from_rows
    from specdraft.measuring.report import acceptance_gain, summary_sections

    base = swap["sets"]["held_out"]
    assert base["method"] == "replayed" and base["answers"] == report["eval_before"]["sets"]["held_out"]["answers"]
    assert [r["id"] for r in base["rows"]] == [e.id for e in ev]
    gain = acceptance_gain(report)
    assert gain.value == paired_gain_from_rows(base["rows"], report["eval_after"]["sets"]["held_out"]["rows"]).value
    first = summary_sections(report)[0][1][0]
    assert first[0] == "mapped/text: per proposed"  # the proposal regime it was counted in
    assert first[1].startswith(f"{report['eval_before']['sets']['held_out']['acceptance_rate']:.3f}")
    from specdraft.measuring.report import questions_and_answers

    said = dict(questions_and_answers(report))
    agree = said["Can the draft agree more?"]
    assert f"as given through the mapping → {base['acceptance_rate']:.3f} re-indexed" in agree
    # The speed answer leads with the draft that measured fastest (the one the recommendation serves), and the
    # speed tables say which draft their "before" column is.
    from specdraft.measuring.recommend import draft_names, engine_choices

    c = report["speed"]["contenders"]
    fastest = max(("original", "distilled"), key=lambda w: c[f"speculative:{w}"]["speedup"])
    assert f"with {draft_names(report)[fastest]}" in said["How much faster will it be?"]
    # The page and report.md open with what to serve where, fastest first; export/ names it too.
    choices = engine_choices(report)
    assert [x["engine"] for x in report["recommendation"]] == [x.engine for x in choices]
    assert [x.speedup for x in choices] == sorted((x.speedup or 0 for x in choices), reverse=True)
    md = (tmp_path / "run" / "report.md").read_text()
    assert md.split("\n")[2] == "## What to serve where (fastest first)"
    assert (tmp_path / "run" / "export" / "README.md").read_text().count("\n| ") == len(choices) + 2  # header, rule, rows
    assert "yes after the vocabulary swap" in said["Can these two work together?"]
    titles = [t for t, _ in summary_sections(report) if "speed" in t]
    assert titles and all(t.endswith("before = the draft as given, mapped/text") for t in titles)
    # The forecast compares p and q id by id: it ran on the re-indexed draft, the one that is trained.
    assert report["headroom"]["draft"] == swap["path"] and report["headroom"]["positions"] > 0
    # Its pass also gives the swap diagnostic over the same held-out answers; its verdict names the dominant kind.
    seg = report["headroom"]["segmentation"]
    assert seg["positions"] == report["headroom"]["positions"] and sum(seg["kinds"].values()) == seg["disagreements"]
    assert report["headroom"]["verdict"].endswith(f"; vocabulary swap: {seg['verdict']}")
    spec = tmp_path / "run" / "export" / "speculator"
    assert check_compatible(str(tdir), str(spec)).verdict == "identical"  # it now speaks the target's tokenizer
    assert "re-indexed into the target's tokenizer" in (tmp_path / "run" / "report.md").read_text()
    # The draft as given is written too, for vLLM's text proposer, and offered beside the distilled one with both
    # measured acceptances.
    given = report["export"]["as_given"]
    assert check_compatible(str(tdir), given["path"]).verdict == "mismatch" and given["drafting"] == "text"
    assert json.loads((Path(given["path"]) / "config.json").read_text())["speculators_config"][
        "default_proposal_method"] == "text"
    offer = (f"accepted {report['eval_before']['sets']['held_out']['acceptance_rate']:.3f} of its proposals as given "
             f"(mapped/text) against {report['eval_after']['sets']['held_out']['acceptance_rate']:.3f} re-indexed")
    assert offer in (tmp_path / "run" / "report.md").read_text()
    assert '"method": "custom_class"' in (tmp_path / "run" / "report.md").read_text()
    assert "README.md` names them with the commands" in said["Can I ship it?"]
    from specdraft.measuring.report import render_markdown
    from specdraft.run.pipeline import report_sections

    for before, after, warned in ((1.5, 0.5, True), (1.2, 1.4, False)):
        r = json.loads(json.dumps(report, default=str))
        c = r["speed"]["contenders"]
        c["speculative:original"]["speedup"], c["speculative:distilled"]["speedup"] = before, after
        r["speed"]["busy_machine"] = False  # timings beside other work draw no speed conclusion (tested elsewhere)
        md = render_markdown(r, report_sections())
        assert ("decoded slower than the original in the interleaved run (0.50x vs 1.50x" in md) == warned
        # The original here decodes only through the mapping: the advice is not to keep it for serving.
        assert ("llama.cpp and vLLM's draft_model need a draft of the target's tokenizer" in md) == warned
        assert "keep the original draft" not in md


def test_the_self_teacher_route_teaches_the_re_indexed_draft_with_the_drafts_own_answers(tmp_path):
    """The dump stage's teacher is the draft as given (no target weights read for it): its manifest names the draft,
    the distillation trains the re-indexed copy on it through a restricted head; a config without the vocabulary
    swap is refused, and a pair of one tokenizer (nothing re-indexed) is taught by the target on the full head."""
    import pydantic

    from specdraft.models.dump_reader import load_manifest
    from specdraft.models.loading import model_fingerprint

    tdir, ddir = _pair_of_two_tokenizers(tmp_path / "models", target_layers=2, draft_writes_text=True)
    train, ev = _examples("cdefghij", "t"), _examples("klm", "e")
    route = {"loss": "soft_ce", "head_support": 16, "on_policy_fraction": 0.0, "lr": 1e-3}
    with pytest.raises(pydantic.ValidationError, match="pass --vocab-swap"):
        make_config("tiny", target=str(tdir), draft=str(ddir), self_teacher={"generate": 6}, distill=route)
    cfg = make_config("tiny", target=str(tdir), draft=str(ddir), vocab_swap=True, speed_prompts=0,
                      self_teacher={"generate": 6, "max_length": 64, "dtype": "float32"}, distill=route)
    report = run_pipeline(cfg, tmp_path / "run", eval_examples=ev, train_examples=train)
    man = load_manifest(tmp_path / "run" / "dump")
    assert report["dump"]["teacher"] == "draft-as-given" and man["teacher"]["kind"] == "draft-as-given"
    assert man["teacher"]["weights"] == model_fingerprint(str(ddir))
    assert report["dump"]["sequences"] == len(train) and report["dump"]["trained_tokens"] > 0
    training = json.loads((tmp_path / "run" / "distill" / "training.json").read_text())
    assert training["dump"]["sequences"] == len(train) and training["metrics"]["head_support"] < 300
    assert report["eval_after"]["sets"]["held_out"]["rows"]  # the trained copy was evaluated like any distilled one
    # The export's token ranking says who wrote the answers it counted: the draft as given, not the target.
    ranking = json.loads((tmp_path / "run" / "export" / "speculator" / "head_tokens.json").read_text())
    assert "answer tokens written by the draft as given (" in ranking["counted_over"]
    assert "target" not in ranking["counted_over"]
    same_t, same_d = save_tiny_pair(tmp_path / "same", 96)
    one_tok = make_config("tiny", target=same_t, draft=same_d, vocab_swap=True, speed_prompts=0,
                          self_teacher={"generate": 6}, distill=route)
    lines = []
    report = run_pipeline(one_tok, tmp_path / "one", eval_examples=ev, train_examples=train, log=lines.append)
    assert report["dump"]["teacher"] == "target" and load_manifest(tmp_path / "one" / "dump").get("teacher") is None
    assert report["config"]["self_teacher"] is None and report["config"]["distill"]["head_support"] is None
    assert any("the self-teacher does not apply" in line for line in lines)


def test_every_preset_validates_and_exports_the_evaluated_gamma():
    from specdraft.core.config import PresetName
    from specdraft.run.pipeline import PRESETS

    assert set(PRESETS) == set(get_args(PresetName))  # the CLI's --preset choices come from the Literal
    for name in PRESETS:
        cfg = make_config(name)
        assert cfg.preset == name and cfg.dump.answer_only
        assert "num_speculative_tokens" not in cfg.distill.model_dump()  # training holds no serving γ
    # The default is the whole road: a draft of another tokenizer, mapped, re-indexed, distilled; the
    # same-family pair keeps its own preset.
    default, same = make_config("default"), make_config("same-family")
    assert default.vocab_swap and default.draft == "smollm2-135m-instruct" and default.distill.train == "all"
    # The longer variant is the default with its own data and steps, everything else the default's.
    long = make_config("default-long")
    assert long.distill.max_steps == 80 > default.distill.max_steps and long.distill.head_support == 8192
    assert len(long.train_prompts) == len(default.train_prompts) and long.self_teacher.generate == 256
    assert long.self_teacher.model_dump(exclude={"generate", "max_length"}) == default.self_teacher.model_dump(
        exclude={"generate", "max_length"})
    assert long.model_dump(exclude={"preset", "needs", "distill", "train_prompts", "self_teacher"}) == \
        default.model_dump(exclude={"preset", "needs", "distill", "train_prompts", "self_teacher"})
    assert long.distill.model_dump(exclude={"max_steps", "save_steps"}) == default.distill.model_dump(
        exclude={"max_steps", "save_steps"})
    assert not same.vocab_swap and same.draft == "qwen2.5-coder-0.5b-instruct"


def test_topk_dump_estimate_uses_the_dumps_own_top_k():
    cfg = make_config("same-family")
    topk = cfg.model_copy(update={"dump": cfg.dump.model_copy(update={"teacher_format": "topk", "top_logprobs": 64})})
    # 64 log-probs (float32, as computed) + 64 ids (int32) + leftover mass, + id and mask: not the serving top_k (0)
    assert estimate_dump_bytes(topk, 10, 100, 1536) == 10 * (100 + 48) * (64 * 8 + 4 + 5)
    assert estimate_dump_bytes(cfg, 10, 100, 1536) == 10 * (100 + 48) * (1536 * 2 + 5)


def test_run_takes_the_draft_options_into_both_evaluations():
    import pydantic

    cfg = make_config("default", eval={"draft_quantization": "int8", "draft_head_tokens": None,
                                       "gamma_policy": "adaptive"})
    assert cfg.eval.draft_quantization == "int8" and cfg.eval.gamma_policy == "adaptive"
    assert cfg.eval.max_new_tokens == 64 and cfg.eval.compare_hf  # the preset's other settings are kept
    default = make_config("default").eval  # the fastest lossless configuration unless asked otherwise
    assert (default.draft_quantization, default.gamma_policy, default.num_speculative_tokens) == ("auto", "adaptive", 5)
    with pytest.raises(pydantic.ValidationError, match="draft_quantization"):
        make_config("default", eval={"draft_quantization": "int2"})
    with pytest.raises(pydantic.ValidationError, match="vocab-swap"):
        make_config("default", vocab_swap=True, eval={"draft_head_tokens": 1000})


def test_a_rerun_with_other_training_prompts_names_the_stage_and_offers_overwrite(tmp_path, monkeypatch):
    """Re-running into the same --out with other training prompts failed inside the dump ("files that are not part
    of a teacher dump (stage.json)"). Now the run stops before any work on that stage, naming it and what changed,
    and --overwrite redoes it from an emptied directory."""
    from typer.testing import CliRunner

    import specdraft.training.distill as distill_mod
    from specdraft.cli import app

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    cfg = make_config("tiny", target=tdir, draft=ddir)
    ev, out = _examples("klm", "e"), tmp_path / "run"

    def stop(*a, **k):  # stop after the dump: the stages before distill are all that matter here
        raise RuntimeError("stopped after the dump")

    patch_everywhere(monkeypatch, distill_mod, "run_distill", stop)
    with pytest.raises(PipelineError, match="stage 'distill' failed"):
        run_pipeline(cfg, out, eval_examples=ev, train_examples=_examples("cdefghij", "t"))
    marker = (out / "dump" / "stage.json").read_text()
    with pytest.raises(PipelineError) as e:
        run_pipeline(cfg, out, eval_examples=ev, train_examples=_examples("cdefgx", "t"))
    msg = str(e.value)
    assert f"{out} holds a finished 'dump' stage made from other inputs (prompts: 8 → 6 items (1 new, 3 gone))" in msg
    assert "Pass --overwrite to redo 'dump' and the stages after it there, or choose a new --out." in msg
    assert (out / "dump" / "stage.json").read_text() == marker  # nothing touched
    logs = []
    with pytest.raises(PipelineError, match="stage 'distill' failed"):
        run_pipeline(cfg, out, log=logs.append, eval_examples=ev, train_examples=_examples("cdefgx", "t"),
                     overwrite=True)
    assert any(m.startswith("[dump] inputs changed (prompts: 8 → 6 items") for m in logs)
    redone = json.loads((out / "dump" / "stage.json").read_text())
    assert redone["inputs"]["prompts"] == [f"t-{w}" for w in "cdefgx"] and redone["result"]["sequences"] == 6
    assert "--overwrite" in CliRunner().invoke(app, ["run", "--help"], terminal_width=200).output


def test_a_stage_that_resumes_or_is_skipped_says_so_in_its_progress_line(tmp_path):
    """A killed stage leaves its files; the rerun continues from them (a distill resumes its checkpoint), and its
    progress line says it resumes, not a plain "running" that reads as starting over."""
    from specdraft.run.runner import Runner

    def killed(d):
        (d / "checkpoint-2").mkdir()
        raise RuntimeError("killed")

    logs: list[str] = []
    runner = Runner(tmp_path, "specdraft run", log=logs.append)
    with pytest.raises(PipelineError):
        runner.stage("distill", {"steps": 4}, killed)
    assert logs == ["[distill] running…"]
    logs.clear()
    assert runner.stage("distill", {"steps": 4}, lambda d: {"steps": 4}) == {"steps": 4}
    assert logs[0] == f"[distill] resuming: an unfinished run left files in {tmp_path / 'distill'} (checkpoint-2)"
    logs.clear()
    runner.stage("distill", {"steps": 4}, lambda d: {"steps": 0})
    assert logs == ["[distill] done earlier with the same inputs — skipped"]


def test_the_pipelines_long_stages_write_progress_lines_to_its_log(tmp_path, monkeypatch):
    """The pipeline's log is all a CI job shows: the evaluation and the dump say how far they are."""
    import specdraft.training.distill as distill_mod

    def stop(*a, **k):
        raise RuntimeError("stopped after the dump")

    patch_everywhere(monkeypatch, distill_mod, "run_distill", stop)
    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    logs: list[str] = []
    with pytest.raises(PipelineError, match="stage 'distill' failed"):
        run_pipeline(make_config("tiny", target=tdir, draft=ddir), tmp_path / "run", log=logs.append,
                     eval_examples=_examples("klm", "e"), train_examples=_examples("cdefghij", "t"))
    assert "[eval_before] held_out: 3/3 prompts" in "\n".join(logs)
    assert "[dump] teacher: 8/8 sequences" in "\n".join(logs)


def _stop_after_eval_before(monkeypatch):
    import specdraft.measuring.headroom as headroom_mod

    def stop(*a, **k):
        raise RuntimeError("stopped after eval_before")

    patch_everywhere(monkeypatch, headroom_mod, "forecast_headroom", stop)


def test_a_finished_stage_is_refused_then_redone_when_the_drafts_weights_change_in_place(tmp_path, monkeypatch):
    """A fine-tune saved over the draft's directory keeps its path, config and tokenizer: the stages made with the
    old weights are refused, naming draft_weights, and --overwrite redoes them (a stage of the target alone, the
    dump, would be kept)."""
    import torch

    from specdraft.models.loading import load_model

    _stop_after_eval_before(monkeypatch)
    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    cfg = make_config("tiny", target=tdir, draft=ddir)
    ev, train, out = _examples("klm", "e"), _examples("cdefghij", "t"), tmp_path / "run"
    with pytest.raises(PipelineError, match="stage 'headroom' failed"):
        run_pipeline(cfg, out, eval_examples=ev, train_examples=train)
    marker = (out / "eval_before" / "stage.json").read_text()
    draft, _ = load_model(ddir, dtype="float32")
    with torch.no_grad():
        draft.model.layers[0].mlp.down_proj.weight.add_(0.01)
    draft.save_pretrained(ddir)
    with pytest.raises(PipelineError) as e:
        run_pipeline(cfg, out, eval_examples=ev, train_examples=train)
    assert f"{out} holds a finished 'check' stage made from other inputs (draft_weights: " in str(e.value)
    assert (out / "eval_before" / "stage.json").read_text() == marker  # nothing touched
    logs: list[str] = []
    with pytest.raises(PipelineError, match="stage 'headroom' failed"):
        run_pipeline(cfg, out, log=logs.append, eval_examples=ev, train_examples=train, overwrite=True)
    assert any(m.startswith("[check] inputs changed (draft_weights: ") for m in logs)
    assert any(m.startswith("[eval_before] inputs changed (draft_weights: ") for m in logs)
    assert (out / "eval_before" / "stage.json").read_text() != marker


def test_a_finished_stage_is_refused_when_the_targets_chat_template_is_edited_in_place(tmp_path, monkeypatch):
    """A default system turn added to the target's template keeps weights, vocabulary and ids: every prompt now
    renders otherwise, so the evaluation of the old renderings is refused, naming the template (not the other
    tokenizer files), never "done earlier with the same inputs"."""
    _stop_after_eval_before(monkeypatch)
    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    cfg = make_config("tiny", target=tdir, draft=ddir)
    ev, train, out = _examples("klm", "e"), _examples("cdefghij", "t"), tmp_path / "run"
    with pytest.raises(PipelineError, match="stage 'headroom' failed"):
        run_pipeline(cfg, out, eval_examples=ev, train_examples=train)
    add_default_system_turn(tdir)
    logs: list[str] = []
    with pytest.raises(PipelineError) as e:
        run_pipeline(cfg, out, log=logs.append, eval_examples=ev, train_examples=train)
    assert f"{out} holds a finished 'check' stage made from other inputs (target_chat_template: " in str(e.value)
    assert "tokenizer_files" not in str(e.value) and not any("skipped" in m for m in logs)


def test_a_finished_stage_is_refused_when_a_stop_id_is_added_to_the_targets_generation_config(tmp_path, monkeypatch):
    """Answers end at the generation config's EOS ids: one added there ends the target's answers elsewhere, so the
    stages made from the old answers are refused, naming the stop ids before and after."""
    _stop_after_eval_before(monkeypatch)
    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    cfg = make_config("tiny", target=tdir, draft=ddir)
    ev, train, out = _examples("klm", "e"), _examples("cdefghij", "t"), tmp_path / "run"
    with pytest.raises(PipelineError, match="stage 'headroom' failed"):
        run_pipeline(cfg, out, eval_examples=ev, train_examples=train)
    gen = Path(tdir) / "generation_config.json"
    gen.write_text(json.dumps(json.loads(gen.read_text()) | {"eos_token_id": [4, 3]}))
    with pytest.raises(PipelineError) as e:
        run_pipeline(cfg, out, eval_examples=ev, train_examples=train)
    assert (f"{out} holds a finished 'check' stage made from other inputs (target_stop_ids: [4] → [3, 4])"
            in str(e.value))


def test_a_finished_stage_is_refused_when_a_prompts_text_changes_under_the_same_id(tmp_path, monkeypatch):
    """A prompt file edited without renumbering keeps every id: the evaluation of the old texts is refused, naming
    the set and the prompt whose text changed, never reported as the new prompts' result."""
    _stop_after_eval_before(monkeypatch)
    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    cfg = make_config("tiny", target=tdir, draft=ddir)
    train, out = _examples("cdefghij", "t"), tmp_path / "run"
    with pytest.raises(PipelineError, match="stage 'headroom' failed"):
        run_pipeline(cfg, out, eval_examples=_examples("klm", "e"), train_examples=train)
    edited = _examples("klm", "e")
    edited[1].messages[0]["content"] = "a b l l"  # same id "e-l", another question
    with pytest.raises(PipelineError) as e:
        run_pipeline(cfg, out, eval_examples=edited, train_examples=train)
    assert (f"{out} holds a finished 'eval_before' stage made from other inputs "
            "(prompt_texts.held_out.e-l: ") in str(e.value)
