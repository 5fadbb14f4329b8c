# Shared by slurm/ray.sub and slurm/ray_node.sh; sourced, never run. Every knob is an environment variable with a
# default, so one launcher serves every model and size (see slurm/README.md for the full list and the port map).

# Fixed ports instead of Ray's random ones: a firewall can be opened for them, and two jobs that share a node can
# be given disjoint ranges (random ports still collide there, ray-project/ray#22663).
r3rl_defaults() {
    # head only
    : "${GCS_PORT:=6379}"
    : "${CLIENT_SERVER_PORT:=10001}"
    : "${DASHBOARD_PORT:=8265}"
    # every node
    : "${NODE_MANAGER_PORT:=6700}"
    : "${OBJECT_MANAGER_PORT:=6701}"
    : "${RUNTIME_ENV_AGENT_PORT:=6702}"
    : "${DASHBOARD_AGENT_GRPC_PORT:=6703}"
    : "${METRICS_EXPORT_PORT:=6704}"
    : "${DASHBOARD_AGENT_LISTEN_PORT:=52365}"
    : "${MIN_WORKER_PORT:=10002}"
    : "${MAX_WORKER_PORT:=10999}"
    # Ray reads these two itself (its head-side metrics servers would otherwise take fixed defaults of their own)
    : "${DASHBOARD_METRIC_PORT:=44227}"
    : "${AUTOSCALER_METRIC_PORT:=44217}"

    : "${DASHBOARD:=0}"
    : "${RAY_TMP_ROOT:=/tmp}"
    : "${HEAD_START_TIMEOUT:=180}"
    : "${NODE_JOIN_TIMEOUT:=300}"
    : "${NODE_STOP_TIMEOUT:=30}"
    : "${TEARDOWN_TIMEOUT:=90}"
    : "${PROBE:=1}"
    : "${COPY_RAY_LOGS:=1}"
    : "${KEEP_RAY_TMP:=0}"
    : "${EXTRA_RAY_ARGS:=}"
    : "${SETUP_COMMAND:=}"
    # A batch job has nothing to drain for Ray Serve; without this every node waits 30 s on SIGTERM.
    : "${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:=0}"
    : "${RAY_USAGE_STATS_ENABLED:=0}"
    export GCS_PORT CLIENT_SERVER_PORT DASHBOARD_PORT NODE_MANAGER_PORT OBJECT_MANAGER_PORT RUNTIME_ENV_AGENT_PORT \
        DASHBOARD_AGENT_GRPC_PORT METRICS_EXPORT_PORT DASHBOARD_AGENT_LISTEN_PORT MIN_WORKER_PORT MAX_WORKER_PORT \
        DASHBOARD_METRIC_PORT AUTOSCALER_METRIC_PORT DASHBOARD RAY_TMP_ROOT HEAD_START_TIMEOUT NODE_JOIN_TIMEOUT \
        NODE_STOP_TIMEOUT TEARDOWN_TIMEOUT PROBE COPY_RAY_LOGS KEEP_RAY_TMP EXTRA_RAY_ARGS SETUP_COMMAND \
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S RAY_USAGE_STATS_ENABLED

    local name
    for name in GCS_PORT CLIENT_SERVER_PORT DASHBOARD_PORT NODE_MANAGER_PORT OBJECT_MANAGER_PORT \
        RUNTIME_ENV_AGENT_PORT DASHBOARD_AGENT_GRPC_PORT METRICS_EXPORT_PORT DASHBOARD_AGENT_LISTEN_PORT \
        MIN_WORKER_PORT MAX_WORKER_PORT DASHBOARD_METRIC_PORT AUTOSCALER_METRIC_PORT; do
        if ! [[ ${!name} =~ ^[0-9]+$ ]] || (( ${!name} < 1 || ${!name} > 65535 )); then
            r3rl_die "$name=${!name} is not a port number"
        fi
    done
    (( MIN_WORKER_PORT <= MAX_WORKER_PORT )) || r3rl_die "MIN_WORKER_PORT=$MIN_WORKER_PORT > MAX_WORKER_PORT=$MAX_WORKER_PORT"
}

