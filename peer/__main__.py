"""``python -m gossipgrad.peer`` is ``gossipgrad-peer``."""

import sys

from gossipgrad.peer.cli import main

sys.exit(main())
