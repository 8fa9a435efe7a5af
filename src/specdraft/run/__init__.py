"""The main job: ``specdraft run``'s stages, their cache and the runner that resumes them.

``runner`` (a stage's declaration, its cache key, the walk that resumes), ``pipeline`` (the stages, one
declaration each, and :func:`run_pipeline`).

May import: every layer below; the CLI and the package's public names read it.
"""
