"""``python -m sim --role decode --group g1 --port 8200 --eds-file eds.json``: one simulated engine."""

import sys

from sim.cli import main

sys.exit(main())
