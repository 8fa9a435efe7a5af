"""Distillation on tiny models: the Trainer-facing forward, masking, a short Trainer run, resume, failure modes."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest
import torch

from specdraft.core.config import DistillConfig, SamplingConfig, TrainWhat
from specdraft.testing import patch_everywhere, perturbed, tiny_model
from specdraft.training.distill import DistillError, train
from specdraft.training.distill_data import collate
from specdraft.training.distill_trainer import DistillModel, TeacherHead

V = 96


def teacher_rows(target, seqs):
    rows = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            h = target(ids, output_hidden_states=True).hidden_states[-1][0]  # post-norm final hidden states
            mask = torch.ones(len(s), dtype=torch.bool)
            mask[-1] = False  # the last position has no next token in the sequence
            rows.append({"input_ids": ids[0], "loss_mask": mask, "hidden": h.to(torch.bfloat16)})
    return rows


@pytest.fixture(scope="module")
def setup():
    target = tiny_model("llama", V, seed=0, layers=2)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, V, (int(n),), generator=g).tolist() for n in (12, 9, 15, 7, 11, 10)]
    return target, teacher_rows(target, seqs)


def test_hidden_teacher_reproduces_target_logits(setup):
    target, rows = setup
    m = DistillModel(tiny_model("llama", V, seed=1, layers=1), TeacherHead(target.lm_head.weight, V), DistillConfig())
    _p, logits = m.teacher_probs(hidden=rows[0]["hidden"].float()[None])
    with torch.no_grad():
        ref = target(rows[0]["input_ids"][None]).logits.float()
    torch.testing.assert_close(logits, ref, atol=0.05, rtol=0.02)  # bf16-stored hidden states
    assert "head_weight" not in m.state_dict() and not any(k.startswith("head") for k in m.state_dict())


@pytest.mark.parametrize("loss", ["soft_ce", "tvd", "tvd_deploy"])
def test_forward_returns_loss_by_key_and_ignores_padding(setup, loss):
    target, rows = setup
    cfg = DistillConfig(loss=loss, top_k=5, top_p=0.9, temperature=0.8)
    m = DistillModel(perturbed(target, 0.1), TeacherHead(target.lm_head.weight, V), cfg)
    one = collate(rows[:1])
    out = m(**one)
    assert "loss" in out and out["loss"].dim() == 0 and torch.isfinite(out["loss"])
    # Same row batched with a longer one: its padding must not change its contribution.
    two = collate(rows[:2])
    out2 = m(**two)
    single = [m(**collate([r])) for r in rows[:2]]
    tokens = [float(o["tokens"]) for o in single]
    weighted = sum(float(o["loss"].detach()) * t for o, t in zip(single, tokens)) / sum(tokens)
    assert float(out2["loss"].detach()) == pytest.approx(weighted, rel=1e-4)
    # Identical draft and teacher: TVD-type losses vanish.
    same = DistillModel(target, TeacherHead(target.lm_head.weight, V), cfg)
    if loss != "soft_ce":
        assert float(same(**one)["loss"].detach()) < 0.02
    assert 0.0 <= float(out["alpha"]) <= 1.0


@pytest.mark.parametrize("teacher", ["hidden", "topk"])
@pytest.mark.parametrize("loss", ["soft_ce", "tvd", "nla"])
def test_scoring_only_the_trained_columns_gives_the_loss_metrics_and_gradients_of_every_column(setup, loss, teacher):
    target, _ = setup
    rows = _prompted_rows(target, 2, prompt_len=7, answer_len=4)
    rows[1] = {k: (v[2:] if k != "id" else v) for k, v in rows[1].items()}  # another prompt length: columns differ
    if teacher == "topk":
        rows = topk_rows(target, rows)
    batch = collate(rows)
    cfg = DistillConfig(loss=loss)
    draft = perturbed(target, 0.1)
    head = target.lm_head.weight if teacher == "hidden" else None
    outs, grads = [], []
    for only in (True, False):
        m = DistillModel(draft, TeacherHead(head, V, width=V), cfg, trained_columns_only=only)
        assert m.trained_columns_only is only
        out = m(**batch)
        out["loss"].backward()
        outs.append(out)
        grads.append(draft.lm_head.weight.grad.clone())
        draft.zero_grad(set_to_none=True)
    cut, full = outs
    assert float(cut["tokens"]) == float(full["tokens"]) == 8
    for key in ("loss", "tvd", "alpha", "train_acc"):
        torch.testing.assert_close(cut[key].detach(), full[key].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    assert float(grads[0].abs().sum()) > 0


@pytest.mark.parametrize("loss", ["soft_ce", "tvd"])
def test_topk_teacher_takes_the_sparse_loss_equal_to_the_dense_path_where_its_mass_is_all_in_the_top_k(setup, loss):
    """A top-k teacher trains soft_ce / tvd without its full-width p; where the teacher's mass is all in its top k
    the loss, its gradient and the metrics equal the dense path's (the teacher densified, LOSSES applied)."""
    from specdraft.core.losses import LOSSES, masked_mean
    from specdraft.core.sampling import align_logits
    from specdraft.models.dump_reader import teacher_probs_from_topk

    target, rows = setup
    k = 6
    with torch.no_grad():
        t_logits = target(collate(rows[:2])["input_ids"]).logits.float()  # [B, S, V]
    keep = torch.topk(t_logits, k).indices
    logprobs = t_logits.gather(-1, keep).log_softmax(-1)  # all of the teacher's mass on its k ids
    batch = collate(rows[:2])
    batch.pop("hidden")
    batch |= {"topk_logprobs": logprobs, "topk_ids": keep.to(torch.int32),
              "leftover_logmass": torch.full(keep.shape[:-1], float("-inf"))}
    draft = perturbed(target, 0.1)
    m = DistillModel(draft, TeacherHead(None, V, width=V), DistillConfig(loss=loss))
    out = m(**batch)
    (g_sparse,) = torch.autograd.grad(out["loss"], draft.lm_head.weight)
    d_logits = align_logits(draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                            V, V).float()
    p = teacher_probs_from_topk(logprobs, keep, batch["leftover_logmass"], V, V)
    mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    dense = masked_mean(LOSSES[loss](d_logits, p), mask)
    (g_dense,) = torch.autograd.grad(dense, draft.lm_head.weight)
    assert float(dense.detach()) > 0.01
    torch.testing.assert_close(out["loss"], dense)
    torch.testing.assert_close(g_sparse, g_dense)
    with torch.no_grad():
        tv = 0.5 * (p - d_logits.softmax(-1)).abs().sum(-1)
        torch.testing.assert_close(out["tvd"], masked_mean(tv, mask))
        torch.testing.assert_close(out["alpha"], masked_mean(1 - tv, mask))
        torch.testing.assert_close(out["train_acc"], masked_mean((d_logits.argmax(-1) == p.argmax(-1)).float(), mask))


