"""specdraft — speculative decoding with an independent draft model.

Notation, used everywhere in this package:

* **target** (verifier): the large model whose outputs must not change; its next-token distribution is **p**.
* **draft**: the small model that proposes tokens; its distribution is **q**.
* **γ** (``num_speculative_tokens``): draft tokens proposed per round, verified by one target pass.
* **α** = Σ_x min(p(x), q(x)) = 1 − TV(p, q): the probability that a drafted token is accepted under
  speculative sampling (Leviathan et al. 2023, §3.1; Chen et al. 2023).

Heavy modules (torch, transformers) are imported lazily by the submodules that need them.
"""

__version__ = "0.1.0"