# The folder $1, made mode 0700 for this user, or refused: a predictable /tmp path is a co-tenant's to take first,
# and a folder or symlink they own would hold Ray's sockets and pickled objects. One this user left (a job that
# died) is taken back and made 0700 again. (A mktemp name would be safe too, but lengthens Ray's socket paths,
# which must stay under 108 characters.)
r3rl_private_dir() {
    local dir=$1
    if ! mkdir -m 700 "$dir" 2>/dev/null; then
        if [[ -L $dir || ! -d $dir || ! -O $dir ]]; then
            r3rl_die "$dir exists and is not a folder of this user (a symlink, a file or another user's): it could" \
                "read Ray's sockets and objects; remove it, or choose another RAY_TMP_ROOT"
        fi
        chmod 700 "$dir"
    fi
    [[ $(stat -c %a "$dir") == 700 ]] || r3rl_die "$dir: cannot make it mode 0700 (RAY_TMP_ROOT=${RAY_TMP_ROOT:-})"
}

r3rl_log() {
    local line
    line="[r3rl $(date +%H:%M:%S) ${R3RL_LOG_TAG:-launcher}] $*"
    printf '%s\n' "$line" >&2
    if [[ -n ${R3RL_LOG_FILE:-} ]]; then printf '%s\n' "$line" >> "$R3RL_LOG_FILE" 2>/dev/null || true; fi
}

r3rl_die() {
    r3rl_log "error: $*"
    exit 1
}

# Alive and not a zombie: a child that exited but was not reaped yet still answers kill -0.
r3rl_alive() {
    local pid=$1 stat
    [[ -n $pid ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}

# GPUs Slurm gave this node: the entries of CUDA_VISIBLE_DEVICES (Ray must get exactly these, or it hands out ids
# the job does not own), else SLURM_GPUS_ON_NODE (gres without device files), else none.
r3rl_gpu_count() {
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} && ${CUDA_VISIBLE_DEVICES} != NoDevFiles ]]; then
        local -a ids
        IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
        echo "${#ids[@]}"
    else
        echo "${SLURM_GPUS_ON_NODE:-0}"
    fi
}

r3rl_port_in_use() {
    timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
}

# Fails with the list of taken ports: a Ray left over from another job, or another user's, would otherwise make
# `ray start` fail only after about 40 s with a message about a bug in Ray.
r3rl_check_ports() {
    local ip=$1 name addr busy=()
    shift
    for name in "$@"; do
        for addr in "$ip" 127.0.0.1; do
            if r3rl_port_in_use "$addr" "${!name}"; then
                busy+=("$name=${!name} ($addr)")
                break
            fi
        done
    done
    if (( ${#busy[@]} )); then
        r3rl_die "port(s) already in use on ${SLURMD_NODENAME:-$(hostname -s)}: ${busy[*]}. Another Ray cluster (an earlier job, another \
user's job on this node) or another program holds them; give this job free ports, e.g. GCS_PORT=... \
NODE_MANAGER_PORT=... (port map: slurm/README.md)"
    fi
}

# Last lines of a log, indented, for error messages that must explain themselves.
r3rl_tail() {
    local file=$1 n=${2:-15}
    [[ -f $file ]] || return 0
    tail -n "$n" "$file" | sed 's/^/    | /' | tee -a "${R3RL_LOG_FILE:-/dev/null}" >&2
}

# The line of a node's log that says why it failed: our own error, or the last exception or panic of Ray's.
r3rl_cause() {
    [[ -f $1 ]] || return 0
    grep -E 'error:|Error|PANIC|Exception' "$1" | grep -v 'exited on its own' | tail -n 1 \
        | sed -E 's/^\[r3rl [0-9:]+ [^]]*\] //; s/^error: //; s/\x1b\[[0-9;]*m//g' || true
}
