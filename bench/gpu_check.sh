#!/usr/bin/env bash
# The device check: what this project's CPU machines cannot run, on a lent GPU machine (the workplace's
# `device` tool runs it from the repository root, with the machine's own python3 and torch). It runs the
# NCCL tests (tests/test_nccl.py), `meshjob run examples/tiny.yaml`, `meshjob bench resharding --quick
# --transport nccl` and the transport bench (bench/meshjob_bench/nccl_transport.py); the trainer runs on
# CUDA over NCCL wherever a GPU is visible. Logs and JSON go to $OUT. Every step has its own time limit
# (TESTS_S, RUN_S, RESHARD_S, BENCH_S; 0 skips a step), so one slow step leaves the others their time;
# CPU_S (opt-in) runs the resharding bench on this machine's cores, over gloo and over the TCP wire.
# Still open: whole training jobs over NCCL (7-rank ones have not finished on one GPU); with RUN_S=0 RESHARD_S=0
# BENCH_S=0 and pytest's -k "trains or timed" after the script's name, only those (a two-rank job first, then
# the 7-rank ones; a hung gang reports each rank's stacks) and the device-clock check run; if the 7-rank ones
# time out again, the same with MPS=1 (below).
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/trainer:$PWD/bench" PYTHONUNBUFFERED=1
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}  # ranks sharing the GPU talk through NCCL's sockets
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# also what a later run could use: ip and tc (the emulated NICs of `bench resharding`), CUDA MPS (ranks'
# kernels side by side on the one GPU instead of taking turns)
{ nvidia-smi -L; nproc; for tool in ip tc nvidia-cuda-mps-control; do command -v $tool || echo "no $tool"; done; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'nccl', torch.cuda.nccl.version(), 'gpus (NVML)', torch.cuda._device_count_nvml())"; } 2>&1 | tee "$OUT/env.txt"
# Opt-in (MPS=1): CUDA MPS for this script's ranks, so that their kernels run side by side on the one GPU
# instead of taking turns. A guess to test, not a finding: without MPS an NCCL kernel that waits for a peer
# holds the GPU for its whole time slice while the peer's kernel waits for its own, which would make a job of
# many NCCL steps crawl (the 7-rank training jobs above have not finished). A daemon, not a setting of the
# GPU: it is stopped when the script exits.
if [ "${MPS:-0}" != 0 ]; then
  if command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/meshjob-mps-pipe CUDA_MPS_LOG_DIRECTORY="$OUT/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      trap 'echo quit | nvidia-cuda-mps-control' EXIT
      echo "MPS: on" | tee -a "$OUT/env.txt"
    else
      echo "MPS: the daemon did not start" | tee -a "$OUT/env.txt"
    fi
  else
    echo "MPS: asked for, but nvidia-cuda-mps-control is missing" | tee -a "$OUT/env.txt"
  fi
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . -e trainer -e bench > "$OUT/install.log" 2>&1 \
  || echo "editable install failed (PYTHONPATH stands in): see install.log"
# SIGINT at the limit: pytest still reports what failed so far. Few workers: every NCCL communicator
# has its own proxy thread, and a gang of 8 ranks opens dozens.
# The defaults fit one call of about 9 minutes; the whole-job suites (tests/test_pipeline_equivalence.py,
# tests/test_training_equivalence.py) train on CUDA too, given TESTS and the time.
TESTS=${TESTS:-"tests/test_nccl.py"}
timeout -s INT -k 20 "${TESTS_S:-240}" python3 -m pytest -rA -p no:cacheprovider -n "${WORKERS:-3}" \
  --timeout 200 --tb short $TESTS "$@" > "$OUT/tests.log" 2>&1
grep -v -e "^\s*$" -e Benchmark "$OUT/tests.log" | tail -60
if [ "${RUN_S:-90}" != 0 ]; then  # the main job locally, as a user runs it: 4 ranks on the GPU over NCCL
  timeout "${RUN_S:-90}" python3 -m meshjob.cli run examples/tiny.yaml --checkpoint-dir "$OUT/ckpt" \
    > "$OUT/run.log" 2>&1
  echo "meshjob run examples/tiny.yaml: exit $?"; grep -v "socket.cpp" "$OUT/run.log" | tail -20
fi
if [ "${RESHARD_S:-120}" != 0 ]; then  # the resharding bench's quick run with its tiles on the GPU, over NCCL
  timeout "${RESHARD_S:-120}" python3 -m meshjob.cli bench resharding --quick --transport nccl \
    --out "$OUT/resharding" > "$OUT/resharding.log" 2>&1
  tail -15 "$OUT/resharding.log"
fi
if [ "${BENCH_S:-90}" != 0 ]; then
  timeout "${BENCH_S:-90}" python3 -m meshjob_bench.nccl_transport --out "$OUT" --mib "${MIB:-32}" --repeats 3 \
    > "$OUT/transport.log" 2>&1
  tail -25 "$OUT/transport.log"
fi
# Opt-in (CPU_S=600, each wire): the resharding bench on this machine's CPU cores over each CPU wire (CPU_WIRES:
# gloo, then the TCP wire), by default its paper-scale section (CPU_ARGS): this project's 2-core machines bound
# several issue targets by their cores (docs/benchmarks.md, "The machine's limits"); here 16 cores carry the same
# ranks. Emulated NICs need root, ip and tc (env.txt says).
if [ "${CPU_S:-0}" != 0 ]; then
  for wire in ${CPU_WIRES:-gloo tcp}; do
    timeout "${CPU_S:-0}" python3 -m meshjob.cli bench resharding --transport "$wire" \
      ${CPU_ARGS:---section paper_scale} --out "$OUT/cpu-resharding-$wire" > "$OUT/cpu-resharding-$wire.log" 2>&1
    tail -40 "$OUT/cpu-resharding-$wire.log"
  done
fi
