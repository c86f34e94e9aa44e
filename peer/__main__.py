"""``python -m gossipgrad.peer`` is ``gossipgrad-peer``."""

from gossipgrad.peer.cli import run

run()
