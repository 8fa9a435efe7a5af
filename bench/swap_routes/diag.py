import json
from pathlib import Path

import torch
from lib import *

from specdraft.segmentation import swap_diagnostic
from specdraft.vocab import load_tokenizer_view, mapping_from_views

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