def test_padding_rows_and_bad_widths(setup):
    target, rows = setup
    wide = tiny_model("llama", V + 32, seed=1, layers=1)  # same tokenizer, padded matrix
    m = DistillModel(wide, TeacherHead(target.lm_head.weight, V), DistillConfig())
    assert torch.isfinite(m(**collate(rows[:2]))["loss"])
    narrow = tiny_model("llama", V - 10, seed=1, layers=1)
    with pytest.raises(DistillError, match="beyond padding"):
        DistillModel(narrow, TeacherHead(target.lm_head.weight, V), DistillConfig())


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="loss"):
        DistillConfig(loss="kl")
    with pytest.raises(ValueError, match="top_p"):
        DistillConfig(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        DistillConfig(top_k=-1)


def test_the_serving_filter_is_one_sampling_config_and_the_flat_keys_of_older_configs_still_load():
    """``serving`` holds the filter; a training.json / stage.json written with flat temperature / top_k / top_p
    keys loads into it unchanged, and a serving temperature of 0 (greedy: no distribution to train toward) is
    refused though decoding's SamplingConfig allows it."""
    assert DistillConfig().serving == SamplingConfig(temperature=1.0) and DistillConfig().serving_is_plain
    old = {"loss": "tvd_deploy", "temperature": 0.8, "top_k": 4, "top_p": 0.9, "lr": 2e-4}
    cfg = DistillConfig.model_validate(old)
    assert cfg.serving == SamplingConfig(temperature=0.8, top_k=4, top_p=0.9) and cfg.lr == 2e-4
    assert DistillConfig.model_validate(cfg.model_dump()) == cfg  # the new shape round-trips
    assert DistillConfig.model_validate({"top_k": 3}).serving == SamplingConfig(temperature=1.0, top_k=3)
    assert DistillConfig.model_validate(cfg.model_dump() | {"top_k": 2}).serving.top_k == 2  # a flat override
    assert "temperature" not in cfg.model_dump() and cfg.model_dump()["serving"]["top_p"] == 0.9
    for bad in ({"temperature": 0.0}, {"serving": {"temperature": 0.0}}):
        with pytest.raises(ValueError, match="serving-temperature 0.0"):
            DistillConfig.model_validate(bad)


def test_two_step_trainer_run_pins_first_loss_and_resumes(setup, tmp_path):
    target, rows = setup
    draft = perturbed(target, 0.15)
    cfg = DistillConfig(loss="tvd", lr=5e-3, max_steps=2, batch_size=2, save_steps=1, scheduler="constant",
                        seed=0)
    # The loss the Trainer logs at step 1 is the initial model's loss on the first batch of its sampler.
    initial = DistillModel(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), cfg)
    result = train(draft, TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], cfg, tmp_path)
    logged = [h["loss"] for h in result.history if "loss" in h]
    assert result.steps == 2 and len(logged) == 2
    assert all("train_acc" in h for h in result.history if "loss" in h)
    batch_losses = []
    # Any pair of the 4 training rows may form the first batch (seeded shuffle); the logged value must be one
    # of the possible first-batch losses of the initial model.
    with torch.no_grad():
        for a, b in itertools.combinations(range(4), 2):
            batch_losses.append(float(initial(**collate([rows[a], rows[b]]))["loss"]))
    assert min(abs(logged[0] - x) for x in batch_losses) < 1e-4
    before, after = result.eval_before["eval_loss"], result.eval_after["eval_loss"]
    assert after != before
    # Resume: a second call with more steps continues from checkpoint-2 instead of starting over.
    cfg4 = cfg.model_copy(update={"max_steps": 4})
    again = train(result.draft, TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], cfg4, tmp_path)
    assert again.resumed_from.endswith("checkpoint-2") and again.steps == 4


def test_non_finite_loss_stops_with_clear_error(setup, tmp_path):
    target, rows = setup
    bad = [dict(r, hidden=torch.full_like(r["hidden"], float("nan"))) for r in rows[:2]]
    with pytest.raises(DistillError, match="non-finite loss"):
        train(perturbed(target, 0.1), TeacherHead(target.lm_head.weight, V), bad, None, DistillConfig(max_steps=2, batch_size=1), tmp_path)


def test_weights_made_non_finite_by_a_step_are_never_checkpointed_or_exported(setup, tmp_path):
    """A finite loss whose update overflows (NaN weights after the optimizer step, saved before the next loss
    would show it): the checkpoint is refused with a message, the last good one stays, and an export refuses them."""
    from transformers import TrainerCallback

    from specdraft.models.weights import CheckpointWeightsError
    from specdraft.serving.export import export_speculator

    target, rows = setup

    class Overflow(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == 2:
                with torch.no_grad():
                    next(model.draft.parameters()).fill_(float("nan"))

    draft = perturbed(target, 0.1)
    with pytest.raises(DistillError, match=r"weights are not finite after step 2 \(model\.embed_tokens\.weight"):
        train(draft, TeacherHead(target.lm_head.weight, V), rows[:4], None, DistillConfig(max_steps=3, batch_size=1, save_steps=1), tmp_path, callbacks=[Overflow()])
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("checkpoint-*"))
    assert ckpts == ["checkpoint-1"] and (tmp_path / "checkpoints" / "checkpoint-1" / "trainer_state.json").is_file()
    with pytest.raises(CheckpointWeightsError, match=r"not finite \(NaN or inf\): model\.embed_tokens\.weight"):
        export_speculator(draft, None, target_dir(tmp_path), tmp_path / "spec", 3)
    assert not (tmp_path / "spec").exists()


def target_dir(tmp_path):
    """A saved tiny target, for the export's verifier record."""
    d = tmp_path / "target"
    tiny_model("llama", V, seed=0, layers=1).save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("fmt", ["hidden", "topk"])
def test_run_distill_from_a_dump_exports_a_speculator(tmp_path, fmt):
    """dump → distill → export: the export loads with AutoModelForCausalLM, its logits equal the trained model's,
    config.json carries the speculators keys, and a dump of another tokenizer is refused before training."""
    import json

    from transformers import AutoModelForCausalLM

    from specdraft.core.config import DumpConfig
    from specdraft.models.dump_reader import DumpError
    from specdraft.testing import save_tiny_pair, tiny_tokenizer
    from specdraft.training.distill import run_distill
    from specdraft.training.dump import run_dump

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"a b {w}"},
                                                       {"role": "assistant", "content": f"c {w} d e"}]})
                              for w in "fghijklm") + "\n")
    run_dump(tdir, str(data), tmp_path / "dump", DumpConfig(teacher_format=fmt, top_logprobs=8, dtype="float32"))
    cfg = DistillConfig(loss="soft_ce", lr=1e-3, max_steps=3, batch_size=2, held_out_fraction=0.25)
    res = run_distill(tdir, ddir, tmp_path / "dump", tmp_path / "out", cfg, num_speculative_tokens=3)
    spec_dir = res.speculator
    conf = json.loads((spec_dir / "config.json").read_text())
    assert conf["speculators_model_type"] == "independent"
    assert conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert conf["speculators_config"]["verifier"]["name_or_path"] == tdir
    assert (spec_dir / "training.json").is_file()
    on_disk = json.loads((tmp_path / "out" / "training.json").read_text())["metrics"]
    split = on_disk["held_out_split"]
    assert split["keyed_by"] == "prompt" and split["train_held_overlap"] == 0  # the split is counted on disk
    assert 0 < on_disk["moved_fraction"] <= 1  # what share of the trainable weights training changed
    reloaded = AutoModelForCausalLM.from_pretrained(spec_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, res.model.eval()(ids).logits)
    assert res.metrics.eval_after["eval_loss"] != res.metrics.eval_before["eval_loss"]
    # The logged α says what it is, and how far a top-k teacher's unknown tail can move it (0 for full logits).
    assert res.metrics.alpha_definition.startswith("Σ min(p, q) at temperature 1, no filter")
    bound = res.metrics.eval_after["eval_alpha_bound"]
    assert bound > 0 if fmt == "topk" else bound == 0
    # A draft speaking another tokenizer is refused before any training.
    other = tmp_path / "other"
    tiny_model("llama", 96, seed=3, layers=1).save_pretrained(other)
    tiny_tokenizer(96, swap=(10, 11)).save_pretrained(other)
    with pytest.raises(DumpError, match="fingerprint"):
        run_distill(tdir, str(other), tmp_path / "dump", tmp_path / "out2", cfg)


@pytest.mark.real
def test_real_pair_few_steps_lower_held_out_loss(tmp_path):
    """The embedded pair: a small hidden dump of HumanEval prompts + canonical solutions, a few distillation
    steps on the draft's last layers, and the held-out TVD goes down."""
    from specdraft.core.config import DumpConfig
    from specdraft.core.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdraft.training.distill import run_distill
    from specdraft.training.dump import run_dump

    run_dump(DEFAULT_TARGET, "humaneval:0:8", tmp_path / "dump",
             DumpConfig(max_length=192, answer_only=True, batch_size=4, dtype="bfloat16"))
    cfg = DistillConfig(loss="tvd", train="last_layers", train_last_layers=2, lr=3e-5, max_steps=4, batch_size=2,
                        held_out_fraction=0.25, scheduler="constant", save_steps=100)
    res = run_distill(DEFAULT_TARGET, DEFAULT_DRAFT, tmp_path / "dump", tmp_path / "out", cfg)
    before, after = res.metrics.eval_before, res.metrics.eval_after
    assert res.metrics.held_out_sequences == 2 and res.metrics.steps == 4
    assert after["eval_loss"] < before["eval_loss"], (before, after)
    assert after["eval_alpha"] > before["eval_alpha"]


