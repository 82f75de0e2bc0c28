"""Shared test setup: make the test helper modules importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
