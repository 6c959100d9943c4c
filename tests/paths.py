"""Paths the tests share: the repository root, the helper scripts and the shared request traces."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
TRACES = Path(os.environ.get("KVSTORE_TRACES", ROOT.parent / "shared" / "data" / "traces"))