def _grads_of_first_step(target, rows, tmp_path, batch_size, accumulation):
    """Gradient of the first optimizer step (before clipping would apply: max_grad_norm is huge) by name."""
    from transformers import TrainerCallback

    grads = {}

    class Watch(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if not grads:
                grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    cfg = DistillConfig(loss="tvd", lr=1e-3, max_steps=1, batch_size=batch_size,
                        gradient_accumulation_steps=accumulation, max_grad_norm=1e9, scheduler="constant",
                        held_out_fraction=0.0, save_steps=100)
    out = train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows, None, cfg, tmp_path / f"b{batch_size}-a{accumulation}", resume=False, callbacks=[Watch()])
    return grads, out.history[0]["loss"]


def test_gradient_accumulation_weighs_every_trained_token_equally(setup, tmp_path):
    """Two sequences with 10 and 1 trained positions: batch 2 / accumulation 1 and batch 1 / accumulation 2
    give the same gradient and the same logged loss (the token-weighted mean over both), not the average of
    the two micro-batch means."""
    target, _ = setup
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(5, V, (12,), generator=g).tolist(), torch.randint(5, V, (6,), generator=g).tolist()]
    rows = teacher_rows(target, seqs)
    rows[0]["loss_mask"][:] = False
    rows[0]["loss_mask"][1:11] = True  # 10 trained positions
    rows[1]["loss_mask"][:] = False
    rows[1]["loss_mask"][2] = True  # 1 trained position
    one, loss_one = _grads_of_first_step(target, rows, tmp_path, batch_size=2, accumulation=1)
    two, loss_two = _grads_of_first_step(target, rows, tmp_path, batch_size=1, accumulation=2)
    assert one.keys() == two.keys() and one
    flat1 = torch.cat([one[k].flatten() for k in sorted(one)])
    flat2 = torch.cat([two[k].flatten() for k in sorted(two)])
    rel = float((flat1 - flat2).norm() / flat1.norm())
    assert rel < 1e-4, f"gradients differ by {rel:.2e} (relative) between batch 2 and batch 1 × accumulation 2"
    assert loss_one == pytest.approx(loss_two, rel=1e-5)

    # The test can tell: the plain average of the two per-sequence means (what the Trainer did before) is far off.
    model = DistillModel(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), DistillConfig(loss="tvd"))
    per_seq = [model(**collate([r]))["loss"] for r in rows]
    named = dict(model.named_parameters())
    naive = torch.autograd.grad(0.5 * (per_seq[0] + per_seq[1]), [named[k] for k in sorted(one)])
    flat_naive = torch.cat([x.flatten() for x in naive])
    assert float((flat_naive - flat1).norm() / flat1.norm()) > 0.1


def test_learning_curve_scores_held_out_every_eval_steps_once(setup, tmp_path):
    """eval_steps=2 over 4 steps: points at 0 (before), 2 and 4; the final step is scored once, and it is the
    reported eval_after."""
    target, rows = setup
    cfg = DistillConfig(loss="tvd", lr=5e-3, max_steps=4, batch_size=2, eval_steps=2, scheduler="constant",
                        save_steps=100)
    result = train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], cfg, tmp_path)
    curve = result.curve
    assert [p["step"] for p in curve] == [0, 2, 4]
    assert curve[0]["eval_alpha"] == result.eval_before["eval_alpha"]
    assert curve[-1]["eval_loss"] == result.eval_after["eval_loss"]
    assert sum("eval_alpha" in h and h["step"] == 4 for h in result.history) == 1
    assert all(0.0 <= p["eval_alpha"] <= 1.0 for p in curve)


# ------------------------------------------------------------------------------------------ on-policy data


