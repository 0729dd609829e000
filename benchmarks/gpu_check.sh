#!/usr/bin/env bash
# The GPU-learner check (issue 13), for a Linux machine with an NVIDIA GPU. Under 8 minutes in all:
#   1. a venv that sees the system's packages; torch with CUDA (the installed one if it has CUDA, else a
#      guarded `pip install torch`); the project and its test/examples extras;
#   2. the CUDA tests: pytest tests/test_device.py (the cuda cases must run, not skip);
#   3. examples/ppo_atari.py --cuda on Breakout for $ATARI_STEPS steps: steps/s and the return curve;
#   4. examples/ppo_cartpole.py --local-policy --cuda against --backend gym --cuda, timed, $CARTPOLE_STEPS each.
# Every step runs under `timeout`, within an overall deadline ($TOTAL_S); a failed step does not stop the
# others. Results go to $RESULTS (default $OUT, else benchmarks/results/gpu_check): summary.tsv (one line per
# step: step, status, seconds, detail), one log per step, the example runs' episodes.csv and learning curves.
#
# Assumptions: python3 with the venv module; torch, if preinstalled, in the system site-packages. The plain
# `pip install torch` fallback takes PyPI's default Linux wheel, which bundles its CUDA runtime and needs a
# recent enough NVIDIA driver, and network access: on an offline machine the installed packages must already
# cover the project (torch with CUDA, gymnasium, pyzmq, cloudpickle, msgpack, pytest, tyro, tqdm, matplotlib,
# ale-py); the project itself is then run from this checkout via PYTHONPATH. USE_PYTHON=/path/to/python skips
# the venv and every install and runs the checks with that interpreter.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${RESULTS:-${OUT:-$REPO/benchmarks/results/gpu_check}}"
VENV="${VENV:-${TMPDIR:-/tmp}/clusterenv-gpu-check-venv}"
TOTAL_S="${TOTAL_S:-450}"
ATARI_STEPS="${ATARI_STEPS:-100000}"
CARTPOLE_STEPS="${CARTPOLE_STEPS:-100000}"
DEADLINE=$((SECONDS + TOTAL_S))

mkdir -p "$RESULTS/logs" "$RESULTS/runs"
SUMMARY="$RESULTS/summary.tsv"
printf 'step\tstatus\tseconds\tdetail\n' >"$SUMMARY"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$REPO" || exit 1

record() { # step status seconds detail
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"
    printf '[gpu_check] %-16s %-10s %5ss  %s\n' "$1" "$2" "$3" "$4"
}

# run_step NAME CAP_SECONDS COMMAND...: run under `timeout` (SIGINT first, so Python writes what it has),
# capped by the time left; sets STEP_RC (124: timed out) and STEP_S, logs to logs/NAME.log.
run_step() {
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - SECONDS - 5))
    ((cap > left)) && cap=$left
    STEP_LOG="$RESULTS/logs/$name.log"
    if ((cap < 10)); then
        STEP_RC=125 STEP_S=0
        echo "skipped: the overall budget of ${TOTAL_S} s is spent" >"$STEP_LOG"
        return
    fi
    local start=$SECONDS
    timeout -s INT -k 15 "$cap" "$@" >"$STEP_LOG" 2>&1
    STEP_RC=$?
    STEP_S=$((SECONDS - start))
}

status_of() { # rc -> status word
    case $1 in
    0) echo ok ;;
    124 | 137) echo timeout ;;
    125) echo out-of-time ;;
    *) echo "failed($1)" ;;
    esac
}

# -- 1. environment --------------------------------------------------------------------------------------------
run_step gpu 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
record gpu "$(status_of $STEP_RC)" "$STEP_S" "$(head -n 1 "$STEP_LOG" | tr '\t' ' ')"

if [[ -n "${USE_PYTHON:-}" ]]; then
    PY="$USE_PYTHON"
    record venv skipped 0 "USE_PYTHON=$PY"
else
    run_step venv 60 python3 -m venv --system-site-packages "$VENV"
    if ((STEP_RC == 0)); then
        PY="$VENV/bin/python"
        record venv ok "$STEP_S" "$VENV (with the system site-packages)"
    else
        PY="$(command -v python3)"
        record venv "$(status_of $STEP_RC)" "$STEP_S" "falling back to $PY: $(tail -n 1 "$STEP_LOG")"
    fi
fi

HAS_CUDA='import torch; assert torch.cuda.is_available(), f"torch {torch.__version__} has no CUDA"; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")'
if [[ -n "${USE_PYTHON:-}" ]]; then
    run_step torch 60 "$PY" -c "$HAS_CUDA"
    record torch "$(status_of $STEP_RC)" "$STEP_S" "$(tail -n 1 "$STEP_LOG")"
else
    run_step torch 60 "$PY" -c "$HAS_CUDA"
    if ((STEP_RC == 0)); then
        record torch ok "$STEP_S" "preinstalled: $(tail -n 1 "$STEP_LOG")"
    else
        # Not pinned: the CI's torch==2.13.0 pin is for the CPU index; PyPI's default wheel is the CUDA build.
        run_step torch-install 240 "$PY" -m pip install --retries 1 --timeout 20 torch
        install_rc=$STEP_RC install_s=$STEP_S
        run_step torch 30 "$PY" -c "$HAS_CUDA"
        record torch "$(status_of $STEP_RC)" "$((install_s + STEP_S))" \
            "pip install torch: $(status_of $install_rc); $(tail -n 1 "$STEP_LOG")"
    fi
