"""Route: more code contexts at no teacher cost — train the predictions inside the user's prompt too.

An answer-only dump already holds the target's teacher signal at every position of each sequence (the dump's
position grid is the whole sequence; only its ``loss_mask`` is answer-only). With ``MASK=prompt`` the mask read
by distillation is widened to every prediction after ``<|im_start|>user\\n`` (the shared system prompt left out):
the target's p over the human-written HumanEval stubs and MT-Bench questions, three times the answer positions.
Everything else is ``bench_distill_curve.py`` on the same stages (its flags; ``MASK=answer`` is that script).

    MASK=prompt python bench/swap_routes/prompt_mask.py --work RUN --steps 10 --every 5 --result-name NAME
"""

import os
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "src"))

from specdraft.models import dump_reader

MASK = os.environ.get("MASK", "answer")
IM_START = 151644  # Qwen2's <|im_start|>: the default preset's target
_tokens = dump_reader.TeacherDataset._tokens


def _widened(self, i):
    item, rest = _tokens(self, i)
    if MASK == "prompt":
        ids = item["input_ids"]
        starts = (ids == IM_START).nonzero().flatten().tolist()
        first = starts[1] + 2 if len(starts) > 1 else 0  # after "<|im_start|>user\n"
        m = torch.zeros_like(item["loss_mask"])
        m[first:len(ids) - 1] = True
        item["loss_mask"] = m | item["loss_mask"]
    return item, rest


dump_reader.TeacherDataset._tokens = _widened

if __name__ == "__main__":
    import bench_distill_curve

    bench_distill_curve.main(sys.argv[1:])