def _prompted_rows(target, n: int, prompt_len: int = 5, answer_len: int = 6, seed: int = 3):
    """Dump-like items with a prompt: loss_mask trains the answer positions only (as --answer-only does)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k in range(n):
        ids = torch.randint(5, V, (prompt_len + answer_len,), generator=g)
        with torch.no_grad():
            h = target(ids[None], output_hidden_states=True).hidden_states[-1][0]
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[prompt_len - 1:-1] = True  # position j predicts token j+1: the answer tokens
        rows.append({"id": f"row-{k}", "input_ids": ids, "loss_mask": mask, "hidden": h.to(torch.bfloat16)})
    return rows


class _FakeWriter:
    """Records each call; answers with items tagged by the refresh step."""

    def __init__(self):
        self.calls = []
        self.stats = {"sequences": 0}

    def __call__(self, draft, prompts, seed):
        self.calls.append((draft, [i for i, _ in prompts], seed))
        self.stats["sequences"] += len(prompts)
        return [{"id": f"on-policy/{i}@{seed}"} for i, _ in prompts]


def test_prompt_of_cuts_at_the_first_trained_position():
    from specdraft.training.distill_data import prompt_of

    item = {"input_ids": torch.arange(10), "loss_mask": torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 0]).bool()}
    assert prompt_of(item) == [0, 1, 2, 3]  # position 3 predicts the first answer token (4)
    assert prompt_of({"input_ids": torch.arange(4), "loss_mask": torch.ones(4, dtype=torch.bool)}) is None


def test_stream_mixes_the_fraction_per_step_and_refreshes_every_n():
    from specdraft.training.distill_data import OnPolicyStream

    dump = [{"id": f"d{i}"} for i in range(7)]
    prompts = [(f"p{i}", [1, 2]) for i in range(5)]
    writer, draft = _FakeWriter(), object()
    stream = OnPolicyStream(dump, prompts, writer, draft, fraction=0.5, every=3, per_step=4, seed=0, max_steps=8)
    items = list(itertools.islice(iter(stream), 8 * 4))
    steps = [items[4 * s: 4 * s + 4] for s in range(8)]
    assert all(sum(x["id"].startswith("on-policy/") for x in st) == 2 for st in steps)  # λ·G = 2 every step
    assert [seed for _, _, seed in writer.calls] == [0, 3, 6]  # refreshed at steps 0, 3, 6 (seed + step)
    assert [len(p) for _, p, _ in writer.calls] == [6, 6, 4]  # the share of steps 0–2, 3–5, 6–7 (max_steps 8)
    assert all(d is draft for d, _, _ in writer.calls)  # the live model, not a copy
    # λ = 0.25 of G = 2: one draft-written sequence every other step, exactly.
    quarter = OnPolicyStream(dump, prompts, _FakeWriter(), draft, 0.25, 10, 2, 0, max_steps=8)
    got = list(itertools.islice(iter(quarter), 16))
    assert [sum(x["id"].startswith("on-policy/") for x in got[2 * s: 2 * s + 2]) for s in range(8)] == [0, 1] * 4
    # A resumed stream continues the dump order where a fresh one would be at that step.
    resumed = OnPolicyStream(dump, prompts, _FakeWriter(), draft, 0.5, 3, 4, 0, max_steps=8)
    resumed.start_step = 4
    later = list(itertools.islice(iter(resumed), 4 * 4))
    dump_ids = lambda xs: [x["id"] for x in xs if not x["id"].startswith("on-policy/")]
    assert dump_ids(later) == dump_ids(items[16:])


def test_draft_writer_answers_with_the_draft_and_scores_with_a_plain_target_forward():
    from specdraft.core.config import DumpConfig, SamplingConfig
    from specdraft.decoding.responses import generate_from_ids
    from specdraft.testing import tiny_tokenizer
    from specdraft.training.distill_data import DraftWriter
    from specdraft.training.teacher import Teacher

    tok = tiny_tokenizer(V)
    target = tiny_model("llama", V, seed=0, layers=2)
    draft = tiny_model("llama", V, seed=7, layers=1)  # another model: its answers are not the target's
    cfg = DumpConfig(teacher_format="hidden", hidden_dtype="float32", answer_only=True, generate=6, max_length=64)
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    writer = DraftWriter(Teacher(target, V), tok, cfg, sampling, max_new_tokens=6)
    prompts = [("a", [2, 10, 11, 12]), ("b", [2, 20, 21])]
    items = writer(draft, prompts, seed=5)
    answers = generate_from_ids(draft, tok, [p for _, p in prompts], 6, sampling, seed=5, real_vocab=V)
    for item, (_, p), a in zip(items, prompts, answers):
        assert item["input_ids"].tolist() == p + a  # the draft's own sampled answer, token for token
        assert item["loss_mask"].tolist() == [False] * (len(p) - 1) + [True] * len(a) + [False]
        with torch.no_grad():
            plain = target(item["input_ids"][None]).logits[0]
        torch.testing.assert_close(target.lm_head(item["hidden"]), plain, atol=1e-5, rtol=1e-5)
    assert writer.stats["sequences"] == 2 and writer.stats["teacher_tokens"] == sum(len(p) + len(a)
                                                                                   for (_, p), a in zip(prompts, answers))
    assert writer.stats["teacher_seconds"] > 0 and writer.stats["generate_seconds"] > 0


def test_on_policy_answers_that_cannot_fit_the_drafts_window_are_refused_before_the_stream_starts():
    """The draft decodes up to N tokens after each prompt (prompt + N + 1 positions, decoding's rule): a GPT-2 draft
    of 16 positions and a 10-token prompt with N = 8 is refused when the stream is built, naming both lengths — not
    at the first refresh, inside training."""
    from specdraft.core.config import DumpConfig, SamplingConfig
    from specdraft.testing import tiny_tokenizer
    from specdraft.training.distill_data import DraftWriter, OnPolicyStream
    from specdraft.training.teacher import Teacher

    target = tiny_model("llama", V, seed=0, layers=1)
    draft = tiny_model("gpt2", V, seed=1, layers=1, n_positions=16)
    cfg = DumpConfig(answer_only=True, generate=8, max_length=64)
    prompts = [("short", [2, 10, 11]), ("long", list(range(10, 20)))]
    def stream(n):
        writer = DraftWriter(Teacher(target, V), tiny_tokenizer(V), cfg, SamplingConfig(temperature=1.0), n)
        return OnPolicyStream([{"id": "d"}], prompts, writer, draft, 0.5, 1, 2, 0, max_steps=1)

    with pytest.raises(DistillError, match=r"prompt 'long' \(10 tokens\) \+ the draft's answer \(8\) \+ 1 = 19 "
                       r"exceeds the draft's context window \(16\)"):
        stream(8)
    assert stream(5).prompts == prompts  # 10 + 5 + 1 = 16 positions: fits


def test_on_policy_zero_is_dump_only_and_positive_trains_on_draft_answers(tmp_path):
    from specdraft.core.config import DumpConfig, SamplingConfig
    from specdraft.testing import tiny_tokenizer
    from specdraft.training.distill_data import DraftWriter
    from specdraft.training.teacher import Teacher

    target = tiny_model("llama", V, seed=0, layers=2)
    rows = _prompted_rows(target, 6)
    cfg = DistillConfig(loss="tvd", lr=5e-3, max_steps=2, batch_size=2, save_steps=10, scheduler="constant")

    class Exploding:
        def __call__(self, *a):
            raise AssertionError("λ = 0 must not write a sequence")

    plain = train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], cfg, tmp_path / "a")
    zero = train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], cfg, tmp_path / "b", writer=Exploding())
    loss = lambda r: [h["loss"] for h in r.history if "loss" in h]
    assert loss(zero) == loss(plain) and zero.on_policy is None
    writer = DraftWriter(Teacher(target, V), tiny_tokenizer(V), DumpConfig(answer_only=True, generate=4),
                         SamplingConfig(temperature=1.0), max_new_tokens=4)
    half = train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], cfg.model_copy(update={"on_policy_fraction": 0.5, "on_policy_every": 1}), tmp_path / "c", writer=writer)
    assert half.steps == 2 and len(loss(half)) == 2
    assert half.on_policy["refresh_steps"] == [0, 1] and half.on_policy["sequences"] == 2  # 1 of 2 per step
    assert loss(half)[0] != loss(plain)[0]
    with pytest.raises(DistillError, match="DraftWriter"):
        train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], None, cfg.model_copy(update={"on_policy_fraction": 0.5}), tmp_path / "d")


def test_a_dump_holding_ids_past_the_drafts_width_is_refused_before_training(tmp_path, monkeypatch):
    """Target and draft share a tokenizer of 96 ids, but the draft was made with 80 rows: the dump's ids 80+ are
    named before a training step (was an IndexError inside the draft at its first batch)."""
    import json

    from specdraft.core.config import DumpConfig
    from specdraft.core.sampling import TokenWidthError
    from specdraft.testing import save_tiny_pair
    from specdraft.training.distill import run_distill
    from specdraft.training.dump import run_dump

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96, draft_vocab=80)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"a b {w}"},
                                                       {"role": "assistant", "content": f"c {w} d"}]})
                              for w in ("f", "bn0", "g", "bx0")) + "\n")  # ids 80 and 90
    run_dump(tdir, str(data), tmp_path / "dump", DumpConfig(teacher_format="topk", top_logprobs=8, dtype="float32"))
    monkeypatch.setattr("specdraft.training.distill.train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(TokenWidthError, match=r"draft cannot read or score: 80, 90 \(its input embedding has 80"):
        run_distill(tdir, ddir, tmp_path / "dump", tmp_path / "out", DistillConfig(max_steps=1, batch_size=1))
    assert issubclass(TokenWidthError, ValueError)


def test_resolve_precision_reads_the_cpu_flags():
    from specdraft.training.distill import cpu_bf16_flags, resolve_precision

    amx = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    plain = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"
    assert cpu_bf16_flags(amx) == ["amx_bf16", "avx512_bf16"] and cpu_bf16_flags(plain) == []
    assert resolve_precision("auto", "cpu", amx)[0] == "bf16-autocast"
    chosen, reason = resolve_precision("auto", "cpu", plain)
    assert chosen == "float32" and "emulated" in reason
    assert resolve_precision("bf16-autocast", "cpu", plain) == ("bf16-autocast", "asked for")  # never rewritten
    assert resolve_precision("float32", "cpu", amx) == ("float32", "asked for")
    with pytest.raises(ValueError, match="master weights"):
        DistillConfig(precision="bf16-autocast", dtype="bfloat16")


def test_bf16_autocast_training_reaches_the_float32_loss(setup, tmp_path):
    """Ten steps on the same batches in float32 and under bf16 autocast (float32 master weights). Tolerance: every
    logged loss within 0.02 of float32's (~2.5% of it; bf16 keeps 8 significand bits, ~0.4% per rounding, and
    the two runs' weights drift apart step by step: measured here ≤ 0.009), the drop over the run within 20%
    of float32's, and the held-out loss after training within 0.02."""
    target, rows = setup
    runs = {}
    for precision in ("float32", "bf16-autocast"):
        draft = perturbed(target, 0.3)
        head_dtypes = set()
        draft.lm_head.register_forward_hook(lambda _m, _i, out, seen=head_dtypes: seen.add(out.dtype))
        cfg = DistillConfig(loss="tvd", lr=5e-3, max_steps=10, batch_size=2, save_steps=100, scheduler="constant",
                            seed=0, precision=precision)
        res = train(draft, TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], cfg, tmp_path / precision)
        runs[precision] = res
        assert res.precision == precision
        # Master weights: the parameters (and so the exported draft) stay float32 whatever ran the matmuls.
        assert {p.dtype for p in res.draft.parameters()} == {torch.float32}
        assert head_dtypes == ({torch.bfloat16} if precision == "bf16-autocast" else {torch.float32})
    loss = {k: [h["loss"] for h in r.history if "loss" in h] for k, r in runs.items()}
    fp32, bf16 = loss["float32"], loss["bf16-autocast"]
    assert len(fp32) == len(bf16) == 10 and fp32 != bf16  # autocast changed the arithmetic…
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < 0.02  # …not the training
    assert fp32[0] - fp32[-1] > 0.1 and (bf16[0] - bf16[-1]) == pytest.approx(fp32[0] - fp32[-1], rel=0.2)
    after = {k: r.eval_after["eval_loss"] for k, r in runs.items()}
    assert after["bf16-autocast"] == pytest.approx(after["float32"], abs=0.02)


