#!/bin/bash
# One Ray node of a Slurm job: `ray_node.sh head` (slurm/ray.sub runs it on the batch host) or `ray_node.sh worker`
# (ray.sub runs it through srun on every other node). It starts `ray start --block` and, on SIGTERM/SIGINT/SIGHUP or
# when Ray dies, stops exactly what it started: the `ray start` process by PID (Ray then stops its own children), its
# process group, then any process still carrying this node's owner mark. Never `ray stop` (it kills every Ray of
# every user on the node) and never anything by name.
# Configuration comes from the environment that ray.sub exported (slurm/common.sh lists it).
set -euo pipefail

# shellcheck source=slurm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

role=${1:-}
[[ $role == head || $role == worker ]] || { echo "usage: ray_node.sh head|worker" >&2; exit 2; }
: "${SLURM_JOB_ID:?ray_node.sh runs inside a Slurm job (started by slurm/ray.sub)}"
: "${HEAD_IP:?HEAD_IP is not set (slurm/ray.sub exports it)}"
: "${LOG_DIR:?LOG_DIR is not set (slurm/ray.sub exports it)}"
: "${RAY:?RAY is not set (slurm/ray.sub exports it)}"
r3rl_defaults

node=${SLURMD_NODENAME:-$(hostname -s)}
R3RL_LOG_TAG="ray-$role@$node"
# Inherited by every process Ray starts on this node (GCS, raylet, workers): the last-resort sweep finds exactly
# those, and no process of another job or user.
owner="$SLURM_JOB_ID.$node.$role"
gpus=${GPUS_PER_NODE:-$(r3rl_gpu_count)}
cpus=${CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-$(nproc)}}

# The head runs in the launcher's environment, which already ran it; another node needs its own (modules,
# node-local folders).
if [[ $role == worker && -n $SETUP_COMMAND ]]; then
    eval "$SETUP_COMMAND" || r3rl_die "SETUP_COMMAND failed (exit code $?): $SETUP_COMMAND"
fi

node_ports=(NODE_MANAGER_PORT OBJECT_MANAGER_PORT RUNTIME_ENV_AGENT_PORT DASHBOARD_AGENT_GRPC_PORT
            METRICS_EXPORT_PORT DASHBOARD_AGENT_LISTEN_PORT)
args=(start --block --num-cpus "$cpus" --num-gpus "$gpus" --disable-usage-stats
      --node-manager-port "$NODE_MANAGER_PORT" --object-manager-port "$OBJECT_MANAGER_PORT"
      --runtime-env-agent-port "$RUNTIME_ENV_AGENT_PORT" --dashboard-agent-grpc-port "$DASHBOARD_AGENT_GRPC_PORT"
      --dashboard-agent-listen-port "$DASHBOARD_AGENT_LISTEN_PORT" --metrics-export-port "$METRICS_EXPORT_PORT"
      --min-worker-port "$MIN_WORKER_PORT" --max-worker-port "$MAX_WORKER_PORT")
if [[ $role == head ]]; then
    check_ip=$HEAD_IP
    node_ports+=(GCS_PORT CLIENT_SERVER_PORT DASHBOARD_METRIC_PORT AUTOSCALER_METRIC_PORT)
    if [[ $DASHBOARD == 1 ]]; then node_ports+=(DASHBOARD_PORT); fi
    args+=(--head --node-ip-address "$HEAD_IP" --port "$GCS_PORT" --ray-client-server-port "$CLIENT_SERVER_PORT"
           --dashboard-port "$DASHBOARD_PORT")
    if [[ $DASHBOARD == 1 ]]; then args+=(--include-dashboard true); else args+=(--include-dashboard false); fi
else
    check_ip=${NODE_IP:-127.0.0.1}
    args+=(--address "$HEAD_IP:$GCS_PORT")
    if [[ -n ${NODE_IP:-} ]]; then args+=(--node-ip-address "$NODE_IP"); fi
