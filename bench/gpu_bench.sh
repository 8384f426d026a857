#!/usr/bin/env bash
# One `ringq bench` on a CUDA machine whose MLX CUDA build was staged to /tmp/site
# (../shared/device/stage-mlx-cuda.sh; see bench/results/h200x2/README.md), writing NAME.json and
# NAME.log under $OUT (default bench/results), and NAME-failed-runs.tgz with the rank logs of any
# run that failed. Every GPU of the machine is used, one per rank. The PNG is drawn afterwards
# from the JSON (cli/bench_plot.py), where matplotlib is.
#
#   bench/gpu_bench.sh NAME --model random:llama-3.1-8b --pp 32768,131008 --tg 64 ...
set -euo pipefail
name=$1
shift
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export RINGQ_BACKEND=cuda NCCL_NVLS_ENABLE=0 RINGQ_HOME=${RINGQ_HOME:-/tmp/ringq-home}
status=0
{
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
  python3 -m cli.main bench --json-out "$out/$name.json" "$@" 2>&1
} | tee "$out/$name.log" || status=$?
if compgen -G "$RINGQ_HOME/bench/*/*" >/dev/null; then
  tar czf "$out/$name-failed-runs.tgz" -C "$RINGQ_HOME" bench && rm -rf "$RINGQ_HOME/bench"
fi
exit $status