def test_distill_command_refuses_autocast_over_bfloat16_weights_before_loading(tmp_path):
    from typer.testing import CliRunner

    from specdraft.cli import app

    r = CliRunner().invoke(app, ["distill", "--dump", str(tmp_path / "none"), "--precision", "bf16-autocast",
                                 "--dtype", "bfloat16", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--precision" in r.output and "master weights" in r.output


def test_mixed_split_splits_each_dump_and_repeats_by_weight():
    """One dump splits exactly as split_held_out; in a mix each dump keeps its own held-out share, training
    sequences of a weight-3 dump appear 3 times, held-out ones once, and bad weights are named."""
    from specdraft.training.distill_data import mixed_split, split_held_out

    assert mixed_split([10], None, 0.2, 0) == split_held_out(10, 0.2, 0)
    train_idx, held_idx = mixed_split([10, 4], [1, 3], 0.25, 0)
    tr0, he0 = split_held_out(10, 0.25, 0)
    tr1, he1 = split_held_out(4, 0.25, 0)
    assert held_idx == he0 + [10 + i for i in he1]
    assert sorted(train_idx) == sorted(tr0 + [10 + i for i in tr1] * 3)
    assert not set(train_idx) & set(held_idx)
    with pytest.raises(DistillError, match="one weight per dump"):
        mixed_split([10, 4], [1], 0.25, 0)
    with pytest.raises(DistillError, match="whole numbers"):
        mixed_split([10, 4], [1, 0], 0.25, 0)


def test_a_draft_distilled_in_bfloat16_is_exported_in_bfloat16_every_tensor(tmp_path):
    """Training keeps float32 master weights for the trained parameters only; the export is one dtype, the one the
    draft was loaded in (a checkpoint half float32, half bfloat16 under a config.json that says bfloat16 otherwise)."""
    import json

    from safetensors import safe_open

    from specdraft.core.config import DumpConfig
    from specdraft.testing import save_tiny_pair
    from specdraft.training.distill import run_distill
    from specdraft.training.dump import run_dump

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"a b {w}"},
                                                       {"role": "assistant", "content": f"c {w} d e"}]})
                              for w in "fghijklm") + "\n")
    run_dump(tdir, str(data), tmp_path / "dump", DumpConfig(teacher_format="topk", top_logprobs=8, dtype="float32"))
    cfg = DistillConfig(loss="soft_ce", lr=1e-3, max_steps=2, batch_size=2, held_out_fraction=0.25,
                        dtype="bfloat16", train="last_layers", train_last_layers=1)
    res = run_distill(tdir, ddir, tmp_path / "dump", tmp_path / "out", cfg, num_speculative_tokens=3)
    dtypes = set()
    for f in res.speculator.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            dtypes |= {st.get_slice(k).get_dtype() for k in st.keys()}  # noqa: SIM118 - safe_open has no __iter__
    assert dtypes == {"BF16"} and {p.dtype for p in res.model.parameters()} == {torch.bfloat16}
    assert res.metrics.moved_fraction > 0


def test_run_distill_trains_on_a_weighted_mix_of_a_forced_and_a_generated_dump(tmp_path):
    """Teacher-forced and target-written dumps of one target train together (TeacherMix): the training count is
    each dump's training share times its weight, both dumps are recorded, and a dump of another target (another
    head) is refused with the differing field named."""
    import json

    from specdraft.core.config import DumpConfig
    from specdraft.models.dump_reader import DumpError, TeacherDataset, TeacherMix
    from specdraft.testing import save_tiny_pair
    from specdraft.training.distill import run_distill
    from specdraft.training.dump import run_dump

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"a b {w}"},
                                                       {"role": "assistant", "content": f"c {w} d e"}]})
                              for w in "fghijklm") + "\n")
    run_dump(tdir, str(data), tmp_path / "forced", DumpConfig(answer_only=True, dtype="float32"))
    run_dump(tdir, f"{data}:0:4", tmp_path / "written", DumpConfig(answer_only=True, dtype="float32", generate=4))
    mix = TeacherMix([TeacherDataset(tmp_path / "forced"), TeacherDataset(tmp_path / "written")])
    assert mix.lengths == [8, 4] and len(mix) == 12
    assert mix.tokens(8)["id"] == TeacherDataset(tmp_path / "written").tokens(0)["id"]
    assert torch.equal(mix[9]["hidden"], TeacherDataset(tmp_path / "written")[1]["hidden"])
    cfg = DistillConfig(loss="tvd", lr=1e-3, max_steps=2, batch_size=2, held_out_fraction=0.25)
    res = run_distill(tdir, ddir, [tmp_path / "forced", tmp_path / "written"], tmp_path / "out", cfg,
                      dump_weights=[1, 2], num_speculative_tokens=3)
    assert res.metrics.train_sequences == 6 + 3 * 2  # 8 − 2 held out, (4 − 1) × weight 2
    assert res.metrics.held_out_sequences == 2 + 1
    assert res.training["dump"]["sequences_per_dump"] == [8, 4]
    assert res.training["dump"]["weights"] == [1, 2]
    # Another target (other weights, same tokenizer): its head differs, so the mix is refused.
    other, _ = save_tiny_pair(tmp_path / "models2", 96, seed=7)
    run_dump(other, str(data), tmp_path / "other", DumpConfig(answer_only=True, dtype="float32"))
    with pytest.raises(DumpError, match="head_fingerprint differ"):
        TeacherMix([TeacherDataset(tmp_path / "forced"), TeacherDataset(tmp_path / "other")])


def test_a_resume_into_checkpoints_of_another_loss_or_geometry_is_refused_naming_what_changed(setup, tmp_path):
    """Checkpoints in --out made with another loss, batch × accumulation, draft or dump would be resumed into a run
    they were not made for (the optimizer's moments, the sampler's position, a model of other weights): refused
    before training, naming the change; start over (resume=False) clears them and trains from step 0."""
    target, rows = setup
    cfg = DistillConfig(loss="tvd", lr=5e-3, max_steps=2, batch_size=2, save_steps=1, scheduler="constant", seed=0)
    train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], cfg, tmp_path, origin={"dump": ["dump-a"], "draft": "draft-a"})
    longer = cfg.model_copy(update={"max_steps": 3})  # more steps of the same run: resumes
    for change, origin, needle in (
            ({"loss": "soft_ce"}, {"dump": ["dump-a"], "draft": "draft-a"}, "loss: 'tvd' → 'soft_ce'"),
            ({"batch_size": 1, "gradient_accumulation_steps": 2}, {"dump": ["dump-a"], "draft": "draft-a"},
             "batch_size: 2 → 1"),
            ({}, {"dump": ["dump-b"], "draft": "draft-a"}, "dump: ['dump-a'] → ['dump-b']"),
            ({}, {"dump": ["dump-a"], "draft": "draft-b"}, "draft: 'draft-a' → 'draft-b'")):
        with pytest.raises(DistillError) as e:
            train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], longer.model_copy(update=change), tmp_path, origin=origin)
        assert needle in str(e.value) and "--no-resume" in str(e.value)
    again = train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], longer, tmp_path, origin={"dump": ["dump-a"], "draft": "draft-a"})
    assert again.resumed_from.endswith("checkpoint-2") and again.steps == 3
    fresh = train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], rows[4:], longer.model_copy(update={"loss": "soft_ce"}), tmp_path, resume=False, origin={"dump": ["dump-a"], "draft": "draft-a"})
    assert fresh.resumed_from is None and fresh.steps == 3


def test_the_held_out_split_keeps_every_prompt_on_one_side_across_the_dumps_of_a_mix():
    """Two dumps of the same prompts (teacher-forced and target-written), a prompt repeated in the file, a row one
    dump lost to truncation: no held-out sequence shares its prompt with a training one, and the counts say so."""
    from specdraft.training.distill_data import prompt_keyed_split

    def row(i, prompt, answer):
        ids = torch.tensor(prompt + answer)
        mask = torch.tensor([False] * (len(prompt) - 1) + [True] * len(answer) + [False])
        return {"id": f"p{i}", "input_ids": ids, "loss_mask": mask}

    prompts = [[5 + i, 6 + i, 7] for i in range(12)]
    forced = [row(i, p, [40, 41]) for i, p in enumerate(prompts)] + [row(99, prompts[3], [42, 43])]  # a repeat
    written = [row(i, p, [50 + i, 51]) for i, p in enumerate(prompts) if i != 7]  # row 7 truncated away
    train_idx, held_idx, counts = prompt_keyed_split([forced, written], [1, 2], 0.25, 0)
    items = forced + written

    def key(i):
        m = items[i]["loss_mask"]
        return tuple(items[i]["input_ids"][: int(m.nonzero()[0, 0]) + 1].tolist())

    held, trained = {key(i) for i in held_idx}, {key(i) for i in train_idx}
    assert held and trained and not held & trained
    assert counts == {"keyed_by": "prompt", "prompts": 12, "held_out_prompts": 3, "rows_sharing_a_prompt": 23,
                      "train_held_overlap": 0}
    assert len(held_idx) == sum(key(i) in held for i in range(len(items)))  # every row of a held prompt is held
    assert sorted(set(train_idx)) == [i for i in range(len(items)) if key(i) not in held]
    assert train_idx.count(len(forced)) == (2 if key(len(forced)) in trained else 0)  # dump weights still repeat


# ------------------------------------------------------------------------------ a sparse teacher's limits


