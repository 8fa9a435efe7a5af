"""Scale-out, proven on CPU: two processes (gloo) give what one process gives.

* A 2-rank data-parallel teacher dump (``torchrun --nproc_per_node 2 -m specdraft.cli dump``) holds the same
  examples, in the same order, as a 1-rank dump — with *sampled* generation, where a different batch split
  would draw different answers.
* Distillation under ``accelerate launch --num_processes 2`` at batch 2 per rank logs the same losses and the
  same held-out curve as one process at batch 4 (the same global batch), and rank 0 alone writes the export.

Each launch is a subprocess on tiny models (one CPU thread per rank, no GPU visible, a free rendezvous port).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdraft
from specdraft.core.config import DistillConfig, DumpConfig
from specdraft.models.dump_reader import TeacherDataset
from specdraft.testing import save_tiny_pair
from specdraft.training.distill import run_distill
from specdraft.training.dump import run_dump

# Sampled answers (temperature 1) and an odd count with batch 2: a split that ignored batch boundaries would
# give rank 1 other batches, other sampling seeds and so other examples.
DUMP = DumpConfig(teacher_format="hidden", hidden_dtype="float32", dtype="float32", batch_size=2, generate=6,
                  temperature=1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv: list[str], what: str, timeout: int = 180) -> None:
    """Run ``argv`` with the package on the path, CPU only, one thread per process; fail with its output."""
    env = dict(os.environ, PYTHONPATH=str(Path(specdraft.__file__).parents[1]), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what} did not finish in {timeout} s: {' '.join(argv)}\n{exc.stdout or ''}{exc.stderr or ''}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(argv)}\n--- output (tail) ---\n"
                    f"{(proc.stdout + proc.stderr)[-4000:]}")


@pytest.fixture(scope="module")
def pair_and_dump(tmp_path_factory):
    """Tiny target/draft, 12 chat examples, and their 1-rank dump (in this process)."""
    root = tmp_path_factory.mktemp("scale")
    tdir, ddir = save_tiny_pair(root / "models", 96)
    data = root / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"a b {w} " * (1 + i % 3)},
        {"role": "assistant", "content": f"c {w} d e " * (1 + i % 4)}]}) for i, w in enumerate("fghijklmnopq")) + "\n")
    run_dump(tdir, f"{data}:0:11", root / "dump1", DUMP)
    return root, tdir, ddir, data


def test_two_rank_dump_holds_the_examples_of_one_rank(pair_and_dump):
    root, tdir, _, data = pair_and_dump
    _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
             str(_free_port()), "-m", "specdraft.cli", "dump", "--out", str(root / "dump2"), "--target", tdir,
             "--prompts", f"{data}:0:11", "--teacher-format", "hidden", "--hidden-dtype", "float32", "--dtype", "float32",
             "--batch-size", "2", "--generate", "6", "--temperature", "1.0"],
            "the 2-rank dump (torchrun)")
    one, two = TeacherDataset(root / "dump1", verify=True), TeacherDataset(root / "dump2", verify=True)
    assert two.manifest["world_size"] == 2 and {s["rank"] for s in two.manifest["shards"]} == {0, 1}, \
        "the launch did not run two ranks"
    assert len(one) == len(two) == 11, f"1 rank dumped {len(one)} sequences, 2 ranks {len(two)}"
    for i in range(len(one)):
        a, b = one[i], two[i]
        assert a["id"] == b["id"], f"row {i}: example {a['id']} (1 rank) vs {b['id']} (2 ranks): order differs"
        assert torch.equal(a["input_ids"], b["input_ids"]), (
            f"row {i} ({a['id']}): the 2-rank dump wrote other tokens (sampled answers differ):\n"
            f"  1 rank : {a['input_ids'].tolist()}\n  2 ranks: {b['input_ids'].tolist()}")
        assert torch.equal(a["loss_mask"], b["loss_mask"]), f"row {i} ({a['id']}): loss masks differ"
        torch.testing.assert_close(a["hidden"], b["hidden"], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, i=i: f"row {i}: teacher hidden states differ: {m}")


def test_two_process_distillation_logs_the_losses_of_one_process(pair_and_dump):
    root, tdir, ddir, _ = pair_and_dump
    cfg = DistillConfig(loss="tvd", lr=1e-2, max_steps=3, batch_size=4, scheduler="constant",
                        held_out_fraction=0.25, eval_steps=1, save_steps=100)
    single = run_distill(tdir, ddir, root / "dump1", root / "one", cfg, resume=False).metrics.to_dict()
    _launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
             "--num_machines", "1", "--main_process_port", str(_free_port()), "--mixed_precision", "no",
             "--dynamo_backend", "no",
             # With no GPU visible, accelerate's multi-process launcher (torchrun underneath) gives each rank the
             # CPU, and the Trainer (use_cpu) joins them with gloo.
             "-m", "specdraft.cli", "distill", "--target", tdir, "--draft", ddir, "--dump", str(root / "dump1"),
             "--out", str(root / "two"), "--loss", "tvd", "--lr", "1e-2", "--max-steps", "3", "--batch-size", "2",
             "--scheduler", "constant", "--held-out-fraction", "0.25", "--eval-steps", "1", "--save-steps", "100",
             "--no-resume"],
            "distillation under accelerate launch --num_processes 2")
    training = json.loads((root / "two" / "training.json").read_text())
    double = training["metrics"]
    assert double["processes"] == 2 and single["processes"] == 1, "the launch did not run two processes"
    assert double["global_batch_sequences"] == single["global_batch_sequences"] == 4
    losses_1 = [h["loss"] for h in json.loads((root / "one" / "training.json").read_text())["history"] if "loss" in h]
    losses_2 = [h["loss"] for h in training["history"] if "loss" in h]
    assert len(losses_1) == len(losses_2) == 3
    assert losses_2 == pytest.approx(losses_1, rel=1e-4), (
        f"per-step training losses differ between 1 process (batch 4) and 2 processes (batch 2 each): "
        f"{losses_1} vs {losses_2}")
    curve_1 = [(p["step"], p["eval_alpha"], p["eval_loss"]) for p in single["curve"]]
    curve_2 = [(p["step"], p["eval_alpha"], p["eval_loss"]) for p in double["curve"]]
    assert [c[0] for c in curve_2] == [c[0] for c in curve_1] == [0, 1, 2, 3]
    for (s, a1, l1), (_, a2, l2) in zip(curve_1, curve_2):
        assert (a2, l2) == pytest.approx((a1, l1), rel=1e-4), f"held-out α/loss at step {s} differ: {a1, l1} vs {a2, l2}"
    assert (root / "two" / "speculator" / "config.json").is_file()
    assert not list((root / "two").glob(".tmp-*")), "a rank left a half-written export behind"
