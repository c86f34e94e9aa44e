"""``python -m gossipgrad.experiment`` = ``gossipgrad-experiment``."""

import sys

from gossipgrad.experiment.cli import main

sys.exit(main())