def topk_rows(target, rows, k: int = 8):
    """The rows' teacher signal as a top-k dump stores it, from the dump's own code (float16 log-probs)."""
    from specdraft.core.config import DumpConfig
    from specdraft.data.sources import TokenSequence
    from specdraft.training.teacher import Teacher, teacher_items

    seqs = [TokenSequence(f"r{i}", r["input_ids"].tolist(), r["loss_mask"].tolist(), False) for i, r in enumerate(rows)]
    items = teacher_items(Teacher(target, V), seqs, DumpConfig(teacher_format="topk", top_logprobs=k, dtype="float32"))
    return [{k2: v for k2, v in it.items() if k2 != "id"} for it in items]


def full_alpha(target, draft, batch, serving=None):
    """Σ min(p̃, q̃) from the target's full logits (the value a sparse teacher should give), token-weighted."""
    from specdraft.core.sampling import filtered_probs

    with torch.no_grad():
        t = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        d = draft(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    p, q = (filtered_probs(x, *serving) if serving else x.softmax(-1) for x in (t, d))
    mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    return float(torch.minimum(p, q).sum(-1)[mask].mean())


def test_a_topk_teacher_logs_the_filtered_alpha_at_the_serving_settings(setup):
    """With a serving filter inside the stored k (top_k 4 ≤ k = 8, temperature 0.8, top-p 0.9) the logged α is
    Σ min(p̃, q̃) of both filtered distributions, equal to the full teacher's (exact but for the float16 storage),
    and its bound is 0 — not the unfiltered Σ min(p̂, q) it used to log under that name."""
    from specdraft.training.distill import alpha_definition

    target, rows = setup
    draft = perturbed(target, 0.05)
    batch = collate(topk_rows(target, rows[:3]))
    serving = (0.8, 4, 0.9)
    m = DistillModel(draft, TeacherHead(None, V, width=V), DistillConfig(loss="soft_ce", temperature=0.8, top_k=4, top_p=0.9))
    with torch.no_grad():
        out = m(**batch)
    filtered, unfiltered = full_alpha(target, draft, batch, serving), full_alpha(target, draft, batch)
    assert abs(filtered - unfiltered) > 0.05  # the two definitions are far apart here: the test can tell them
    assert float(out["alpha"]) == pytest.approx(filtered, abs=2e-3)
    assert float(out["alpha_bound"]) == 0.0
    assert alpha_definition(m.config_, "topk").startswith("Σ min(p̃, q̃), p̃ and q̃ after the serving filter "
                                                          "(temperature 0.8, top-k 4, top-p 0.9), renormalised")
    # tvd_deploy reads the same filtered teacher: its 1 − loss is that α too.
    deploy = DistillModel(draft, TeacherHead(None, V, width=V), DistillConfig(loss="tvd_deploy", temperature=0.8, top_k=4, top_p=0.9))
    with torch.no_grad():
        assert 1 - float(deploy(**batch)["loss"]) == pytest.approx(filtered, abs=2e-3)


def test_a_topk_teacher_under_plain_serving_states_the_bound_of_its_alpha(setup):
    """At temperature 1 with no filter the tail is completed uniformly: the logged α is within the logged bound
    (the mean leftover mass) of the full teacher's α, and that bound is the stored leftover mass."""
    target, rows = setup
    draft = perturbed(target, 0.05)
    items = topk_rows(target, rows[:3], k=4)
    batch = collate(items)
    with torch.no_grad():
        out = DistillModel(draft, TeacherHead(None, V, width=V), DistillConfig(loss="soft_ce"))(**batch)
    mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    leftover = float(batch["leftover_logmass"].exp()[mask].mean())
    assert leftover > 0.01  # a tail worth bounding
    assert float(out["alpha_bound"]) == pytest.approx(leftover, rel=1e-5)
    assert abs(float(out["alpha"]) - full_alpha(target, draft, batch)) <= float(out["alpha_bound"])


@pytest.mark.parametrize("serving", [{"temperature": 0.7}, {"top_k": 16}, {"top_p": 0.9},
                                     {"temperature": 0.7, "top_p": 0.9}])
def test_a_topk_teacher_refuses_serving_settings_it_cannot_compute(setup, serving):
    """A temperature ≠ 1 or a top-p over the whole vocabulary re-tempers or cuts into the unknown tail, a top-k past
    the stored k needs ids it does not hold: refused, naming the dump's k, the settings and the fixes."""
    target, rows = setup
    batch = collate(topk_rows(target, rows[:2]))
    cfg = DistillConfig(loss="soft_ce", **serving)
    with pytest.raises(DistillError, match=r"top-k dump \(k = 8\).*--serving-top-k between 1 and 8.*--teacher-format hidden"):
        DistillModel(perturbed(target, 0.1), TeacherHead(None, V, width=V), cfg)(**batch)
    s = cfg.serving
    assert f"temperature {s.temperature}, top-k {s.top_k}, top-p {s.top_p}" in cfg.sparse_teacher_problem(8)
    # The same temperature and top-p become exact once a top-k inside the stored k bounds the support.
    assert DistillConfig(**{**serving, "top_k": 8}).sparse_teacher_problem(8) is None


def test_run_distill_refuses_a_topk_dump_it_cannot_serve_before_loading_the_draft(tmp_path, monkeypatch):
    """run_distill reads the dump's manifest first: temperature 0.7 on a top-k dump stops before any weight loads,
    and a pipeline config pairing a top-k dump with such settings is refused at construction."""
    import json

    from specdraft.core.config import DumpConfig
    from specdraft.run.pipeline import make_config
    from specdraft.testing import save_tiny_pair
    from specdraft.training.distill import run_distill
    from specdraft.training.dump import run_dump

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"a b {w}"},
                                                       {"role": "assistant", "content": f"c {w} d"}]})
                              for w in "fgh") + "\n")
    run_dump(tdir, str(data), tmp_path / "dump", DumpConfig(teacher_format="topk", top_logprobs=8, dtype="float32"))
    patch_everywhere(monkeypatch, "specdraft.models.loading", "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(DistillError, match=r"k = 8\).*temperature 0\.7.*--teacher-format hidden"):
        run_distill(tdir, ddir, tmp_path / "dump", tmp_path / "out", DistillConfig(temperature=0.7, max_steps=1))
    with pytest.raises(ValueError, match=r"k = 8\).*temperature 0\.7"):
        make_config("tiny", dump={"teacher_format": "topk", "top_logprobs": 8}, distill={"temperature": 0.7})


def test_run_distill_refuses_a_dump_longer_than_the_drafts_window_before_training(tmp_path, monkeypatch):
    """A draft of 16 positions (rotary: past them it would train silently on positions it never saw) and a dump
    whose longest sequence is longer: refused before training, naming the sequence, its length and the window."""
    import json

    from specdraft.core.config import DumpConfig
    from specdraft.models.dump_reader import TeacherDataset
    from specdraft.testing import save_tiny_pair
    from specdraft.training.distill import run_distill
    from specdraft.training.dump import run_dump

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    cfg_path = tmp_path / "models" / "draft" / "config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | {"max_position_embeddings": 16}))
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "a b " * n},
                                                       {"role": "assistant", "content": "c d"}]})
                              for n in (1, 12)) + "\n")
    run_dump(tdir, str(data), tmp_path / "dump", DumpConfig(teacher_format="topk", top_logprobs=8, dtype="float32"))
    ds = TeacherDataset(tmp_path / "dump")
    longest = max(len(ds.tokens(i)["input_ids"]) for i in range(len(ds)))
    monkeypatch.setattr("specdraft.training.distill.train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(DistillError, match=r"longest sequence '[\w:-]+' \((\d+) tokens\) exceeds the draft's context "
                                           r"window \(16\)") as err:
        run_distill(tdir, ddir, tmp_path / "dump", tmp_path / "out", DistillConfig(max_steps=1, batch_size=1))
    assert int(err.value.args[0].split("(")[1].split(" ")[0]) == longest > 16


