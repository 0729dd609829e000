#!/usr/bin/env bash
# Every many-core measurement in one run, for the 16-core GPU machine (../shared/device/README.md):
# timeline.py (where a lockstep batch step's wall time goes), manycore.py (the table, with the
# ZeroMQ column), cpu_split.py's many-core cells (CPU thread by thread) and PPO on Breakout with
# a CUDA learner on each backend. About 6 minutes on 16 cores; results and one log go to $OUT.
#
#   OUT=/tmp/out bash benchmarks/device/manycore.sh            # on the machine
#   QUICK=1 OUT=/tmp/out USE_PYTHON=.venv/bin/python bash benchmarks/device/manycore.sh   # a smoke run here
set -uo pipefail
OUT=${OUT:?set OUT to the folder results go to}
PY=${USE_PYTHON:-python3}
if [ -d .whl ] && ! $PY -c "import gymnasium, zmq, blake3, ale_py" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
LOG="$OUT/run.log"
{ git log -1 --format='commit %h %s' 2>/dev/null; id; uname -r; nproc; lscpu | grep -E "Model name|Thread|Core|Socket"; } > "$OUT/host.txt" 2>&1
if [ -n "${QUICK:-}" ]; then
  TL="--quick" MC="--quick --zmq-column" CS="--cases null64 --quick" PPO_STEPS=1024 PPO_ENVS=8 CUDA=""
else
  TL="--seconds 2" MC="--zmq-column" CS="--cases burn64 burn64-quarter null64 pong64 --seconds 2 --repeats 1"
  PPO_STEPS=16384 PPO_ENVS=32 CUDA="--cuda"
fi
timeout 120 $PY benchmarks/probes/timeline.py $TL >> "$LOG" 2>&1
timeout 330 $PY benchmarks/manycore.py $MC >> "$LOG" 2>&1
timeout 100 $PY benchmarks/probes/cpu_split.py $CS >> "$LOG" 2>&1
cp benchmarks/results/timeline.md benchmarks/results/manycore.md benchmarks/results/manycore.json benchmarks/results/cpu_split.md "$OUT/"
for backend in gym async clusterenv; do
  start=$(date +%s.%N)
  timeout 150 $PY examples/ppo_atari.py $CUDA --env-id BreakoutNoFrameskip-v4 --num-envs $PPO_ENVS \
    --total-timesteps $PPO_STEPS --backend $backend > "/tmp/ppo-$backend.log" 2>&1
  rc=$?
  rate=$(tr '\r' '\n' < "/tmp/ppo-$backend.log" | grep -oE "[0-9.]+step/s" | tail -1)
  echo "ppo_atari --backend $backend: rc $rc, $(echo "$(date +%s.%N) - $start" | bc) s wall, last rate $rate" >> "$OUT/ppo.txt"
  tail -c 400 "/tmp/ppo-$backend.log" >> "$LOG"
done
cat "$OUT/ppo.txt"; tail -c 4000 "$LOG"
