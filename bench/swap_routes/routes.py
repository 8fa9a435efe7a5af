import argparse
import json
import time
from pathlib import Path

import torch
from lib import *

from specdraft.models.tokenizer_view import load_tokenizer_view
from specdraft.models.vocab import _draft_pieces, mapping_from_views


def seg_init(model, ttok, input_mode="mean", output_mode="first"):
    """Untie; non-twin target rows: input from pieces (mean|last), output from pieces (first|mean)."""
    t = load_tokenizer_view(resolve(TARGET), None, "target"); d = load_tokenizer_view(resolve(DRAFT), None, "draft")
    t.config_vocab = 151936
    mapping = mapping_from_views(t, d)
    orig, _ = load_model(DRAFT, dtype="float32", device="cpu")
    E = orig.get_input_embeddings().weight.detach()
    d_rows = min(d.real, E.shape[0])
    t2d = mapping.target_to_draft[:151936]
    missing = ((t2d < 0) & (torch.arange(151936) < t.real)).nonzero().squeeze(-1).tolist()
    ids, flat, offsets = _draft_pieces(t, d, missing, d_rows)
    untie(model)
    ends = offsets.tolist()[1:] + [len(flat)]
    first = flat[offsets]; last = flat[torch.tensor(ends) - 1]
    idt = torch.tensor(ids)
    with torch.no_grad():
        if input_mode == "last":
            model.get_input_embeddings().weight[idt] = E[last]
        if output_mode == "first":
            model.get_output_embeddings().weight[idt] = E[first]
    return model, mapping

if __name__ == "__main__":
    ap = argparse.ArgumentParser(); ap.add_argument("--input", default="mean"); ap.add_argument("--output", default="mean")
    a = ap.parse_args()
    torch.set_num_threads(2)
    m, ttok, rep = swapped()
    if a.input != "mean" or a.output != "mean":
        m, _ = seg_init(m, ttok, a.input, a.output)
    res = {}
    for name in [n for n in ("code", "chat") if os.path.exists(f"{W}/answers-{n}.json")]:
        t0 = time.time(); r, rows = acceptance(m, name); res[name] = {"acceptance": r, "rows": rows, "s": time.time() - t0}
        print(a, name, round(r, 4), round(time.time() - t0, 1), "s", flush=True)
    Path(f"{W}/init-{a.input}-{a.output}.json").write_text(json.dumps(res))
