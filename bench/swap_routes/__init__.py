"""Routes for a draft re-indexed into the target's tokenizer (SmolLM2-135M-Instruct → Qwen2.5-Coder-1.5B), each
measured by replay on the same target answers (bench/results/distill-routes-swap.json):

    python bench/swap_routes/answers.py                      # the target's greedy answers (held-out code, chat, train)
    python bench/swap_routes/routes.py --input mean --output first   # route a: segmentation-aware initialisation
    python bench/swap_routes/route_b.py --no-answers --output mean --steps 150   # route b: the head on cached states
    python bench/swap_routes/diag.py                         # the swap diagnostic (specdraft.models.segmentation)

Work files go to $SWAP_ROUTES_WORK (default runs/swap-routes).
"""
