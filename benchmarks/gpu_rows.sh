#!/usr/bin/env bash
# The GPU rows of BENCHMARKS.md section 5, in the stages a lent GPU machine allows (it has JAX with
# CUDA but no Keras and no registry). Data travel with the calls: Fashion-MNIST as a tar (30 MB),
# CIFAR-10 as `tar -C ../shared/data -cf - cifar10 | xz -T2 --delta=dist=1` (130 MB, against 178 MB
# of pickles) cut into parts that fit beside the tree, one part per call while the machine is warm.
#   bash benchmarks/gpu_rows.sh nodata   # device info, resnet50-synthetic, cifar10-cnn precisions
#   bash benchmarks/gpu_rows.sh fastbench # cifar10-fast train-step throughput (input-pipeline row)
#   bash benchmarks/gpu_rows.sh xlaflags  # resnet50-synthetic against plain Keras under XLA GPU
#                                         # options a trainer controls (issue 52: which to make
#                                         # meshfit's default), at batch 256
#   bash benchmarks/gpu_rows.sh mainjob DIR # the main job timed from outside (4 fresh processes,
#                                         # the first with JAX's compile cache empty), then one
#                                         # run's imports (python -X importtime, top 25), then
#                                         # one run's costliest calls (cProfile) and compilations,
#                                         # and whether CUDA's start overlaps Keras' import
#   bash benchmarks/gpu_rows.sh profile   # resnet50-synthetic at batch 256, meshfit against plain
#                                         # Keras, with steps 22-26 of meshfit's row traced: the
#                                         # device time by kind of kernel (benchmarks/xplane_ops.py);
#                                         # then the two again, alternating 3 times
#   bash benchmarks/gpu_rows.sh data DIR  # cifar10-cnn time to accuracy, cifar10-fast over 5 seeds
#                                         # at each of FAST_EPOCHS (default "12 11": the recipe's
#                                         # and one fewer; SKIP_CNN=1 leaves cifar10-cnn out),
#                                         # then one cifar10-fast run profiled (cProfile)
#   bash benchmarks/gpu_rows.sh firstepoch DIR  # cifar10-fast's first epoch traced on the device
#   bash benchmarks/gpu_rows.sh table FOLDER... # here, after the lease: the targets' table from
#                                         # the folders the calls' $OUT came back in
# Logs and metrics go to $OUT (default: gpu-rows/).
set -uo pipefail
# Here, over the folders the calls' $OUT came back in: one row per target of issue 52.
[ "$1" = table ] && exec python3 benchmarks/gpu_table.py "${@:2}"
OUT=${OUT:-gpu-rows}
mkdir -p "$OUT"
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1
log="$OUT/$1.log"
top_calls() {  # the N costliest calls (cumulative) of cProfile's file $1
  python3 -c 'import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats("cumulative").print_stats(int(sys.argv[2]))' \
    "$1" "$2" 2>&1 | tail -$(($2 + 15)) | tee -a "$log"
}
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
    # The flags reach both paths (the workers inherit XLA_FLAGS): each set's samples/s against the
    # default's says whether meshfit should set it on GPUs, where plain Keras would not.
    for flags in "" --xla_gpu_enable_command_buffer= --xla_gpu_enable_latency_hiding_scheduler=true; do
      echo "XLA_FLAGS='$flags'" | tee -a "$log"
      XLA_FLAGS="$flags" timeout 150 python3 -m meshfit bench resnet50-synthetic --engines jax \
        --steps-per-dispatch 1 --global-batches 256 --repeats 3 --json 2>&1 | grep '^bench:' | tee -a "$log"
    done ;;
  mainjob)
    python3 benchmarks/main_job.py --runs 4 --data-dir "$2" --json "$OUT/mainjob.json" 2>&1 | tee -a "$log"
    python3 -X importtime -m meshfit train fashion-mnist-cnn --data-dir "$2" --out /tmp/r-imports \
      > /dev/null 2> "$OUT/importtime.txt"
    grep '^import time:' "$OUT/importtime.txt" | sort -t'|' -k2 -n -r | head -25 | tee -a "$log"
    # Where start-up and set-up go: one more run profiled (cProfile), with each XLA compilation
    # and cache hit logged (JAX_LOG_COMPILES): the 30 costliest calls, then the compilations.
    JAX_LOG_COMPILES=1 python3 -m cProfile -o "$OUT/mainjob.prof" -m meshfit train fashion-mnist-cnn \
      --data-dir "$2" --out /tmp/r-profiled > /dev/null 2> "$OUT/compiles.log"
    top_calls "$OUT/mainjob.prof" 30
    python3 benchmarks/compile_log.py "$OUT/compiles.log" 2>&1 | tee -a "$log"
    python3 benchmarks/start_overlap.py --runs 3 2>&1 | tee -a "$log" ;;
  firstepoch)
    # cifar10-fast's first epoch held 0.5-1.7 s more than the others on the H200, more with JAX's
    # cache filled than empty: a guess is the GPU libraries' kernels loaded at their first use,
    # which autotuning does during a compile but a cached program leaves to the first epoch. Its
    # 48 steps and the second epoch's traced (after the compile): the device's busy share of the
    # span, and the host's costliest events (module loads?); the trace is kept in
    # $OUT/firstepoch-trace, where the gap between the two epochs shows the input wait (0.03-0.05
    # s an epoch).
    timeout 150 python3 -m meshfit train cifar10-fast --epochs 3 --profile 1:96 --data-dir "$2" \
      --out /tmp/r-fast-first 2>&1 | grep -E '^epoch|compile' | tee -a "$log"
    python3 benchmarks/xplane_ops.py /tmp/r-fast-first/tensorboard --steps 96 --host 25 2>&1 | tee -a "$log"
    cp -r /tmp/r-fast-first/tensorboard/plugins "$OUT/firstepoch-trace" ;;
  profile)
    timeout 200 python3 -m meshfit bench resnet50-synthetic --engines jax --steps-per-dispatch 1 \
      --global-batches 256 --repeats 3 --profile 22:26 --out /tmp/b-prof 2>&1 | tee -a "$log"
    cp /tmp/b-prof/bench.json "$OUT/bench-resnet50-traced.json" 2>/dev/null
    python3 benchmarks/xplane_ops.py /tmp/b-prof/profile --steps 5 2>&1 | tee -a "$log"
    # The ratio again with the paths alternating 3 times: the lowered steps are the same program
    # (BENCHMARKS.md section 5), so a gap of a few per cent may be the order the rows ran in.
    timeout 240 python3 -m meshfit bench resnet50-synthetic --engines jax --steps-per-dispatch 1 \
      --global-batches 256 --repeats 3 --rounds 3 --out /tmp/b-rounds 2>&1 | tee -a "$log"
    cp /tmp/b-rounds/bench.json "$OUT/bench-resnet50-rounds.json" 2>/dev/null ;;
  data)
    data=$2
    [ -n "${SKIP_CNN:-}" ] || timeout 200 python3 -m meshfit train cifar10-cnn --data-dir "$data" --out /tmp/r-cnn --json 2>&1 | tee -a "$log"
    cp /tmp/r-cnn/metrics.json "$OUT/cifar10-cnn-metrics.json" 2>/dev/null
    for epochs in ${FAST_EPOCHS:-12 11}; do
      for s in 0 1 2 3 4; do
        run=/tmp/r-fast-$epochs-$s
        timeout 100 python3 -m meshfit train cifar10-fast --seed $s --epochs $epochs --data-dir "$data" --out $run --json 2>&1 | tee -a "$log"
        # metrics.json is indented: one line per run here
        python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))' \
          $run/metrics.json >> "$OUT/cifar10-fast-metrics.jsonl"
      done
    done
    # Where a run's time outside the steps goes (the first epoch held 0.5-1.7 s more than the
    # others on the H200): one more run, seed 0, profiled with cProfile ($OUT/cifar10-fast.prof).
    JAX_LOG_COMPILES=1 timeout 150 python3 -m cProfile -o "$OUT/cifar10-fast.prof" -m meshfit train \
      cifar10-fast --data-dir "$data" --out /tmp/r-fast-profiled 2> "$OUT/cifar10-fast-compiles.log" \
      | grep '^epoch' | tee -a "$log"
    top_calls "$OUT/cifar10-fast.prof" 40
    python3 benchmarks/compile_log.py "$OUT/cifar10-fast-compiles.log" --top 10 2>&1 | tee -a "$log"
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
