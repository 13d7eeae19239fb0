"""Running the example scripts from tests, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_script(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python3 <argv>`` from the repository root; output captured, never raising."""
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip


def last_json(done: subprocess.CompletedProcess[str]) -> Any:
    """The JSON object on a benchmark's last stdout line (after checking it succeeded)."""
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
