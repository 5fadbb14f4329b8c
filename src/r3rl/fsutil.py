"""Writing folders so that a crash never leaves a half-written one in place."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """Yield an empty sibling folder to fill; on success it replaces ``out``, on any error it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is shared with engine processes and users
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
