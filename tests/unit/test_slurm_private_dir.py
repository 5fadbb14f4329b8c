"""``r3rl_private_dir`` (slurm/common.sh), which makes each Slurm node's Ray temp dir: run by bash as ray_node.sh runs
it. The whole launcher runs on real Slurm daemons in tests/integration/slurm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

COMMON = Path(__file__).resolve().parents[2] / "slurm" / "common.sh"
NOBODY = 65534


def private_dir(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{COMMON}"; r3rl_private_dir "$1"', "-",
                           str(path)], capture_output=True, text=True, timeout=30)


def test_the_ray_folder_is_made_0700_and_a_leftover_of_this_user_taken_back(tmp_path):
    """Fails if ray_node.sh's folder is made with ``mkdir -p`` (the umask's mode, 0755) or a folder this user's
    killed job left keeps a looser mode."""
    fresh, leftover = tmp_path / "r3rl-ray-77-n1", tmp_path / "r3rl-ray-77-n2"
    leftover.mkdir(mode=0o755)
    for folder in (fresh, leftover):
        out = private_dir(folder)
        assert out.returncode == 0, out.stderr
        assert folder.is_dir() and folder.stat().st_mode & 0o777 == 0o700


def test_a_folder_or_link_a_co_tenant_made_first_is_refused(tmp_path):
    """The predictable path taken first by someone else (issue 59 item 4): their folder, or a symlink to a folder
    they read. Refused naming the path and RAY_TMP_ROOT, and left as it was. Fails if ray_node.sh goes back to
    ``mkdir -p``, which would have Ray write its sockets and objects there."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    link = tmp_path / "r3rl-ray-77-n1"
    link.symlink_to(theirs)
    out = private_dir(link)
    assert out.returncode != 0 and str(link) in out.stderr and "RAY_TMP_ROOT" in out.stderr
    assert link.is_symlink() and theirs.stat().st_mode & 0o777 == 0o777
    if os.geteuid() != 0:
        pytest.skip("making a folder another user owns needs root (chown)")
    other = tmp_path / "r3rl-ray-77-n2"
    other.mkdir()
    other.chmod(0o777)
    os.chown(other, NOBODY, NOBODY)
    out = private_dir(other)
    assert out.returncode != 0 and "another user's" in out.stderr
    assert other.stat().st_uid == NOBODY and other.stat().st_mode & 0o777 == 0o777
