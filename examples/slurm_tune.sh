#!/bin/bash
# l2ir tune on a SLURM allocation through Dask distributed (search/cluster.py, README "Tuning on a cluster").
#
#   sbatch examples/slurm_tune.sh                                   the 48-shape grid sample
#   TUNE_ARGS="--shape 4096x4096x4096 --budget-candidates 64" sbatch examples/slurm_tune.sh
#   TUNE_ARGS="--resume 1" sbatch examples/slurm_tune.sh           a driver that died continues its run 1
#
# What runs where:
#   first node   `dask scheduler`, which writes its address to a scheduler file, and the driver, `l2ir tune
#                --cluster SCHEDULER_FILE`: it lowers the candidates, asks for compiles and evaluations, and is the
#                only process that writes the records DB (no GPU needed for it).
#   every node   one `dask worker --resources GPU=1 --nthreads 1` per GPU, each seeing only its GPU: evaluations
#                need GPU=1, so each GPU times one kernel at a time and never shares its SMs or L2 with another;
#                and one CPU worker with the node's other cores: compiles (nvcc, minutes for a CUTLASS kernel) are
#                tasks without resources, which any worker takes, so without it they queue on the GPU workers'
#                single threads.
# Workers run under Dask's nanny: a worker process that dies (a faulting kernel takes down only the evaluator's own
# process, but an out-of-memory kill takes the worker) is restarted, and its evaluation runs again elsewhere.
# Nothing but the scheduler file needs a shared filesystem: compiled kernels travel back to the driver's cache.
# Every node needs the same Python environment, nvcc and CUTLASS as the driver (a worker whose toolchain keys a
# kernel differently fails that compile and says so). dask-jobqueue's SLURMCluster is the other documented way
# (the workers as separate batch jobs, started from Python); this script needs only dask and distributed.
#
#SBATCH --job-name=l2ir-tune
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=08:00:00
#SBATCH --output=l2ir-tune-%j.out

set -euo pipefail

# Settings (environment variables override them).
VENV=${VENV:-$SLURM_SUBMIT_DIR/.venv}                        # the environment with l2ir[cluster] installed
TUNE_ARGS=${TUNE_ARGS:---grid --sample 48}                   # what to tune (l2ir tune --help)
RUN_DIR=${RUN_DIR:-$SLURM_SUBMIT_DIR/l2ir-tune-$SLURM_JOB_ID} # on a filesystem every node sees (the scheduler file)
DB=${DB:-$SLURM_SUBMIT_DIR/records.db}                       # the records DB, written by the driver only
CACHE_DIR=${CACHE_DIR:-}                                     # the driver's compile cache (default: l2ir's own)

# shellcheck disable=SC1091
source "$VENV/bin/activate"
mkdir -p "$RUN_DIR"
SCHEDULER_FILE=$RUN_DIR/scheduler.json
rm -f "$SCHEDULER_FILE"                                      # a stale file would point at a dead scheduler
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export SCHEDULER_FILE RUN_DIR

cleanup() {
    local rc=$?                                  # the driver's exit status is the job's
    set +e
    # The workers and the scheduler are job steps of this job: they end with it, but end them now so that the
    # allocation is given back as soon as the driver is done. Workers first: a worker whose scheduler is gone
    # waits for it (--death-timeout) before it exits.
    for pid in ${WORKERS_PID:-} ${SCHEDULER_PID:-}; do
        kill "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    exit "$rc"
}
trap cleanup EXIT

# 1. The scheduler, on the first node (a job step that shares the allocation: --overlap).
srun --nodes=1 --ntasks=1 --nodelist="$HEAD_NODE" --overlap --cpus-per-task=1 \
    python -m dask scheduler --scheduler-file "$SCHEDULER_FILE" --no-dashboard \
    >"$RUN_DIR/scheduler.log" 2>&1 &
SCHEDULER_PID=$!
for _ in $(seq 120); do [ -s "$SCHEDULER_FILE" ] && break; sleep 1; done
if [ ! -s "$SCHEDULER_FILE" ]; then
    echo "error: the Dask scheduler wrote no $SCHEDULER_FILE in 2 minutes (see $RUN_DIR/scheduler.log)" >&2
    exit 1
fi

# 2. The workers: one task per node, which starts that node's GPU workers and its CPU worker.
#    SLURM sets CUDA_VISIBLE_DEVICES to the node's allocated GPUs (not always 0..N-1 on a shared node): worker i
#    gets the i-th of them. DAEMON=False: the evaluator starts a process of its own for its GPU, and daemonic
#    processes (Dask's default for workers) cannot have children; the driver refuses daemonic GPU workers.
#    --death-timeout: a worker whose scheduler is gone exits instead of waiting for it.
node_workers() {
    set -u
    trap 'kill $(jobs -p) 2>/dev/null; wait' TERM    # ending this step ends the nannies, each nanny its worker
    local gpus node scratch cpus i
    IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES:-}"
    node=$(hostname -s)
    scratch=${TMPDIR:-/tmp}/l2ir-dask-$SLURM_JOB_ID
    for i in "${!gpus[@]}"; do
        CUDA_VISIBLE_DEVICES=${gpus[$i]} DASK_DISTRIBUTED__WORKER__DAEMON=False \
            python -m dask worker --scheduler-file "$SCHEDULER_FILE" --name "$node-gpu-$i" \
            --nthreads 1 --resources GPU=1 --memory-limit 0 --death-timeout 120 --no-dashboard \
            --local-directory "$scratch/gpu-$i" >"$RUN_DIR/worker-$node-gpu-$i.log" 2>&1 &
    done
    # The rest of the cores compile (nvcc builds one kernel per thread); this worker sees no GPU.
    cpus=$(( ${SLURM_CPUS_ON_NODE:-$(nproc)} - ${#gpus[@]} ))
    CUDA_VISIBLE_DEVICES= python -m dask worker --scheduler-file "$SCHEDULER_FILE" --name "$node-cpu" \
        --nthreads $(( cpus > 1 ? cpus : 1 )) --memory-limit 0 --death-timeout 120 --no-dashboard \
        --local-directory "$scratch/cpu" >"$RUN_DIR/worker-$node-cpu.log" 2>&1 &
    wait
}
export -f node_workers
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --overlap bash -c node_workers &
WORKERS_PID=$!

# 3. The driver, on the first node (where this batch script runs). It waits for a GPU worker (a minute at most);
#    workers that join later take evaluations as they come. If it dies, TUNE_ARGS="--resume RUN" continues the run
#    where its records end.
# shellcheck disable=SC2086
l2ir tune $TUNE_ARGS --db "$DB" ${CACHE_DIR:+--cache-dir "$CACHE_DIR"} --cluster "$SCHEDULER_FILE"
