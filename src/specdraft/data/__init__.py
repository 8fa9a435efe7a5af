"""Prompt and conversation sources by name, and the prompt selector every command reads its prompts through.

May import: :mod:`specdraft.core`.
"""
