import json
from pathlib import Path

import torch
from lib import *

from specdraft.models.segmentation import SegmentationReport, diagnose, draft_answer_top1
from specdraft.models.tokenizer_view import load_tokenizer_view
from specdraft.models.vocab import mapping_from_views


def swap_diagnostic(draft, target_tokenizer, has_twin, prompts, answers, top: int = 50) -> SegmentationReport:
    """:func:`specdraft.models.segmentation.diagnose` of a swapped ``draft`` over the target's ``answers`` to ``prompts``
    (ids of the target's tokenizer), its argmaxes from :func:`specdraft.models.segmentation.draft_answer_top1`."""
    top1 = draft_answer_top1(draft, prompts, answers)
    return diagnose(target_tokenizer, has_twin, answers, top1, [p[-1] for p in prompts], top=top)

torch.set_num_threads(2)
m, ttok, rep = swapped()
t = load_tokenizer_view(resolve(TARGET), None, "target"); d = load_tokenizer_view(resolve(DRAFT), None, "draft"); t.config_vocab = 151936
has = (mapping_from_views(t, d).target_to_draft >= 0).tolist()
m.to(torch.bfloat16)
out = {}
for name in [n for n in ("code", "chat") if os.path.exists(f"{W}/answers-{n}.json")]:
    P, A = answers(name)
    r = swap_diagnostic(m, ttok, has, P, A).to_dict(); out[name] = r
    print(name, r["without_twin_share"], r["agreement"], r["kinds"], r["verdict"], r["top_without_twin"][:15], flush=True)
Path(f"{W}/diag.json").write_text(json.dumps(out, indent=1))
