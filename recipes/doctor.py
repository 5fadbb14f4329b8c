"""``python doctor.py``: the run's own stack, started briefly, checked against the R3 contract.

The doctor is the GRPO recipe's setup (Ray, the trainer ranks in the configured layout, the engines launched or
attached, the weight sync), then one batch of the run's own prompts through it, then the checks of
``r3rl.doctor.checks`` on what came back: no step is logged and nothing is saved. Each check runs whatever another
check found; an exception inside one is that check's FAIL.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import ray

from r3rl import route_trace
from r3rl.config.schema import R3RLConfig
from r3rl.doctor import checks as C
from r3rl.doctor.checks import Check
from r3rl.models.layers import hf_moe_layers
from r3rl.models.tiny_moe import ensure_checkpoint
from r3rl.rollout.probe import unguarded_routes
from r3rl.sync.disk import update_weights_from_hf, weight_checksums
from recipes.common import console
from recipes.grpo import GRPORecipe

# the doctor's own batch number: its requests' seeds and ids never collide with a run's steps
DOCTOR_STEP = 1


class Doctor(GRPORecipe):
    def __init__(self, cfg: R3RLConfig):
        super().__init__(cfg)
        self.results: list[Check] = []
        self.sync_seconds = float("nan")  # the doctor's weight sync, timed
        # the engine's routes teacher-forced through the trainer one step after them: check 3's near miss
        self.near_miss_flips = None

    def examine(self) -> list[Check]:
        cfg, model = self.cfg, self.cfg.model
        engine_dtype = self.plan.engine_dtype
        with console.status("doctor: generating one batch of the run's prompts"):
            prompts = next(self.dataset.batches(cfg.algorithm.rollout_batch_size))
            samples, _ = self.rollout(DOCTOR_STEP, prompts)
        routed = samples[0].routed_experts is not None
        self.check("engine token", lambda: C.engine_auth({url: unguarded_routes(url) for url in self.engines.urls}))
        no_routes = "the engine returns no routes (rollout=vllm): use rollout=vllm_r3"

        self.check("engine capture", lambda: C.engine_capture(
            samples, num_layers=model.num_moe_layers, topk=model.moe_topk, num_experts=model.num_experts)
            if routed else C.skipped("engine capture", no_routes))

        inventory = self.trainers.call_all("router_inventory")
        hf_config = json.loads((Path(ensure_checkpoint(model)) / "config.json").read_text())
        trainer_layers = sorted({layer for rank in inventory for layer in rank["layers"]})
        self.check("layer map", lambda: C.layer_map(
            hf_moe_layers(hf_config), samples[0].routed_experts.shape[1] if routed else None, trainer_layers))

        batch = ray.put(samples)
        with console.status("doctor: the trainer's passes without and with replay, and their controls"):
            live = self.trainers.call("logprobs", batch, replay=False)
            replayed = self.trainers.call("logprobs", batch, replay=True) if routed else None
            # check 3's drift at depth, on the batch's own weights (the weight sync check trains a step)
            drift = self.trainers.call("rounding_drift", batch) if routed else None
        unreplayed_diff = C.mean_abs_diff(live.logprobs, samples)

        def replay_check() -> Check:
            shifted = self.trainers.call("logprobs", ray.put(C.shifted_routes(samples)), replay=True)
            (with_replay, prompts), (without, _), (off_by_one, _) = (
                C.per_sample_abs_diff(p.logprobs, samples) for p in (replayed, live, shifted))
            return C.replay_exact(replayed.replay_mismatch_rows, replayed.replayed_routes_match, with_replay,
                                  without, off_by_one, prompts, layout=self.layout())

        # every pass on the batch's own weights first: the weight sync check trains a step
        self.check("replay is exact", replay_check if routed else lambda: C.skipped("replay is exact", no_routes))
        self.check("route trace", lambda: self.trace_check(samples, replayed) if replayed is not None and
                   replayed.trace is not None else C.skipped("route trace", no_routes if not routed else
                                                             "debug.route_trace needs replay r3"))
        control = self.trainers.call("logprobs", ray.put(C.well_formed_random_routes(
            samples, model.num_experts, seed=cfg.run.seed)), replay=False) if routed else None
        self.check("weight sync round trip", lambda: self.weight_sync_check(
            prompts, samples, replayed or live, engine_dtype, routed))

        def routes_check() -> Check:
            # teacher-forced: the replayed pass's own router choices against the engine's routes, layer by layer
            return C.routes_are_the_models(replayed.flip_per_layer, replayed.reachable_per_layer,
                                           replayed.rows_per_layer, self.near_miss_flips, control.flip_per_layer,
                                           unreplayed_diff, engine_dtype=engine_dtype, drift=drift)

        self.check("routes are the model's", routes_check if routed else
                   lambda: C.skipped("routes are the model's", no_routes))
        engine_argv = self.plan.engines[0].argv if self.plan.engines else ()
        self.check("precision", lambda: C.precision(engine_dtype, engine_argv, inventory[0]))
        if cfg.parallelism.device == "cuda":  # paper until a GPU runs it: no GPU has run the doctor yet
            self.check("GPU memory and sync time", self.gpu_memory_check)
        else:
            self.results.append(C.skipped("GPU memory and sync time", "no GPU: the trainer's peak memory and the "
                                          "weight sync's time are measured on GPUs only"))
        # the table in the order docs/doctor.md numbers the checks
        return sorted(self.results, key=lambda c: C.ORDER.index(c.name) if c.name in C.ORDER else len(C.ORDER))

    def gpu_memory_check(self) -> Check:
        trainer = next(g for g in self.plan.memory.gpus if g.gpu in ("trainer", "colocated"))
        return C.gpu_memory(self.trainers.call_all("peak_device_memory"), trainer.role_total("trainer"),
                            self.sync_seconds, self.plan.memory.budget_bytes)

    def check(self, name: str, run: Callable[[], Check]) -> None:
        """One check; an exception is its FAIL, and the next check still runs."""
        try:
            result = run()
        except Exception as err:  # noqa: BLE001 - reported, not swallowed: one broken check hides no other
            result = Check(name, C.FAIL, detail=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                           fix="see the traceback in the doctor's log and the engine logs")
            console.print_exception(max_frames=4)
        self.results.append(result)
        colour = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}[result.status]
        console.print(f"[{colour}]{result.status}[/] {result.name}: {result.figure or result.detail}")

    def trace_check(self, samples, replayed) -> Check:
        """The doctor's batch traced as a run traces a step (``<doctor folder>/trace``), read back as
        ``python doctor.py --trace`` reads a run's; the control: its routes replayed one row off."""
        folder = self.run_dir / route_trace.TRACE_DIR
        self.write_trace(DOCTOR_STEP, samples, replayed)
        shifted_samples = C.shifted_routes(samples)
        shifted = self.trainers.call("logprobs", ray.put(shifted_samples), replay=True)
        # what the trainer replayed, against what the rollout returned: the routing must differ on every sample
        control = [{"request_id": s.request_id, "digests": {"batch": s.extra.get("trace_rollout"),
                                                            "router": shifted.trace["router"][i]}}
                   for i, s in enumerate(samples)]
        return C.trace(route_trace.check(folder), route_trace.report([(DOCTOR_STEP, control)]))

    def weight_sync_check(self, prompts, samples, before, engine_dtype: str, routed: bool) -> Check:
        """One optimizer step on the batch (advantages +1 and -1 in turn: it moves the policy whatever the rewards),
        the run's weight sync, then each engine's parameter checksums against those of vLLM's own reload of the
        trainer's exported weights (the reference); the checksums before the sync are the stale-engine control.
        The trainer after the step, fed the engine's routes of before it, gives check 3 its near miss; the log-prob
        figures (before the step, stale engine, after the sync on the same requests generated again) are shown."""
        urls = self.engines.urls
        adapters = self.weight_sync == "adapter"

        def sums() -> dict[str, dict[str, str]]:  # under the adapter sync the base never moves: the log-probs decide
            return {} if adapters else {url: weight_checksums(url) for url in urls}

        stale_sums = sums()
        batch = ray.put(samples)
        advantages = [np.full(s.response_length, 1.0 if i % 2 == 0 else -1.0, dtype=np.float32)
                      for i, s in enumerate(samples)]
        if self.colocated:  # the GPUs go to the trainer for the step, as in a GRPO step
            self.engine_set.sleep(self.cfg.rollout.weight_sync.sleep_level)
            self.engines_asleep = True
            self.trainers.call("onload_optimizer_state")
        self.trainers.call("train_step", batch, advantages, replay=routed, old_logprobs=before.logprobs)
        stale_pass = self.trainers.call("logprobs", batch, replay=routed)
        if routed:
            self.near_miss_flips = stale_pass.flip_per_layer
        started = time.perf_counter()
        self.sync_weights(version=1)
        self.sync_seconds = time.perf_counter() - started
        synced_sums = sums()
        fresh, _ = self.rollout(DOCTOR_STEP, prompts)
        synced = C.mean_abs_diff(self.trainers.call("logprobs", ray.put(fresh), replay=routed).logprobs, fresh)
        exported = Path(self.trainers.call("export_hf", self.run_dir / "weights"))
        for url in urls:  # vLLM's own loader on the trainer's weights: what the engine must hold
            update_weights_from_hf(url, exported, version=1)
        reference = sums()
        figures = {"before_step": C.mean_abs_diff(before.logprobs, samples),
                   "stale_engine": C.mean_abs_diff(stale_pass.logprobs, samples), "after_sync": synced}
        if adapters:  # the engine's merged reload, served without the adapter, against the trainer on the same
            # prompts
            self.client.serve_version(1, None)
            merged, _ = self.rollout(DOCTOR_STEP, prompts)
            figures["merged_engine"] = C.mean_abs_diff(
                self.trainers.call("logprobs", ray.put(merged), replay=routed).logprobs, merged)
            return C.adapter_sync(figures)
        return C.weight_sync(synced_sums, reference, stale_sums, figures)

    def layout(self) -> str:
        t = self.cfg.parallelism.trainer
        parts = [f"{name} {size}" for name, size in (("TP", t.tensor_parallel), ("PP", t.pipeline_parallel),
                                                     ("CP", t.context_parallel), ("EP", t.expert_parallel))
                 if size > 1]
        return ", ".join(["packed" if self.cfg.trainer.packing else "padded", *parts])


def run_doctor(cfg: R3RLConfig) -> list[Check]:
    """The checks on the model the run trains: its SFT warm start where it has one (made first when not cached)."""
    from recipes import warm_start

    doctor = Doctor(warm_start.ensure(cfg))
    try:
        doctor.setup()
        return doctor.examine()
    except Exception as err:  # the stack itself did not come up or broke: the checks that ran stand
        console.print_exception(max_frames=6)
        return [*doctor.results, Check("stack", C.FAIL, detail=f"{type(err).__name__}: {str(err).splitlines()[0]}",
                                       fix=f"see the engine logs in {doctor.run_dir / 'logs'}")]
    finally:
        doctor.cleanup()