def test_row_lr_trains_the_rows_in_their_own_group_and_untie_head_lets_the_head_leave_the_embedding(setup, tmp_path):
    from transformers import TrainerCallback

    target, rows = setup
    draft = tiny_model("llama", V, seed=1, layers=2, tie_word_embeddings=True)
    assert draft.lm_head.weight is draft.model.embed_tokens.weight
    emb0 = draft.model.embed_tokens.weight.detach().clone()
    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kw):
            seen.append([(g["lr"], sum(p.numel() for p in g["params"])) for g in optimizer.param_groups])

    cfg = DistillConfig(loss="nla", lr=1e-3, row_lr=2e-2, untie_head=True, max_steps=2, batch_size=2,
                        scheduler="linear", warmup_ratio=0.0, held_out_fraction=0.0, save_steps=100)
    out = train(draft, TeacherHead(target.lm_head.weight, V), rows, None, cfg, tmp_path, resume=False, callbacks=[Watch()])
    d = out.draft
    head, emb = d.lm_head.weight, d.model.embed_tokens.weight
    assert head is not emb and d.config.tie_word_embeddings is False
    rows_n = 2 * V * emb.shape[1]  # the embedding and the head, now two matrices
    body_n = sum(p.numel() for p in d.parameters()) - rows_n
    # Every body parameter at lr, both row matrices at row_lr, at each step (after the scheduler's step: the
    # linear schedule scales both groups alike, 1/2 then 0 of the peak); the Trainer's own weight-decay split of
    # the body (norms apart) is kept.
    for step, scale in zip(seen, (0.5, 0.0), strict=True):
        assert sum(n for _, n in step) == body_n + rows_n
        rows_groups = [(lr, n) for lr, n in step if n == rows_n]
        assert len(rows_groups) == 1 and rows_groups[0][0] == pytest.approx(2e-2 * scale)
        assert all(lr == pytest.approx(1e-3 * scale) for lr, n in step if n != rows_n)
    # Both rows moved, apart: the head is no longer the embedding (untied), and each left its start.
    assert not torch.equal(head, emb)
    assert not torch.equal(emb.detach(), emb0) and not torch.equal(head.detach(), emb0)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("mode", "dtype"), [(m, "float32") for m in get_args(TrainWhat)]
                         + [("last_layers", "bfloat16")])
def test_every_training_mode_interrupted_and_resumed_ends_with_the_weights_of_an_uninterrupted_run(
        setup, tmp_path, mode, dtype):
    """Each --train mode checkpoints what it trains (LoRA: its adapters alone; bfloat16 weights: float32 master
    weights beside the frozen bfloat16 ones) and resumes from it: two steps, a stop, two more from checkpoint-2 give
    the weights four steps in one go give (same seed, sampler and RNG state restored by the Trainer; same CPU
    arithmetic, so equal to float32 rounding)."""
    target, rows = setup  # train=lora needs peft: in the dev extra, so CI runs this rather than skips it
    cfg = DistillConfig(loss="tvd", lr=5e-3, max_steps=4, batch_size=2, save_steps=2, scheduler="constant", seed=0,
                        train=mode, train_last_layers=1, lora_r=2, dtype=dtype)

    def draft():
        return perturbed(target, 0.15).to(getattr(torch, dtype))

    whole = train(draft(), TeacherHead(target.lm_head.weight, V), rows[:4], None, cfg, tmp_path / "whole")
    first = train(draft(), TeacherHead(target.lm_head.weight, V), rows[:4], None, cfg.model_copy(update={"max_steps": 2}), tmp_path / "split")
    assert first.steps == 2
    resumed = train(draft(), TeacherHead(target.lm_head.weight, V), rows[:4], None, cfg, tmp_path / "split")
    assert resumed.resumed_from.endswith("checkpoint-2") and resumed.steps == 4
    want, got, start = _weights(whole.draft), _weights(resumed.draft), _weights(draft())
    assert set(got) == set(want) == set(start)
    assert any(not torch.equal(want[k], start[k]) for k in want)  # four steps moved the weights…
    for k in want:  # …and the resumed run moved them to the same place
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


def test_bfloat16_weights_train_on_float32_master_weights_so_norms_move_at_a_small_lr(setup, tmp_path):
    """A draft loaded in bfloat16: AdamW stepping its bfloat16 parameters rounds an lr-sized update (1e-5) away
    below half a unit in the last place (~0.002 near 1), so norm weights near 1 never moved. Float32 master weights
    keep every update; moved_fraction says what share of the trainable weights changed (embedding rows of tokens
    the batches never hold have no gradient and stay put, hence not all)."""
    target, rows = setup
    draft = perturbed(target, 0.15).to(torch.bfloat16)
    norms = {n: p.detach().float().clone() for n, p in draft.named_parameters() if "norm" in n}
    cfg = DistillConfig(loss="tvd", lr=1e-5, max_steps=3, batch_size=2, save_steps=100, scheduler="constant",
                        seed=0, dtype="bfloat16")
    res = train(draft, TeacherHead(target.lm_head.weight, V), rows[:4], None, cfg, tmp_path)
    params = dict(res.draft.named_parameters())
    still = [n for n, v in norms.items() if torch.equal(params[n].detach().float(), v)]
    assert norms and still == []
    assert res.precision == "bf16-autocast" and "master weights" in res.precision_reason
    assert {p.dtype for p in res.draft.parameters()} == {torch.float32}  # train=all: every weight is trained
    assert 0.5 < res.moved_fraction < 1


def test_last_layers_also_trains_the_final_norm_of_every_architecture_it_accepts():
    """The final norm normalises the last layer's output for the head; it sits at model.norm (Llama, Qwen2,
    Mistral, Gemma), transformer.ln_f (GPT-2) or model.decoder.final_layer_norm (OPT)."""
    from transformers import AutoModelForCausalLM, OPTConfig

    from specdraft.testing import tiny_config
    from specdraft.training.distill import select_trainable

    archs = ["llama", "qwen2", "mistral", "gemma", "gemma2", "gemma3", "gpt2", "opt"]
    cfg = DistillConfig(train="last_layers", train_last_layers=1)
    for arch in archs:
        if arch == "opt":
            conf = OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, ffn_dim=64,
                             word_embed_proj_dim=32, max_position_embeddings=64)
        else:
            conf = tiny_config(arch, V, layers=3)
        draft, n = select_trainable(AutoModelForCausalLM.from_config(conf), cfg)
        trained = {k for k, p in draft.named_parameters() if p.requires_grad}
        norm = {"gpt2": "transformer.ln_f.", "opt": "model.decoder.final_layer_norm."}.get(arch, "model.norm.")
        last = {"gpt2": "transformer.h.2.", "opt": "model.decoder.layers.2."}.get(arch, "model.layers.2.")
        assert any(k.startswith(norm) for k in trained), arch
        assert all(k.startswith((norm, last)) for k in trained), (arch, sorted(trained))
        assert n == sum(p.numel() for k, p in draft.named_parameters() if k in trained)


def test_last_layers_refuses_a_draft_whose_final_norm_it_cannot_find():
    from specdraft.training.distill import select_trainable

    draft = tiny_model("llama", V, layers=2)
    del draft.model.norm
    with pytest.raises(DistillError, match=r"final norm of LlamaForCausalLM.*--train all or lora"):
        select_trainable(draft, DistillConfig(train="last_layers"))


def test_a_position_is_a_cut_tie_when_the_serving_filter_keeps_the_last_stored_value():
    """The serving filter keeps every id tied with its k-th value; a top-k dump keeps exactly k. Where the
    filter, on the stored values, keeps the smallest of them, unstored ids tied with it may be missing: a cut
    tie. Always so at a serving top-k equal to the stored k; the same for float16 values (older dumps)."""
    from specdraft.training.distill_trainer import cut_ties

    lp = torch.tensor([[0.0, -1.0, -1.0, -1.0],    # the tie at the 2nd value runs to the last stored one
                       [0.0, -1.0, -1.0, -2.0],    # the tie ends inside the stored k
                       [0.0, -1.0, -2.0, -3.0],
                       [0.0, -6.0, -6.0, -6.0]])
    assert cut_ties(lp, DistillConfig(top_k=2)).tolist() == [True, False, False, True]
    assert cut_ties(lp.half(), DistillConfig(top_k=2)).tolist() == [True, False, False, True]
    assert cut_ties(lp, DistillConfig(top_k=4)).all()  # no margin past the cut
    # Top-p 0.5 stops at the first id where it holds half the mass; in row 0 it holds 47%: the tie is kept whole.
    assert cut_ties(lp, DistillConfig(top_k=4, top_p=0.5)).tolist() == [True, False, False, False]
    assert not cut_ties(lp, DistillConfig()).any()  # plain serving: no cut


