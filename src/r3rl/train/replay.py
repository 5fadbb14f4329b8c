"""Routing replay through Megatron's own ``RouterReplay`` (``moe_enable_routing_replay=True``).

Per micro batch: ``arm`` hands each local router its layer's targets (``set_target_indices`` also queues them for
backward) and sets REPLAY_FORWARD; after the forward, ``after_forward`` switches to REPLAY_BACKWARD so activation
recompute in backward pops the same targets (FIFO), or clears the action for a forward-only pass. ``clear`` empties
targets, records and the backward queue, and runs before and after every forward/backward (pitfall P11).

State is reached through this model's routers, never Megatron's global instance list, so a reference model or a
second model in the process is never armed (pitfall P12).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from r3rl import metrics as M
from r3rl import route_trace
from r3rl.train.batch import MicroBatch
from r3rl.train.layout import TokenLayout
from r3rl.train.model import route_column
from r3rl.train.routes import PackedRoutes


def check_megatron_api() -> None:
    """Fail early if the installed Megatron's replay API is not the one this module drives (pitfall P16)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    expected = {"RECORD", "REPLAY_FORWARD", "REPLAY_BACKWARD"}
    missing = expected - set(RouterReplayAction.__members__)
    params = list(inspect.signature(RouterReplay.get_replay_topk).parameters)
    needed = ["self", "scores", "topk", "num_groups", "group_topk", "default_compute_topk"]
    methods = ("set_target_indices", "set_router_replay_action", "clear_router_replay_action", "clear_indices")
    probe = RouterReplay()
    try:
        has_queue = isinstance(getattr(probe, "replay_backward_list", None), list)
    finally:
        # RouterReplay() registers itself globally; drop the probe instance again
        RouterReplay.global_router_replay_instances[:] = [
            i for i in RouterReplay.global_router_replay_instances if i is not probe]
    if missing or params != needed or not all(hasattr(RouterReplay, m) for m in methods) or not has_queue:
        raise RuntimeError(f"megatron.core RouterReplay API changed (actions missing {sorted(missing)}, "
                           f"get_replay_topk{tuple(params)}); r3rl's replay driver supports megatron-core 0.16")


def probs_from_logits(logits: torch.Tensor, router_config) -> torch.Tensor:
    """``selection_probs`` of the scores Megatron derives from these router logits (the route probe's view)."""
    if router_config.moe_router_score_function == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if router_config.moe_router_score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    return torch.nn.functional.softplus(logits.float()).sqrt()


