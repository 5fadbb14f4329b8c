"""What kind of machine this is. Read once by ``run.py``; everything below it takes the answer from the config."""

from __future__ import annotations

import shutil
import subprocess


def visible_gpu_count() -> int:
    """Number of NVIDIA GPUs visible, without importing torch (run.py must stay fast for dry runs)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def default_parallelism() -> str:
    """The parallelism group used when the command line names none."""
    return "disaggregated_4p4" if visible_gpu_count() > 0 else "cpu"


def with_default_parallelism(overrides: list[str]) -> list[str]:
    """``overrides`` with the machine's parallelism group when they name none (an experiment may set it too), and
    unchanged when they ask Hydra for help or the config itself."""
    if any(a.split("=", 1)[0].lstrip("~+") in ("parallelism", "experiment") for a in overrides):
        return overrides
    if any(a in ("--help", "-h", "--info", "--cfg", "-c", "--hydra-help") for a in overrides):
        return overrides
    return overrides + [f"parallelism={default_parallelism()}"]


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.22.1+cu130"`` -> ``(0, 22, 1)``: the leading numeric parts of a release string (a local tag after ``+``
    dropped), for comparing installed versions against the ones r3rl needs."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)