fi
# Intentionally word-split: EXTRA_RAY_ARGS holds several flags.
# shellcheck disable=SC2206
args+=($EXTRA_RAY_ARGS)

r3rl_check_ports "$check_ip" "${node_ports[@]}"
# One folder per job and node: Ray's sockets live there (node-local, short path), two fake nodes on one machine
# must not share it, and it is this user's alone (r3rl_private_dir: 0700, refused if a co-tenant made it first).
# Ray's own temp dir is inside it, as "r": Ray makes that one world-writable (0777) for multi-user machines.
tmp="$RAY_TMP_ROOT/r3rl-ray-$SLURM_JOB_ID-$node"
r3rl_private_dir "$tmp"
args+=(--temp-dir "$tmp/r")
mkdir -p "$LOG_DIR/pids"
# the launcher stops a worker by this PID (from a step on this node), so its clean-up below runs in full
echo "$$" > "$LOG_DIR/pids/agent-$role-$node"

ray_pid=""
stopping=0

stop_ray() {
    # Slurm sends SIGTERM to every process of a cancelled job, this one included, more than once: finish the
    # clean-up instead of starting it again.
    (( stopping )) && return 0
    stopping=1
    trap '' TERM INT HUP
    local waited=0 left pid
    if r3rl_alive "$ray_pid"; then
        kill -TERM "$ray_pid" 2>/dev/null || true
        while r3rl_alive "$ray_pid" && (( waited < NODE_STOP_TIMEOUT * 5 )); do
            sleep 0.2
            waited=$((waited + 1))
        done
        if r3rl_alive "$ray_pid"; then
            r3rl_log "ray start (pid $ray_pid) still running after ${NODE_STOP_TIMEOUT}s: killing its process group"
        fi
    fi
    # setsid made ray start the leader of its own process group: whatever is still in it is ours.
    if [[ -n $ray_pid ]]; then kill -KILL -- "-$ray_pid" 2>/dev/null || true; fi
    left=()
    # shellcheck disable=SC2013  # one PID per word
    for pid in $(grep -lszFx "R3RL_RAY_OWNER=$owner" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
        if [[ $pid != "$$" ]] && r3rl_alive "$pid"; then left+=("$pid"); fi
    done
    if (( ${#left[@]} )); then
        r3rl_log "killing ${#left[@]} Ray process(es) of this node that outlived ray start: ${left[*]}"
        kill -KILL "${left[@]}" 2>/dev/null || true
    fi
    if [[ $COPY_RAY_LOGS == 1 && -d $tmp/r/session_latest/logs ]]; then
        mkdir -p "$LOG_DIR/ray-$role-$node"
        # -P: a link inside is copied as a link, never followed to a file elsewhere
        cp -rP "$tmp/r/session_latest/logs/." "$LOG_DIR/ray-$role-$node/" 2>/dev/null || true
    fi
    if [[ $KEEP_RAY_TMP != 1 ]]; then rm -rf "$tmp"; fi
    r3rl_log "stopped: no Ray process of $owner left"
}

on_signal() {
    r3rl_log "received SIG$1: stopping Ray on $node"
    stop_ray
    exit 0
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap 'on_signal HUP' HUP
trap 'stop_ray' EXIT

r3rl_log "starting Ray $role on $node: $cpus CPUs, $gpus GPUs (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}), temp dir $tmp"
R3RL_RAY_OWNER=$owner setsid "$RAY" "${args[@]}" < /dev/null &
ray_pid=$!
echo "$ray_pid" > "$LOG_DIR/pids/ray-$role-$node"

# `wait` returns early when a trapped signal arrives; the handler then exits, so a return here means Ray ended.
rc=0
wait "$ray_pid" || rc=$?
r3rl_log "error: ray start exited on its own (exit code $rc) on $node; see above and $tmp/r/session_latest/logs"
exit $(( rc == 0 ? 1 : rc ))
