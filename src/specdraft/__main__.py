"""``python -m specdraft``: the ``specdraft`` command."""

from specdraft.cli import main

main()
