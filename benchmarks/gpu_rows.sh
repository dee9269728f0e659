#!/usr/bin/env bash
# The GPU rows of BENCHMARKS.md section 5, in the stages a lent GPU machine allows (it has JAX with
# CUDA but no Keras and no registry; CIFAR-10 travels in parts, see the project's notes).
#   bash benchmarks/gpu_rows.sh nodata   # device info, resnet50-synthetic, cifar10-cnn precisions
#   bash benchmarks/gpu_rows.sh fastbench # cifar10-fast train-step throughput (input-pipeline row)
#   bash benchmarks/gpu_rows.sh xlaflags  # resnet50-synthetic against plain Keras under XLA GPU
#                                         # options a trainer controls (issue 52: which to make
#                                         # meshfit's default), at batch 256 and 512
#   bash benchmarks/gpu_rows.sh data DIR  # cifar10-cnn time to accuracy, cifar10-fast over 5 seeds
#                                         # at each of FAST_EPOCHS (default "14 10": the recipe's,
#                                         # and airbench94's 9.9 rounded up, with its lookahead and
#                                         # multi-crop now in the recipe)
# Logs and metrics go to $OUT (default: gpu-rows/).
set -uo pipefail
OUT=${OUT:-gpu-rows}
mkdir -p "$OUT"
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1
log="$OUT/$1.log"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c 'import jax, keras; print("jax", jax.__version__, "keras", keras.__version__, jax.devices())'
} 2>&1 | tee -a "$log"
case "$1" in
  nodata)
    python3 -m meshfit info 2>&1 | tee -a "$log"
    timeout 240 python3 -m meshfit bench resnet50-synthetic --engines jax --out /tmp/b-resnet --json 2>&1 | tee -a "$log"
    cp /tmp/b-resnet/bench.json "$OUT/bench-resnet50.json" 2>/dev/null
    timeout 240 python3 -m meshfit bench cifar10-cnn --engines jax --precisions float32,bfloat16 \
      --steps-per-dispatch 1,8 --out /tmp/b-cnn --json 2>&1 | tee -a "$log"
    cp /tmp/b-cnn/bench.json "$OUT/bench-cifar10-cnn.json" 2>/dev/null ;;
  fastbench)
    timeout 240 python3 -m meshfit bench cifar10-fast --engines jax --steps-per-dispatch 8 \
      --out /tmp/b-fast --json 2>&1 | tee -a "$log"
    cp /tmp/b-fast/bench.json "$OUT/bench-cifar10-fast.json" 2>/dev/null ;;
  xlaflags)
    for flags in "" --xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_autotune_level=4 \
                 --xla_gpu_enable_command_buffer=; do
      echo "XLA_FLAGS='$flags'" | tee -a "$log"
      XLA_FLAGS="$flags" timeout 150 python3 -m meshfit bench resnet50-synthetic --engines jax \
        --steps-per-dispatch 1 --global-batches 256,512 --repeats 3 --json 2>&1 | tail -4 | tee -a "$log"
    done ;;
  data)
    data=$2
    [ -n "${SKIP_CNN:-}" ] || timeout 200 python3 -m meshfit train cifar10-cnn --data-dir "$data" --out /tmp/r-cnn --json 2>&1 | tee -a "$log"
    cp /tmp/r-cnn/metrics.json "$OUT/cifar10-cnn-metrics.json" 2>/dev/null
    for epochs in ${FAST_EPOCHS:-14 10}; do
      for s in 0 1 2 3 4; do
        run=/tmp/r-fast-$epochs-$s
        timeout 100 python3 -m meshfit train cifar10-fast --seed $s --epochs $epochs --data-dir "$data" --out $run --json 2>&1 | tee -a "$log"
        cat $run/metrics.json >> "$OUT/cifar10-fast-metrics.jsonl" 2>/dev/null; echo >> "$OUT/cifar10-fast-metrics.jsonl"
      done
    done
    python3 - "$OUT/cifar10-fast-metrics.jsonl" <<'EOF' 2>&1 | tee -a "$log"
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for epochs in sorted({r["epochs"] for r in runs}, reverse=True):
    rows = [r for r in runs if r["epochs"] == epochs]
    print(f"cifar10-fast {epochs} epochs: {len(rows)} seeds, test accuracy mean "
          f"{100 * statistics.mean(r['test_accuracy'] for r in rows):.2f}%, training time median "
          f"{statistics.median(r['train_seconds'] for r in rows):.2f} s")
EOF
    ;;
esac
