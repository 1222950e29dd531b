"""The deepseek plugin's tests import their helper module (``tiny_v3.py``) from this directory."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the tests' helper module, under --import-mode=importlib
