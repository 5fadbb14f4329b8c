"""A launching process for the lifecycle tests: starts one engine from the plan, prints its process tree as JSON,
then waits to be interrupted (Ctrl-C) or killed. Usage: ``python engine_driver.py LOG_DIR [OVERRIDE ...]``."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from rollout_helpers import engine_cfg  # noqa: E402

from r3rl.plan import build_plan  # noqa: E402
from r3rl.rollout.engine import VLLMEngine  # noqa: E402


def main() -> None:
    # a shell starts background jobs with SIGINT ignored, and Python then never raises KeyboardInterrupt: take
    # Ctrl-C back so the test means the same however pytest itself was started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cfg = engine_cfg(*sys.argv[2:])
    launch = build_plan(cfg).engines[0]
    with VLLMEngine.launch(launch, Path(sys.argv[1]), cfg.rollout.engine.startup_timeout_s) as engine:
        print(json.dumps({"url": engine.url, "pid": engine.pid, "tree": engine.process_tree()}), flush=True)
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
