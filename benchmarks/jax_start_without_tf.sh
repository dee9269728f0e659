#!/bin/bash
# A/B in one sitting: a JAX-engine run (8 simulated devices, 2 steps of fashion-mnist-cnn) with
# Keras leaving TensorFlow unloaded (A: meshfit's keras_internals.tensorflow_counted_once_loaded)
# and with Keras importing it as it does by itself (B: that function made a no-op). Prints wall
# and the run's goodput startup and setup per run, alternating A and B, 3 rounds.
#   bash benchmarks/jax_start_without_tf.sh [DATA_DIR]   (run from the repository root)
DATA=${1:-$PWD/../shared/data}
PY=${PY:-$PWD/.venv/bin/python}
cd /tmp
for i in 1 2 3; do
 for v in A B; do
  rm -rf /tmp/ab-$v
  patch=""; [ $v = B ] && patch="import meshfit.fit.keras_internals as k; k.tensorflow_counted_once_loaded=lambda: None;"
  s=$(date +%s.%N)
  KERAS_BACKEND=jax $PY -c "$patch
import sys; from meshfit.cli import main; sys.exit(main(['train','fashion-mnist-cnn','--simulate-devices','8','--epochs','1','--steps-per-epoch','2','--data-dir','$DATA','--out','/tmp/ab-$v','--no-tensorboard']))" >/dev/null 2>&1
  e=$(date +%s.%N)
  python3 -c "
import json,sys;g=json.load(open('/tmp/ab-$v/metrics.json'))['goodput']; g=g.get('seconds',g)
print('$v', 'wall %.2f'%($e-$s), 'startup %.2f setup %.2f'%(g['startup'],g['setup']), )"
 done
done