def test_alpha_from_a_topk_teacher_is_called_exact_only_when_no_cut_tie_was_counted():
    from specdraft.training.distill import alpha_definition

    cfg = DistillConfig(top_k=4)
    none = {"positions": 0, "of": 50, "share": 0.0, "stored_dtype": "float32"}
    some = {"positions": 5, "of": 50, "share": 0.1, "stored_dtype": "float16"}
    assert "exact from the dump's top-k" in alpha_definition(cfg, "topk", none)
    for cut in (some, None):
        text = alpha_definition(cfg, "topk", cut)
        assert "not exact" in text and "exact from" not in text
    assert "not exact at 5 of 50 trained positions (10.0%" in alpha_definition(cfg, "topk", some)
    assert "float16" in alpha_definition(cfg, "topk", some)
    assert "α is within ±alpha_bound there" in alpha_definition(cfg, "topk", some)


def test_run_distill_at_a_serving_top_k_equal_to_the_stored_k_records_every_position_as_a_cut_tie(tmp_path):
    """Serving top-k 8 on a dump of k = 8: every trained position's cut reaches the last stored value, so
    training.json counts them all under cut_ties and the α's definition says it is not exact there."""
    import json

    from specdraft.core.config import DumpConfig
    from specdraft.testing import save_tiny_pair
    from specdraft.training.distill import run_distill
    from specdraft.training.dump import run_dump

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"a b {w}"},
                                                       {"role": "assistant", "content": f"c {w} d"}]})
                              for w in "fghi") + "\n")
    run_dump(tdir, str(data), tmp_path / "dump", DumpConfig(teacher_format="topk", top_logprobs=8, dtype="float32"))
    cfg = DistillConfig(loss="soft_ce", top_k=8, max_steps=1, batch_size=2, held_out_fraction=0.25)
    run_distill(tdir, ddir, tmp_path / "dump", tmp_path / "out", cfg)
    metrics = json.loads((tmp_path / "out" / "training.json").read_text())["metrics"]
    cut = metrics["cut_ties"]
    assert cut["positions"] == cut["of"] > 0 and cut["share"] == 1.0
    assert (cut["stored_k"], cut["serving_top_k"], cut["stored_dtype"]) == (8, 8, "float32")
    assert f"not exact at {cut['of']} of {cut['of']} trained positions" in metrics["alpha_definition"]


def test_the_trainer_logs_as_one_readable_line_per_step_never_a_raw_dict(setup, tmp_path, capsys):
    """Off a terminal the Trainer's PrinterCallback printed ``{'loss': '0.5123', 'grad_norm': ...}`` per step."""
    from specdraft.training.distill_trainer import log_line

    target, rows = setup
    cfg = DistillConfig(loss="tvd", lr=5e-3, max_steps=2, batch_size=2, save_steps=2, scheduler="constant", seed=0)
    train(perturbed(target, 0.15), TeacherHead(target.lm_head.weight, V), rows[:4], None, cfg, tmp_path)
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps[:2]] == ["1/2", "2/2"]
    assert "loss " in steps[0] and " lr " in steps[0]
    assert "{'" not in out and "total_flos" not in out
    assert log_line({"loss": 0.51234567, "learning_rate": 3e-4, "epoch": 0.5, "total_flos": 1.0}, 3, 10) == \
        "step 3/10  loss 0.5123  lr 3.0e-04"


class _FixedLogits(torch.nn.Module):
    """A draft whose logits are given: every position reads ``logits [V]``."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits
        self.head = torch.nn.Linear(1, logits.shape[-1], bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.logits.expand(*input_ids.shape, -1))


def test_a_tie_at_the_cut_of_a_topk_teacher_served_at_its_k_bounds_the_logged_alpha():
    """p = [.4, .2, .1, .1, .1, .05, .03, .02]; the dump stores its top 3 (.4, .2, .1) and .3 left over; serving
    top-k 3 keeps every id tied with the 3rd value, so the target's filter keeps five ids and the stored three
    alone miss two. A draft equal to the target has α = 1 exactly; the logged α, from the stored ids, is 7/9, and
    its bound is what the leftover mass could hold at the cut value: m = .3 / .1 = 3 more ids of the last stored
    id's filtered share 1/7, so m/7 / (1 + m/7) = 0.3 ≥ 2/9, the error."""
    p = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.03, 0.02])
    ids = torch.zeros(1, 2, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "topk_ids": torch.tensor([0, 1, 2]).expand(1, 2, 3), "topk_logprobs": p[:3].log().expand(1, 2, 3),
             "leftover_logmass": torch.full((1, 2), 0.3).log()}
    cfg = DistillConfig(loss="tvd_deploy", top_k=3)
    with torch.no_grad():
        out = DistillModel(_FixedLogits(p.log()), TeacherHead(None, 8, width=8), cfg)(**batch)
    exact = 1.0  # the draft is the target
    assert float(out["alpha"]) == pytest.approx(7 / 9, abs=1e-5)  # the stored ids alone: not the exact value
    assert float(out["alpha_bound"]) == pytest.approx(0.3, abs=1e-5)
    assert abs(float(out["alpha"]) - exact) <= float(out["alpha_bound"])
    # Without a leftover mass no id can tie beyond the stored ones: the α is exact and its bound 0.
    exact_batch = batch | {"topk_logprobs": (p[:3] / 0.7).log().expand(1, 2, 3),
                           "leftover_logmass": torch.full((1, 2), float("-inf"))}
    q = torch.cat([p[:3] / 0.7, torch.zeros(5)])
    with torch.no_grad():
        out = DistillModel(_FixedLogits(q.log()), TeacherHead(None, 8, width=8), cfg)(**exact_batch)
    assert float(out["alpha"]) == pytest.approx(1.0, abs=1e-5) and float(out["alpha_bound"]) == 0.0


def test_a_bfloat16_draft_whose_update_rounds_away_as_saved_says_how_much_and_how_to_keep_it(tmp_path):
    """At a tiny lr the float32 master weights move, but rounded back to bfloat16 for the export most of the update
    is lost: the metrics report the share moved as saved, equal to the share of the exported weights that differ
    from the draft as loaded, and a warning names it and the flag that keeps float32. Saved in float32 the update
    survives whole and nothing is said."""
    import json
    import warnings

    from specdraft.core.config import DumpConfig
    from specdraft.models.loading import load_model
    from specdraft.testing import save_tiny_pair
    from specdraft.training.distill import run_distill
    from specdraft.training.dump import run_dump

    tdir, ddir = save_tiny_pair(tmp_path / "models", 96)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"a b {w}"},
                                                       {"role": "assistant", "content": f"c {w} d e"}]})
                              for w in "fghijklm") + "\n")
    run_dump(tdir, str(data), tmp_path / "dump", DumpConfig(teacher_format="topk", top_logprobs=8, dtype="float32"))
    cfg = DistillConfig(loss="soft_ce", lr=2e-5, max_steps=2, batch_size=2, held_out_fraction=0.25,
                        dtype="bfloat16", scheduler="constant")
    with pytest.warns(UserWarning, match=r"specdraft distill: .* of the trained weights moved in training, "
                                         r".* as saved in bfloat16.*--dtype float32") as caught:
        res = run_distill(tdir, ddir, tmp_path / "dump", tmp_path / "out", cfg)
    m = res.metrics.to_dict()
    loaded, _ = load_model(ddir, dtype="bfloat16", device="cpu")
    start = dict(loaded.named_parameters())
    saved = dict(res.model.named_parameters())
    differ = sum(int((saved[n].detach() != start[n].detach()).sum()) for n in saved)
    assert m["moved_fraction_saved"] == pytest.approx(differ / sum(p.numel() for p in saved.values()))
    assert m["moved_fraction_saved"] < m["moved_fraction"] / 2 and m["saved_dtype"] == "bfloat16"
    assert f"{m['moved_fraction_saved']:.1%}" in str(caught[0].message)
    import io

    from rich.console import Console

    from specdraft.cli import render

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(render, "console", Console(file=out, width=400))
        render.print_distill(res)
    page = out.getvalue()
    assert (f"trained weights changed: {m['moved_fraction']:.1%} in training, {m['moved_fraction_saved']:.1%} as "
            "saved in bfloat16") in page
    assert "warning: specdraft distill:" in page and "--dtype float32" in page
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning: the float32 export keeps the update
        kept = run_distill(tdir, ddir, tmp_path / "dump", tmp_path / "out32", cfg, save_dtype="float32")
    assert kept.metrics.moved_fraction_saved == kept.metrics.moved_fraction > 0.5
