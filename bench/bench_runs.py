"""What the benches that launch whole recipe runs share: one run into its own folder, or the finished one reused."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def recipe_run(folder: Path, overrides: Sequence[str], *, label: str, reuse: bool = False) -> Path:
    """``python run.py run.output_dir=<folder> <overrides>`` (raises on failure) into a fresh ``folder`` (an earlier
    run there is removed: the bench reads one run per folder), or with ``reuse`` the run a folder already holds."""
    if reuse and (folder / "wandb").is_dir():
        print(f"== {label}: reusing {folder}", flush=True)
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    cmd = [sys.executable, "run.py", f"run.output_dir={folder}", *overrides]
    print(f"== {label}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    return folder
