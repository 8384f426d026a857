#!/usr/bin/env bash
# One `ringq bench` on a CUDA machine whose MLX CUDA build was staged to /tmp/site
# (../shared/device/stage-mlx-cuda.sh; see bench/results/README.md), writing NAME.json and NAME.log
# under $OUT (default bench/results). Every GPU of the machine is used, one per rank.
#
#   bench/gpu_bench.sh NAME --model random:llama-3.1-8b --pp 32768,131008 --tg 64 ...
set -euo pipefail
name=$1
shift
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export RINGQ_BACKEND=cuda NCCL_NVLS_ENABLE=0 RINGQ_HOME=${RINGQ_HOME:-/tmp/ringq-home}
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader | tee "$out/$name.gpus"
python3 -m cli.main bench --json-out "$out/$name.json" "$@" 2>&1 | tee "$out/$name.log"
