"""``python -m specdraft.cli`` (what ``torchrun -m`` / ``accelerate launch -m`` run): the ``specdraft`` command."""

from specdraft.cli import main

main()
