"""``python scripts/prometheus_config.py ...``, as the docs and tests call it from a checkout.

The generator itself is installed with the wheel: ``gossipgrad.experiment.prometheus_config``,
run as ``gossipgrad-observability prometheus ...``; ``--help`` lists its options (argparse,
in that module).
"""

from __future__ import annotations

import sys

from gossipgrad.experiment.prometheus_config import *  # noqa: F403
from gossipgrad.experiment.prometheus_config import main

if __name__ == "__main__":
    sys.exit(main())
