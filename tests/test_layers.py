"""The layering of docs/ARCHITECTURE.md holds: import-linter's contracts (pyproject.toml) all kept.

In the suite, not only in `just lint`, so that CI fails the change that adds a cycle or
makes a lower layer import a higher one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 6 kept, 0 broken." in done.stdout