def selection_scores(logits: torch.Tensor, router, grouped: bool = True) -> torch.Tensor:
    """What a Megatron router ranks experts by, from its logits ``[N, E]``: the logits of a softmax router (the
    softmax keeps their order), a sigmoid router's scores plus its expert-score correction bias, and outside the
    ``moe_router_group_topk`` best groups -inf (DeepSeek-V3's group-limited top-k: a group scores the sum of its
    top ``topk / group_topk``). The route probe's own top-k and margins are taken over these; ranking a biased router
    by its logits would count every bias-decided pick as a flip. ``grouped`` False: the scores before the groups
    mask any (every expert's finite score)."""
    config = router.config
    if config.moe_router_score_function != "sigmoid":
        return logits.float()
    scores = torch.sigmoid(logits.float())
    if getattr(router, "expert_bias", None) is not None:
        scores = scores + router.expert_bias.float()
    groups = config.moe_router_num_groups or 1
    if groups > 1 and grouped:
        per_group = scores.view(scores.shape[0], groups, -1)
        group_scores = per_group.topk(config.moe_router_topk // config.moe_router_group_topk, dim=-1).values.sum(-1)
        chosen = group_scores.topk(config.moe_router_group_topk, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
        scores = per_group.masked_fill(~keep[..., None], float("-inf")).view(scores.shape[0], -1)
    return scores


def rounding_reach(hidden: torch.Tensor, logits: torch.Tensor, top, k: int, router, unit_roundoff: float
                   ) -> torch.Tensor:
    """Per row, how far an engine of unit roundoff u can move the margin between its k-th and (k+1)-th selection
    scores (``top``: ``torch.topk`` of ``selection_scores(logits)``, k + 1 wide) by rounding. A router logit
    x = w . h moves by u|x| where the engine rounds it (a gate that outputs its dtype, Qwen3's) and by about
    u ||w * h||_2 where it rounds the router's input h (every element by up to u|h_i|, errors that add in quadrature:
    vLLM's float32 GLM-4.5 gate sees only this); the reach counts both. A softmax router ranks by its
    logits, so each logit's move is the score's; a sigmoid router ranks by sigmoid(x) + bias and its score moves by
    the sigmoid's slope s (1 - s) times the logit's (the bias is a float32 constant no engine rounds). ``hidden``:
    the router's input rows ``[N, H]`` (``logits``' rows)."""
    pair = top.indices[:, k - 1:k + 1]
    x = logits.gather(1, pair).double()
    weight = router.weight.float()
    spread = torch.sqrt(hidden.float().square() @ weight.square().T).gather(1, pair).double()
    slope = 1.0
    if router.config.moe_router_score_function == "sigmoid":
        s = torch.sigmoid(x)
        slope = s * (1 - s)
    return unit_roundoff * (slope * (x.abs() + spread)).sum(-1)


def selection_probs(scores: torch.Tensor, router_config) -> torch.Tensor:
    """The router's selection scores as probabilities: Megatron hands its top-k the raw logits when the softmax comes
    after the top-k (``moe_router_pre_softmax`` off, Qwen3's normalised top-k), and scores that already are
    probabilities or gates otherwise. A ratio of two logits means nothing (they can be negative), so soft replay
    compares these."""
    if router_config.moe_router_score_function == "softmax" and not router_config.moe_router_pre_softmax:
        return torch.softmax(scores.float(), dim=-1)
    return scores.float()


def soft_targets(probs: torch.Tensor, replayed: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft replay (prime-rl #2703's ``router_replay_score_threshold_ratio``): per row, a replayed expert stays when
    the trainer's router gives it at least ``ratio`` x the score of the trainer's own weakest top-k expert; each
    rejected slot takes, in order, the trainer's own top-k experts not already kept. ``probs`` ``[N, E]``,
    ``replayed`` ``[N, K]``. Returns the experts to route ``[N, K]`` and which slots were replaced ``[N, K]``
    (bool). ``ratio`` 0 keeps every replayed expert (R3); 1 keeps only those in the trainer's own top-k, so the
    trainer routes itself (no replay, score ties aside)."""
    k = replayed.shape[1]
    own_probs, own = torch.topk(probs, k, dim=-1)
    kept = probs.gather(1, replayed) >= ratio * own_probs[:, -1:]
    # the trainer's candidates, in its own order, that no kept replayed slot already holds
    taken = ((own[:, :, None] == replayed[:, None, :]) & kept[:, None, :]).any(dim=-1)
    free_first = torch.sort(taken.to(torch.int8), dim=-1, stable=True).indices
    candidates = own.gather(1, free_first)
    # the j-th rejected slot of a row takes the row's j-th free candidate (a row has at least as many free
    # candidates as rejected slots: each kept slot can take at most one of the K candidates)
    rank = (torch.cumsum((~kept).long(), dim=-1) - 1).clamp(min=0)
    chosen = torch.where(kept, replayed, candidates.gather(1, rank))
    return chosen, ~kept


def check_soft_replay_router(router_config) -> None:
    """Soft replay compares the trainer's scores of the replayed experts with its own top-k's, as probabilities of
    a softmax router. A sigmoid router with an expert-score correction bias selects on biased scores and a
    group-limited top-k picks within groups first (GLM-4.5, DeepSeek-V3): ``soft_targets`` would compare unbiased
    scores over all experts, a filter those routers never apply. Refused, naming the key, until it is."""
    why = []
    if getattr(router_config, "moe_router_score_function", "softmax") != "softmax":
        why.append(f"score function {router_config.moe_router_score_function}")
    if getattr(router_config, "moe_router_enable_expert_bias", False):
        why.append("an expert-score correction bias")
    if (getattr(router_config, "moe_router_num_groups", None) or 1) > 1:
        why.append(f"group-limited top-k ({router_config.moe_router_num_groups} groups)")
    if why:
        raise ValueError(f"replay=soft supports softmax routers without bias or groups; this model's router has "
                         f"{', '.join(why)}: use replay=r3 (exact for every router)")


def _soft_router_replay(ratio: float, router_config):
    """A Megatron ``RouterReplay`` whose forward replay keeps a replayed expert only where the trainer's router agrees
    enough (``soft_targets``) and queues what it routed for the backward recompute, so the recompute routes the
    same experts as the forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    check_soft_replay_router(router_config)

    class SoftRouterReplay(RouterReplay):
        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            target = self.target_topk_idx
            chosen, _ = soft_targets(selection_probs(scores.detach(), router_config),
                                     target.to(scores.device).long(), ratio)
            chosen = chosen.to(target.dtype)
            # the backward recompute pops this forward's entry: make it the experts actually routed
            for i, queued in enumerate(self.replay_backward_list):
                if queued is target:
                    self.replay_backward_list[i] = chosen
            return scores.gather(1, chosen.long()), chosen

    return SoftRouterReplay()


class ReplayDriver:
    """Arms and clears the ``RouterReplay`` of one model's MoE routers. ``soft_ratio``: soft replay
    (``replay=soft``): each router's ``RouterReplay`` is swapped for one that filters the replayed experts
    (``soft_targets``) before routing them."""

    def __init__(self, routers: list, soft_ratio: float | None = None):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction
        self.routers = routers
        self.soft_ratio = soft_ratio
        missing = [r.layer_number for r in routers if r.router_replay is None]
        if missing:
            raise RuntimeError(f"MoE layers {missing} have no RouterReplay: build the model with "
                               "moe_enable_routing_replay=True")
        if soft_ratio is not None:
            forget_instances(routers)
            for router in routers:
                router.router_replay = _soft_router_replay(soft_ratio, router.config)

    @property
    def layers(self) -> list[int]:
        """The route column (MoE layer index) of each local router."""
        return [route_column(r) for r in self.routers]

    def arm(self, routes: PackedRoutes, device: torch.device) -> None:
        for router in self.routers:
            target = routes.layer_targets(route_column(router), device)
            router.router_replay.set_target_indices(target)
            router.router_replay.set_router_replay_action(self._actions.REPLAY_FORWARD)

    def after_forward(self, *, backward_follows: bool) -> None:
        for router in self.routers:
            if backward_follows:
                router.router_replay.set_router_replay_action(self._actions.REPLAY_BACKWARD)
            else:
                # nothing will pop the queued targets of a forward-only pass: drop them now (P11)
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def record(self) -> None:
        """Let the routers route themselves and keep their top-k (Megatron's RECORD action)."""
        for router in self.routers:
            router.router_replay.set_router_replay_action(self._actions.RECORD)

    def recorded(self) -> dict[int, torch.Tensor]:
        """Route column -> the ``[rows, K]`` top-k each local router recorded in the last forward."""
        return {route_column(r): r.router_replay.get_recorded_indices() for r in self.routers}

    def pending(self) -> int:
        """Targets queued for backward replay and not yet consumed, over all local layers."""
        return sum(len(r.router_replay.replay_backward_list) for r in self.routers)

    def clear(self) -> None:
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()

    @contextlib.contextmanager
    def session(self) -> Iterator["ReplayDriver"]:
        self.clear()
        try:
            yield self
        finally:
            self.clear()


def forget_instances(routers: list) -> None:
    """Remove these routers' instances from Megatron's global list (it only grows otherwise)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mine = {id(r.router_replay) for r in routers if r.router_replay is not None}
    RouterReplay.global_router_replay_instances[:] = [
        i for i in RouterReplay.global_router_replay_instances if id(i) not in mine]


@dataclass
class ProbeCounts:
    """Per global layer: response rows (positions P-1 .. T-2, whose output scores a response token) of the real
    samples (not micro-batch padding slots) and of those how many top-k sets the router itself would pick
    differently than the rollout (flips); the same for the prompt rows (0 .. P-2); under replay, every row
    with a rollout route checked against the rollout and those whose routing map differed from the rollout's route
    for that token (must stay 0); and over the response rows, what explains a flip rate: the sum of the router's
    margins (k-th minus (k+1)-th logit), the rows whose margin is small (``metrics.SMALL_ROUTER_MARGIN``), and the
    load of each expert under the router's own top-k (``expert_load``, ``[L, E]``); under soft replay, the replayed
    (row, slot) pairs whose rollout expert the filter replaced (``replaced_slots``; the routing map is then checked
    against the filtered routes); and the response rows whose margin is within the engine's rounding reach
    (``rounding_reach``, u the unit roundoff of the engine's dtype; ``reachable``: the rows the engine's precision
    alone can flip by rounding the router's logits and inputs); in a drift pass (``drift_reference``), the response
    rows whose margin is within that reach plus the drift the pass measured on the row (``drift_reachable``), the
    rows whose top-k the drift changed (``drift_flips``), and the sum over the rows of the drift's margin move over
    the rounding reach (``drift_over_reach``)."""

    routed_rows: np.ndarray
    flips: np.ndarray
    replay_rows: np.ndarray
    replay_mismatches: np.ndarray
    prompt_rows: np.ndarray
    prompt_flips: np.ndarray
    margin_sum: np.ndarray
    small_margins: np.ndarray
    expert_load: np.ndarray
    replaced_slots: np.ndarray
    reachable: np.ndarray
    drift_reachable: np.ndarray
    drift_flips: np.ndarray
    drift_over_reach: np.ndarray

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int) -> "ProbeCounts":
        counts = [np.zeros(num_layers, dtype=np.int64) for _ in range(6)]
        return cls(*counts, np.zeros(num_layers), np.zeros(num_layers, dtype=np.int64),
                   np.zeros((num_layers, num_experts), dtype=np.int64), np.zeros(num_layers, dtype=np.int64),
                   np.zeros(num_layers, dtype=np.int64), np.zeros(num_layers, dtype=np.int64),
                   np.zeros(num_layers, dtype=np.int64), np.zeros(num_layers))

    def as_tensor(self) -> torch.Tensor:
        """Every field flattened into one float64 vector (one collective; counts stay exact below 2^53)."""
        return torch.from_numpy(np.concatenate([np.asarray(getattr(self, f.name), np.float64).ravel()
                                                for f in dataclasses.fields(self)]))

    @classmethod
    def from_tensor(cls, t: torch.Tensor, num_layers: int, num_experts: int) -> "ProbeCounts":
        flat, template, fields = t.cpu().numpy(), cls.zeros(num_layers, num_experts), []
        offset = 0
        for f in dataclasses.fields(cls):
            like = getattr(template, f.name)
            part = flat[offset:offset + like.size].reshape(like.shape)
            fields.append(np.round(part).astype(np.int64) if like.dtype == np.int64 else part)
            offset += like.size
        return cls(*fields)


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def row_origins(mb: MicroBatch, layout: TokenLayout, route_rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of the packing: for each of this rank's router rows of ``mb``, the micro-batch slot and the token
    position it holds, or slot -1 where the row holds no rollout route (padding, a sample's last token).

    Built from the tokens' own layout (``MicroBatch.grid``: right-padded rows or packed segments, through
    ``TokenLayout.router_rows``), never from the packed routes, so a packing that puts a route on the wrong row is
    caught rather than repeated. ``route_rows[b]`` is the number of rollout route rows of slot b's sample (its
    tokens - 1).
    """
    slot, pos = (layout.router_rows(x, mb.segments) for x in mb.grid())
    covered = (slot >= 0) & (pos < np.asarray(route_rows, dtype=np.int64)[np.maximum(slot, 0)])
    return np.where(covered, slot, -1), pos


class _Expected:
    """One micro batch's rollout routes per router row, read from the samples through ``row_origins``, built once per
    micro batch and copied to the device once (every router call of the forward reads its layer from there).

    ``response`` / ``prompt`` (bool per row of ``rows``): the row scores a response token in the loss (position >=
    P-1, the token's loss mask set: the tokens ``train/logprob_abs_diff`` averages, so no observation token of an
    episode and no masked sample) or is a prompt row, of a real sample; both False on a padding slot (``valid[b]``
    False: a repeat of a real sample)."""

    def __init__(self, mb: MicroBatch, layout: TokenLayout, routes: Sequence[np.ndarray],
                 valid: Sequence[bool] | None = None, loss_masks: Sequence[np.ndarray] | None = None,
                 trace: bool = False):
        slot_routes = [routes[i] for i in mb.indices]
        slot, pos = row_origins(mb, layout, [len(r) for r in slot_routes])
        self.rows = np.flatnonzero(slot >= 0)
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in slot_routes])[:-1]]).astype(np.int64)
        # every layer's rollout experts of those rows, [rows, L, K], still narrow
        self.routes = np.concatenate(slot_routes)[offsets[slot[self.rows]] + pos[self.rows]]
        real = np.ones(len(mb.indices), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
        first_scored = np.asarray([start for start, _ in mb.spans], dtype=np.int64)
        row_slot, row_pos = slot[self.rows], pos[self.rows]
        self.response = real[row_slot] & (row_pos >= first_scored[row_slot])
        self.prompt = real[row_slot] & (row_pos < first_scored[row_slot])
        if loss_masks is not None:  # row P-1+j scores response token j
            masks = [np.asarray(loss_masks[i]) > 0 for i in mb.indices]
            at = np.flatnonzero(self.response)
            self.response[at] = [masks[b][p - first_scored[b]] for b, p in zip(row_slot[at], row_pos[at])]
        self._on: tuple | None = None
        # debug.route_trace: each real row's sample index, position and input token, the token read from the
        # micro batch's own (packed, split) tokens, so a token moved with its route still shows
        self.trace = None
        if trace:
            real_rows = real[row_slot]
            tokens = layout.local_router_rows(mb.tokens.cpu().numpy())[self.rows]
            self.trace = (real_rows, np.asarray(mb.indices)[row_slot], row_pos, tokens)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, routes ``[rows, L, K]`` widened, response mask) on ``device``: copied at the first router call."""
        if self._on is None or self._on[0].device != device:
            self._on = (torch.from_numpy(self.rows).to(device), torch.from_numpy(self.routes).to(device).long(),
                        torch.from_numpy(self.response).to(device), torch.from_numpy(self.prompt).to(device))
        return self._on


@dataclass
class DriftReference:
    """Between a drift pass's two passes (``r3rl.train.drift``): per router call of the unperturbed pass, in call
    order, its rows' k-th and (k+1)-th experts, own top-k, margins and rounding reach, on the device. ``scale``: how much
    further the engine is than the emulated rounding (``drift.drift_scale``)."""

    scale: float = 1.0
    keeping: bool = True
    kept: list = dataclasses.field(default_factory=list)
    _read: int = 0

    def next(self, rows: int) -> tuple:
        if self._read >= len(self.kept):
            raise RuntimeError("drift pass: the perturbed pass called more routers than the unperturbed one")
        entry = self.kept[self._read]
        self._read += 1
        if len(entry[2]) != rows:
            raise RuntimeError(f"drift pass: router call {self._read - 1} saw {rows} rows, the unperturbed pass "
                               f"{len(entry[2])}: the two passes did not run the same micro batches")
        return entry


class RouteProbe:
    """Forward hooks on the routers of a no-grad pass that compare, on every row holding a rollout route, the
    rollout's top-k for that (sample, token, layer), read from the samples' own routes:

    - with the router's own top-k (from its live logits, what it would choose unreplayed): the routing flip rate,
      over the response rows and the prompt rows of the real samples apart;
    - under replay, with the routing map Megatron actually used: proof the rollout's routes were replayed at the
      right token and layer. Rows are mapped back through ``row_origins``, independently of the packed replay
      targets, so a route packed one row off or handed to the wrong layer shows as a mismatch.

    Nothing is read back to the host per router call: the counts that depend on the forward accumulate on the
    device, and ``counts`` reads them once, after the pass (48 layers x ~200 forwards a step would otherwise each
    wait for the device)."""

    # the counts accumulated on the device, in ProbeCounts' field names
    _ON_DEVICE = ("flips", "prompt_flips", "replay_mismatches", "margin_sum", "small_margins", "expert_load",
                  "replaced_slots", "reachable", "drift_reachable", "drift_flips", "drift_over_reach")

    def __init__(self, routers: list, num_layers: int, layout: TokenLayout, routes: Sequence[np.ndarray],
                 loss_masks: Sequence[np.ndarray] | None = None, trace: bool = False,
                 soft_ratio: float | None = None, unit_roundoff: float = 0.0,
                 drift_reference: DriftReference | None = None):
        self.routers = routers
        # the drift pass (r3rl.train.drift): the unperturbed pass's rows are kept into it (``keeping``), then the
        # perturbed pass reads them back in the same router-call order
        self.drift = drift_reference
        self.soft_ratio = soft_ratio
        self.unit_roundoff = unit_roundoff  # of the engine's dtype: what its rounding of a logit can move it by
        # debug.route_trace: per sample, this rank's part of the digest of the routing Megatron used under replay
        # (r3rl.route_trace), summed over the ranks that split the rows and the stages that split the layers
        self.digests = np.zeros(len(routes), dtype=np.uint64) if trace else None
        self.loss_masks = loss_masks  # per sample: which response rows count (None: all of them)
        self.num_layers = num_layers
        self.num_experts = routers[0].config.num_moe_experts
        self._host = ProbeCounts.zeros(num_layers, self.num_experts)  # what the rows alone decide
        self._device: dict[str, torch.Tensor] | None = None
        self.layout = layout
        self.routes = routes
        self._expected: _Expected | None = None
        self._replaying = False
        self._handles = []

    def expect(self, mb: MicroBatch | None, *, replaying: bool, valid: Sequence[bool] | None = None) -> None:
        """The next forward runs ``mb`` (``valid[b]``: slot b is a real sample, not a padding repeat)."""
        self._expected = _Expected(mb, self.layout, self.routes, valid, self.loss_masks,
                                   trace=self.digests is not None and replaying) if mb is not None else None
        self._replaying = replaying

    @property
    def counts(self) -> ProbeCounts:
        """The pass's counts: the device's accumulators read back once, beside the row counts kept on the host."""
        out = ProbeCounts(*(np.array(getattr(self._host, f.name)) for f in dataclasses.fields(ProbeCounts)))
        if self._device is not None:  # one copy: every accumulator in one float64 vector (exact below 2^53)
            flat = torch.cat([t.double().flatten() for t in self._device.values()]).cpu().numpy()
            offset = 0
            for name in self._ON_DEVICE:
                like = getattr(out, name)
                part = flat[offset:offset + like.size].reshape(like.shape)
                offset += like.size
                setattr(out, name, like + (np.round(part).astype(like.dtype) if like.dtype == np.int64 else part))
        return out

    def _accumulators(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._device is None:
            self._device = {name: torch.zeros_like(torch.from_numpy(getattr(self._host, name)), device=device)
                            for name in self._ON_DEVICE}
        return self._device

    def _drift(self, acc: dict, layer: int, top, own: torch.Tensor, margins: torch.Tensor, reach: torch.Tensor,
               response: torch.Tensor, scores: torch.Tensor) -> None:
        """Keep this call's rows (the unperturbed pass) or, in the perturbed pass, count against the kept ones: the
        move of the kept pair's margin (``scores``: ungrouped), and the rows the reach plus that move (times
        ``DriftReference.scale``) covers or the perturbation flipped."""
        k = own.shape[1]
        if self.drift.keeping:  # expert ids narrow (int16 holds every MoE's) while they wait for the second pass
            self.drift.kept.append((top.indices[:, k - 1:k + 1].to(torch.int16), own.to(torch.int16), margins, reach))
            return
        pair, own_before, before, reach_before = self.drift.next(len(margins))
        # the pair's scores before any group mask: a group the perturbed pass dropped leaves them finite
        moved = scores.gather(1, pair.long()).double()
        # a margin the groups made infinite (no (k+1)-th expert left in the chosen groups) has no move to measure
        delta = torch.where(torch.isfinite(before), ((moved[:, 0] - moved[:, 1]) - before).abs(), 0.0)
        flipped = ~_same_sets(own, own_before.long())
        # a row the emulated rounding flipped is within the precision's reach whatever its pair's move (a changed
        # group choice flips rows whose pair barely moved)
        reachable = (before < reach_before + self.drift.scale * delta) | flipped
        acc["drift_reachable"][layer] += (reachable & response).sum()
        acc["drift_flips"][layer] += (flipped & response).sum()
        ratio = delta / torch.clamp(reach_before, min=torch.finfo(torch.float64).tiny)
        acc["drift_over_reach"][layer] += torch.where(response, ratio, 0.0).sum()

    def _hook(self, router, args, output) -> None:
        exp = self._expected
        if exp is None:
            return
        layer = route_column(router)
        hidden = args[0]
        with torch.no_grad():
            experts, k = self.num_experts, router.topk
            logits = router.gating(hidden).view(-1, experts)
            acc = self._accumulators(logits.device)
            rows, routes, response, prompt = exp.on(logits.device)
            rollout = routes[:, layer]
            # the top k+1 selection scores carry the router's own top-k and its margin (k-th minus (k+1)-th)
            row_logits = logits[rows]
            top = torch.topk(selection_scores(row_logits, router), min(k + 1, experts), dim=-1)
            own = top.indices[:, :k]
            flipped = ~_same_sets(own, rollout)
            self._host.routed_rows[layer] += int(exp.response.sum())
            self._host.prompt_rows[layer] += int(exp.prompt.sum())
            acc["flips"][layer] += (flipped & response).sum()
            acc["prompt_flips"][layer] += (flipped & prompt).sum()
            # masks and scatters only: a boolean index runs nonzero and CUDA's bincount reads its range back, each
            # a host sync per router call
            if experts > k:  # metrics.router_margins' definition, in float64 as there
                margins = top.values[:, k - 1].double() - top.values[:, k].double()
                acc["margin_sum"][layer] += torch.where(response, margins, 0.0).sum()
                acc["small_margins"][layer] += ((margins < M.SMALL_ROUTER_MARGIN) & response).sum()
                reach = rounding_reach(hidden.reshape(-1, hidden.shape[-1])[rows], row_logits, top, k, router,
                                       self.unit_roundoff)
                acc["reachable"][layer] += ((margins < reach) & response).sum()
                if self.drift is not None:
                    self._drift(acc, layer, top, own, margins, reach, response,
                                selection_scores(row_logits, router, grouped=False))
            acc["expert_load"][layer].scatter_add_(0, own.flatten(), response[:, None].expand(-1, k).flatten().long())
            if self._replaying:
                used = output[1].view(-1, experts)[rows].bool()
                replayed = rollout
                if self.soft_ratio is not None:  # the filter recomputed from the live logits, independently
                    replayed, replaced = soft_targets(probs_from_logits(row_logits, router.config), rollout,
                                                      self.soft_ratio)
                    acc["replaced_slots"][layer] += replaced.sum()
                expected = torch.zeros_like(used).scatter(1, replayed, True)
                self._host.replay_rows[layer] += len(exp.rows)
                acc["replay_mismatches"][layer] += (used != expected).any(dim=-1).sum()
                if exp.trace is not None:
                    self._trace(used, layer, k, exp.trace)

    def _trace(self, used: torch.Tensor, layer: int, k: int, rows: tuple) -> None:
        """Add this layer's rows to their samples' digests: the experts the routing map used (its first k set
        columns; a row with fewer than k hashes differently, as it should), with each row's position and token."""
        real, sample, pos, tokens = rows
        used = used.cpu().numpy()
        experts = np.argsort(~used, axis=1, kind="stable")[:, :k]
        hashes = route_trace.row_hashes(pos[real], tokens[real], np.full(int(real.sum()), layer), experts[real])
        with np.errstate(over="ignore"):
            np.add.at(self.digests, sample[real], hashes)

    def __enter__(self) -> "RouteProbe":
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._expected = None
