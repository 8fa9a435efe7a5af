"""The main job: ``specdraft run``'s stages, their cache and the runner that resumes them.

May import: every layer below; only the CLI imports it.
"""
