# Sourced (not run) by a batch script that starts its own driver, such as the one hydra-submitit-launcher writes for
# `python run.py -m hydra/launcher=ray_slurm ...` (conf/hydra/launcher/ray_slurm.yaml lists it under `setup:`).
# It brings the job's Ray cluster up with slurm/ray.sub in interactive mode, exports RAY_ADDRESS and
# R3RL_SLURM_OVERRIDES for the driver, and when the batch script exits it stops the launcher by its PID, which
# stops the Ray processes it started. Settings: the same environment variables as slurm/ray.sub.

r3rl_up_repo=${REPO_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export LOG_ROOT=${LOG_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
r3rl_up_env=$LOG_ROOT/$SLURM_JOB_ID-logs/ray.env

INTERACTIVE=1 REPO_DIR=$r3rl_up_repo bash "$r3rl_up_repo/slurm/ray.sub" &
R3RL_LAUNCHER_PID=$!

r3rl_up_stop() {
    if kill -0 "$R3RL_LAUNCHER_PID" 2>/dev/null; then
        kill -TERM "$R3RL_LAUNCHER_PID" 2>/dev/null
        wait "$R3RL_LAUNCHER_PID" 2>/dev/null
    fi
}
trap r3rl_up_stop EXIT

# The launcher writes ray.env once every node has joined; if it exits first, the cluster could not start and its
# own message (in the job's output and <job id>-logs/launcher.log) says why.
until [[ -f $r3rl_up_env ]]; do
    if ! kill -0 "$R3RL_LAUNCHER_PID" 2>/dev/null; then
        wait "$R3RL_LAUNCHER_PID" 2>/dev/null
        echo "error: the Ray cluster of job $SLURM_JOB_ID did not start; see $LOG_ROOT/$SLURM_JOB_ID-logs/launcher.log" >&2
        exit 1
    fi
    sleep 1
done
# shellcheck disable=SC1090
source "$r3rl_up_env"
