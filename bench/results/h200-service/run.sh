#!/usr/bin/env bash
# The single-H200 runs of bench/results/h200-service/, in two device calls (each under 10 min):
#   bash bench/results/h200-service/run.sh service   # ringq up defaults: cold/warm, warm-up off
#   bash bench/results/h200-service/run.sh demo      # ringq demo on one GPU, calibration cells
# On the device machine, after the stage-mlx-cuda.sh unpack: PYTHONPATH=/tmp/site:$PWD.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/logs
model=random:llama-3.1-8b
case "${1:-service}" in
  service)
    nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv
    # 1st up on this machine (fresh: nothing compiled yet), then cold groups, then warm jobs
    python3 -m bench.gpu_service --model $model --pp 32700,32700,131000 --warm 2 \
      --out "$out/service.json" --logs /tmp/logs/default 2>&1 | grep -v '^\s*$'
    python3 -m bench.gpu_service --model $model --pp 32700,131000 --warm 1 \
      --env RINGQ_WARM_UP=0 --out "$out/service-no-warmup.json" --logs /tmp/logs/no-warmup
    tar czf "$out/logs-service.tgz" -C /tmp/logs .
    ;;
  demo)
    (cd /tmp && RINGQ_HOME=/tmp/demo-home timeout 300 python3 -m cli.main demo \
      --model random:llama-3.2-1b --max-tokens 32) > "$out/demo.txt" 2>&1
    echo "demo exit $?" >> "$out/demo.txt"
    tar czf "$out/logs-demo.tgz" -C /tmp/demo-home logs 2>/dev/null
    python3 -m bench.calibrate_admission --gpu --layouts single \
      --models random:llama-3.1-8b,random:llama-3.2-1b --pp 8192,32768,131072 \
      --json-out "$out/admission-calibration-h200.json" 2>&1 | tee "$out/calibration.txt"
    ;;
esac