fi

if [[ -n "${USE_PYTHON:-}" ]]; then
    record install skipped 0 "USE_PYTHON: the checkout runs from PYTHONPATH"
else
    run_step install 120 "$PY" -m pip install --retries 1 --timeout 20 -e ".[test,examples]"
    if ((STEP_RC == 0)); then
        record install ok "$STEP_S" "pip install -e .[test,examples]"
    else
        first_rc=$STEP_RC
        run_step install-offline 60 "$PY" -m pip install --no-deps --no-build-isolation -e .
        record install "$(status_of $STEP_RC)" "$STEP_S" \
            "with extras: $(status_of $first_rc); --no-deps --no-build-isolation: $(status_of $STEP_RC); the checkout also runs from PYTHONPATH"
    fi
fi
run_step imports 60 "$PY" -c '
import importlib.util as u
need = "torch gymnasium numpy zmq cloudpickle msgpack pytest tyro tqdm matplotlib ale_py".split()
missing = [m for m in need if u.find_spec(m) is None]
print("missing: " + " ".join(missing) if missing else "all present")
raise SystemExit(bool(missing))'
record imports "$(status_of $STEP_RC)" "$STEP_S" "$(tail -n 1 "$STEP_LOG")"

# -- 2. the CUDA tests ---------------------------------------------------------------------------------------------
# addopts are dropped (no doctests, no dependence on pytest-timeout); `timeout` bounds the run instead.
run_step tests 150 "$PY" -m pytest -o addopts= -rA -p no:cacheprovider tests/test_device.py
tests_rc=$STEP_RC
detail="$(grep -E '^=+ .*(passed|failed|error|skipped).* =+$' "$STEP_LOG" | tail -n 1 | tr -d '=' | xargs)"
detail="${detail:-$(tail -n 1 "$STEP_LOG")}"
if ((tests_rc == 0)) && grep -q "no CUDA here" "$STEP_LOG"; then
    record tests incomplete "$STEP_S" "$detail; the cuda cases were skipped (see logs/tests.log)"
else
    record tests "$(status_of $tests_rc)" "$STEP_S" "$detail"
fi

# -- 3. PPO on Breakout with a CUDA learner ---------------------------------------------------------------------------
# example NAME CAP STEPS ARGS...: one example run under runs/NAME; records steps/s (over the training loop, from
# the script's final line, and over the whole process) and the final mean return. A --cuda run that fell back to
# the CPU (its final line names the device) is `incomplete`.
example() {
    local name=$1 cap=$2 steps=$3
    shift 3
    rm -rf "$RESULTS/runs/$name"
    run_step "$name" "$cap" "$PY" "$@" --total-timesteps "$steps" --runs-dir "$RESULTS/runs/$name"
    local last train_s status
    status="$(status_of $STEP_RC)"
    last="$(grep -E 'episodes in [0-9.]+ s' "$STEP_LOG" | tail -n 1)"
    if [[ -z "$last" ]]; then
        record "$name" "$status" "$STEP_S" "no final line: $(tail -n 1 "$STEP_LOG" | tr '\r' '\n' | tail -n 1)"
        return
    fi
    train_s="$(sed -E 's/.*episodes in ([0-9.]+) s.*/\1/' <<<"$last")"
    [[ " $* " == *" --cuda "* && "$last" != *", cuda"* && $status == ok ]] && status=incomplete
    record "$name" "$status" "$STEP_S" "$(awk -v n="$steps" -v t="$train_s" -v w="$STEP_S" \
        'BEGIN { printf "%.0f steps/s training, %.0f steps/s whole process", n / (t > 0 ? t : 1), n / (w > 0 ? w : 1) }'); $last"
}

example ppo_atari 150 "$ATARI_STEPS" examples/ppo_atari.py --cuda --env-id BreakoutNoFrameskip-v4

# -- 4. CartPole: local policies in the workers against the learner acting on the GPU ---------------------------------
example cartpole_local 90 "$CARTPOLE_STEPS" examples/ppo_cartpole.py --local-policy --cuda
example cartpole_gym 90 "$CARTPOLE_STEPS" examples/ppo_cartpole.py --backend gym --cuda

# The return curves: each run's episodes.csv and learning_curve.png, next to the summary.
for csv in "$RESULTS"/runs/*/*/episodes.csv; do
    [[ -f "$csv" ]] || continue
    name="$(basename "$(dirname "$(dirname "$csv")")")"
    cp "$csv" "$RESULTS/${name}_episodes.csv"
    [[ -f "$(dirname "$csv")/learning_curve.png" ]] && cp "$(dirname "$csv")/learning_curve.png" "$RESULTS/${name}_curve.png"
done

echo
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
# Exit status: 0 only if every step passed (or was skipped for USE_PYTHON).
! grep -qE $'\t(failed|timeout|incomplete|out-of-time)' "$SUMMARY"
