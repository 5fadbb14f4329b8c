"""The W&B logger of a run: every file under the run's folder, one step axis per prefix, one log call per step.

- Modes: ``online``, ``offline`` (the default without a GPU; upload later with ``wandb sync``) and ``disabled``
  (wandb is not started at all and nothing is written).
- Files: WANDB_DIR, WANDB_CACHE_DIR, WANDB_DATA_DIR and WANDB_CONFIG_DIR point into ``<run_dir>`` while the run
  is open, so nothing lands in the home folder or the working directory; they are restored by ``finish()``.
- Step axes: each prefix of ``r3rl.metrics.PREFIXES`` has its own axis ``<prefix>/step`` (slime's convention), and
  each step is a single ``wandb.log(..., step=step)``: several calls per step would stretch W&B's step axis.
- Resume: store ``.run_id`` in the checkpoint and pass it back as ``resume_id``. Online, the run continues
  (``resume="allow"``: also works when the first attempt never reached the server). Offline, W&B cannot resume a
  run locally; the new folder gets the same id, ``read_run`` on the run folder stitches them, and
  ``wandb sync --id <id> <run_dir>/wandb/offline-run-*`` uploads them into one run.
- One logger per process: W&B's environment and its service process are process-wide. ``finish()`` ends the run
  and stops the service process.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from r3rl.metrics import PREFIXES, STEP_AXES
from r3rl.plan import WandbNaming

MODES = ("online", "offline", "disabled")


def wandb_dirs(run_dir: Path) -> dict[str, Path]:
    """W&B's folders for a run; WANDB_DIR gets a ``wandb/`` subfolder from W&B itself."""
    base = run_dir / "wandb"
    return {
        "WANDB_DIR": run_dir,
        "WANDB_CACHE_DIR": base / "cache",
        "WANDB_DATA_DIR": base / "data",
        "WANDB_CONFIG_DIR": base / "config",
    }


def config_dict(cfg: Any) -> dict[str, Any]:
    """The run config as plain data for ``wandb.config`` (dataclass configs and mappings alike)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise TypeError(f"run config must be a dataclass or a mapping, got {type(cfg).__name__}")


def new_run_id() -> str:
    """An id shaped like W&B's own (8 of [a-z0-9]), for runs that never reach wandb."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _number(key: str, value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__}")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


class WandbLogger:
    def __init__(self, cfg: Any, naming: WandbNaming, run_dir: str | os.PathLike, resume_id: str | None = None,
                 ) -> None:
        if naming.mode not in MODES:
            raise ValueError(f"logger.wandb.mode={naming.mode!r}: expected one of {', '.join(MODES)} (or auto)")
        self.naming = naming
        self.mode = naming.mode
        self.run_dir = Path(run_dir)
        self.history: list[dict[str, Any]] = []  # what this process logged, for the end-of-run summary
        self._last_step: int | None = None
        self._saved_env: dict[str, str | None] = {}
        self._run: Any = None
        self._finished = False
        if self.mode == "disabled":
            self.run_id: str = resume_id or new_run_id()
            return
        self._enter_dirs()
        try:
            self._run = self._init(cfg, resume_id)
        except BaseException:
            self._restore_env()
            raise
        self.run_id = self._run.id
        for prefix in PREFIXES:
            axis = STEP_AXES[prefix]
            self._run.define_metric(axis)
            self._run.define_metric(f"{prefix}/*", step_metric=axis)

    def _enter_dirs(self) -> None:
        for var, path in wandb_dirs(self.run_dir).items():
            path.mkdir(parents=True, exist_ok=True)
            self._saved_env[var] = os.environ.get(var)
            os.environ[var] = str(path)

    def _restore_env(self) -> None:
        for var, old in self._saved_env.items():
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
        self._saved_env = {}

    def _init(self, cfg: Any, resume_id: str | None) -> Any:
        import wandb

        n = self.naming
        try:
            return wandb.init(
                project=n.project, entity=n.entity, name=n.name, group=n.group, tags=list(n.tags),
                config=config_dict(cfg), mode=self.mode, dir=str(self.run_dir),
                id=resume_id, resume="allow" if resume_id else None,
            )
        except wandb.errors.UsageError as e:
            raise RuntimeError(
                f"W&B could not start an {self.mode} run ({e}). Log in (`wandb login` or WANDB_API_KEY), or run "
                f"with logger.wandb.mode=offline and upload later with `wandb sync`."
            ) from e

    @property
    def run(self) -> Any:
        """The underlying ``wandb`` run (None when disabled)."""
        return self._run

    @property
    def files_dir(self) -> Path | None:
        """The ``offline-run-*``/``run-*`` folder of this run (None when disabled)."""
        return Path(self._run.dir).parent if self._run is not None else None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics in a single ``wandb.log`` call, at ``step``, with each prefix's step axis."""
        if self._finished:
            raise RuntimeError("WandbLogger.log after finish()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} was already logged (last step {self._last_step}): log once per step")
        row: dict[str, Any] = {}
        prefixes: set[str] = set()
        for key, value in metrics.items():
            prefix = key.split("/", 1)[0]
            if prefix not in STEP_AXES or "/" not in key:
                raise ValueError(f"metric {key!r}: keys must start with one of {', '.join(p + '/' for p in PREFIXES)}")
            if key in STEP_AXES.values():
                raise ValueError(f"metric {key!r} is a step axis; the logger sets it from step")
            row[key] = _number(key, value)
            prefixes.add(prefix)
        for prefix in sorted(prefixes):
            row[STEP_AXES[prefix]] = step
        if self._run is not None:
            self._run.log(row, step=step)
        self.history.append({"_step": step, **{k: v for k, v in row.items() if k not in STEP_AXES.values()}})
        self._last_step = step

    def finish(self, exit_code: int = 0) -> None:
        """End the run, stop W&B's service process and restore the environment; safe to call twice."""
        if self._finished:
            return
        self._finished = True
        if self._run is None:
            return
        import wandb

        try:
            self._run.finish(exit_code=exit_code)
        finally:
            # finish() leaves wandb-core running until the interpreter exits; teardown stops it now
            wandb.teardown()
            self._restore_env()

    def __enter__(self) -> "WandbLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)

