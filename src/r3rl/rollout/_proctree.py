"""Process-tree bookkeeping from /proc (Linux, where vLLM runs): which PIDs an engine owns, and whether they live.

A vLLM server is an API process with an EngineCore child, which has Worker children, plus a multiprocessing
resource tracker. If the API process is killed, the others are re-parented to init, so "the children of the
server" must be snapshotted while the tree is intact; the process group catches the rest.
"""

from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a process, None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after its closing parenthesis
    rest = text[text.rindex(")") + 2:].split()
    return rest[0], int(rest[1]), int(rest[2])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited; it only waits to be reaped)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), from one /proc scan."""
    children: dict[int, list[int]] = {}
    for p in _all_pids():
        st = _stat(p)
        if st is not None:
            children.setdefault(st[1], []).append(p)
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (the engine's own session: it was started with setsid)."""
    out = []
    for p in _all_pids():
        st = _stat(p)
        if st is not None and st[2] == pgid and st[0] not in ("Z", "X"):
            out.append(p)
    return out


def shared_memory_segments(pids) -> set[Path]:
    """Shared-memory files mapped by ``pids`` that outlive a killed process: Python's shared-memory segments
    (``/dev/shm/psm_*``, vLLM's message queues) and multiprocessing's named semaphores (``/dev/shm/sem.mp-*``)."""
    out: set[Path] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
            path = fields[5] if len(fields) == 6 else ""
            # an unlinked one (multiprocessing unlinks its semaphores at once) is gone with its last mapping
            if path.startswith(("/dev/shm/psm_", "/dev/shm/sem.mp-")) and not path.endswith(" (deleted)"):
                out.add(Path(path))
    return out


def unlink_unmapped(paths) -> None:
    """Unlink those of ``paths`` that no running process maps any more: what killed processes leave behind."""
    for path in set(paths) - shared_memory_segments(_all_pids()):
        path.unlink(missing_ok=True)
