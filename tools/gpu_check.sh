#!/usr/bin/env bash
# The GPU checks, in ONE device call (the device tool's run; tools/README.md):
#
#   run(carry=[".devcarry"], command="bash tools/gpu_check.sh", timeout_s=590)
#
# Unpacks the carry built here by tools/gpu_carry.sh into /tmp/site (kept on a warm machine
# while the tarball is unchanged), puts it and the repository root on PYTHONPATH (gradmon_ray is
# imported from source, no pip install), prints versions, then runs the steps below in priority
# order, each under its own `timeout` and all under one deadline, one failing step never
# stopping the rest.  Logs go to $OUT (at most 8 files come back: env.txt, summary.txt and one
# log per step); summary.txt (also printed at the end) holds each step's status, wall time and
# the lines other checks parse (`ratio ...`, `arm ...`, pytest's summary).
#
# Knobs (environment; defaults sized for ~9 minutes on an H100/H200):
#   GPU_CHECK_STEPS       steps to run, in order (default: "tests tel8 tel2 counts ray vgs tel1": the
#                         figures never measured on a GPU first; times in tools/README.md)
#   GPU_CHECK_DEADLINE_S  script-wide deadline in seconds (default 565: under timeout_s 590)
#   GPU_CHECK_TEL1_ARGS / _TEL8_ARGS / _TEL2_ARGS / _VGS_ARGS   override a step's benchmark arguments
#   GPU_CHECK_PYTHON      the interpreter (default python3: the one that holds torch there)
#   GPU_CHECK_SITE        where the carry is unpacked (default /tmp/site)
set -u
export PYTHONUNBUFFERED=1
export RAY_USAGE_STATS_ENABLED=0 # no network there: never try to report usage
export MPLBACKEND=Agg

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
PY=${GPU_CHECK_PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
DEADLINE=${GPU_CHECK_DEADLINE_S:-565}
STEPS=${GPU_CHECK_STEPS:-"tests tel8 tel2 counts ray vgs tel1"}
MIN_STEP_S=25 # a step with less time left than this is skipped, not started
CARRY="$REPO/.devcarry/site.tar.xz"
SUMMARY="$OUT/summary.txt"
ENVLOG="$OUT/env.txt"
: >"$SUMMARY"
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# --- unpack the carry ---------------------------------------------------------------------------
if [[ ! -f "$CARRY" ]]; then
    note "FAIL: $CARRY missing: run 'bash tools/gpu_carry.sh' on the CPU machine and call run with carry [\".devcarry\"]"
    exit 2
fi
sum=$(sha256sum "$CARRY" | cut -d' ' -f1)
if [[ -f "$SITE/.carry-sha256" && "$(cat "$SITE/.carry-sha256")" == "$sum" ]]; then
    note "carry: $SITE already holds this carry (warm machine), not unpacked again"
else
    rm -rf "$SITE" && mkdir -p "$SITE"
    if ! tar -xJf "$CARRY" -C "$SITE"; then
        note "FAIL: could not unpack $CARRY into $SITE"
        exit 2
    fi
    echo "$sum" >"$SITE/.carry-sha256"
    note "carry: unpacked into $SITE in ${SECONDS}s ($(du -sm "$SITE" | cut -f1) MB)"
fi
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

# --- versions (env.txt, and stdout) --------------------------------------------------------------
{
    echo "## $(date -u +%Y-%m-%dT%H:%M:%SZ) $(hostname) $(uname -srm)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
    echo "## carry: $(grep -m1 '^# gradmon' "$SITE/CARRY_MANIFEST.txt" 2>/dev/null) sha256 ${sum:0:16}"
    timeout 120 "$PY" - <<'PYEOF' 2>&1
import importlib.metadata as md, platform, sys
print("python", sys.version.split()[0], sys.executable, "glibc", platform.libc_ver()[1])
import torch
cuda = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", cuda,
      "device", torch.cuda.get_device_name(0) if cuda else "-",
      "capability", torch.cuda.get_device_capability(0) if cuda else "-")
import ray, mlflow, gymnasium, pydantic, numpy, tree  # noqa: F401
print("ray", ray.__version__, "from", ray.__file__)
print("mlflow", mlflow.__version__, "from", mlflow.__file__)
names = ["gymnasium", "pydantic", "pydantic-core", "dm-tree", "numpy", "typing-extensions", "sqlalchemy",
         "alembic", "cryptography", "packaging", "protobuf", "pandas", "pyarrow", "scipy", "pytest",
         "pytest-xdist", "matplotlib", "rich", "pyyaml", "requests", "click", "aiohttp", "grpcio"]
versions = []
for n in names:
    try:
        versions.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        versions.append(f"{n} MISSING")
print("; ".join(versions))
import gradmon_ray.rllib  # noqa: F401  (the whole stack: RLlib, torch, pydantic config)
print("gradmon_ray from", gradmon_ray.rllib.__file__)
PYEOF
    echo "## pip check (the device's packages and the carry together; a line here is a version conflict)"
    timeout 60 "$PY" -m pip check 2>&1 | head -40
} | tee "$ENVLOG"

# --- steps ---------------------------------------------------------------------------------------
# run_step NAME CAP_S LOGFILE CMD...: CMD under `timeout` (the smaller of CAP_S and the time left
# before the deadline), output to $OUT/LOGFILE; status, wall time and parsed lines to the summary.
run_step() {
    local name=$1 cap=$2 log="$OUT/$3"
    shift 3
    local left=$((DEADLINE - SECONDS - 5))
    if ((left < MIN_STEP_S)); then
        note "$(printf '%-7s SKIPPED: %ss left before the %ss deadline' "$name" "$left" "$DEADLINE")"
        FAILED=1
        return
    fi
    local budget=$((cap < left ? cap : left))
    local t0=$SECONDS rc status
    echo "### $name (budget ${budget}s): $*" >>"$log"
    timeout -k 10 "$budget" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT after ${budget}s" && FAILED=1 ;;
        *) status="FAIL rc=$rc" && FAILED=1 ;;
    esac
    local cmd="$*"
    note "$(printf '%-7s %-22s %4ss  %s' "$name" "$status" "$((SECONDS - t0))" "${cmd//$'\n'/ }")"
    grep -E '^(ratio |arm |added |device=|torch |ray smoke|[0-9.]+M parameters|  [a-z-]+ +median |  first step|  telemetry|[0-9]+ (passed|failed|skipped|error)|=+ .*(passed|failed|error|skipped))|^(FAILED|ERROR|SKIPPED) ' "$log" |
        sed 's/^/    /' | tee -a "$SUMMARY"
    if [[ $status != ok ]]; then
        echo "    --- last lines of $(basename "$log") ---" | tee -a "$SUMMARY"
        tail -n 15 "$log" | sed 's/^/    | /' | tee -a "$SUMMARY"
    fi
}

TEL="bench/telemetry_overhead.py"
# shellcheck disable=SC2206 # the *_ARGS knobs are word-split on purpose
TEL1_ARGS=(${GPU_CHECK_TEL1_ARGS:---rounds 10 --repeats 3 --warmup 2})
# shellcheck disable=SC2206
TEL8_ARGS=(${GPU_CHECK_TEL8_ARGS:---rounds 2 --repeats 3 --warmup 1 --arms stock-fused dropin gradmon gradmon-twin})
# shellcheck disable=SC2206
TEL2_ARGS=(${GPU_CHECK_TEL2_ARGS:---rounds 4 --repeats 3 --warmup 1})
# shellcheck disable=SC2206
VGS_ARGS=(${GPU_CHECK_VGS_ARGS:---sizes 0 1 10 --steps 30 --repeats 3})

note "## steps: $STEPS (deadline ${DEADLINE}s, ${SECONDS}s used)"
for step in $STEPS; do
    case $step in
        # pyproject's addopts force xdist's -n 2: cleared here, one process (the GPU tests share a card)
        tests) run_step tests 150 tests.log "$PY" -m pytest -q tests/gpu -o addopts= -p no:xdist -p no:randomly \
            -p no:cacheprovider -rfEs --durations=10 ;;
        counts) run_step counts 75 counts.log "$PY" "$TEL" --device cuda --counts-only ;;
        tel1) run_step tel1 200 tel1.log "$PY" "$TEL" --device cuda "${TEL1_ARGS[@]}" ;;
        tel8) run_step tel8 180 tel8.log "$PY" "$TEL" --device cuda --agents 8 "${TEL8_ARGS[@]}" ;;
        vgs) run_step vgs 100 vgs.log "$PY" bench/vgs.py --device cuda "${VGS_ARGS[@]}" ;;
        tel2) run_step tel2 120 tel2.log "$PY" "$TEL" --device cuda --agents 2 "${TEL2_ARGS[@]}" ;;
        # Ray's own processes (gcs_server, raylet) from the carry, and a GPU task through them
        ray) run_step ray 60 env.txt "$PY" -c '
import ray
ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
name = ray.get(ray.remote(num_gpus=1)(lambda: __import__("torch").cuda.get_device_name(0)).remote())
print("ray smoke: ray.init OK, a num_gpus=1 task ran on", name)
ray.shutdown()' ;;
        *) note "unknown step '$step' (known: tests counts tel1 tel8 vgs tel2 ray)" ;;
    esac
done

note "## done in ${SECONDS}s of ${DEADLINE}s; $([[ $FAILED == 0 ]] && echo 'all steps ok' || echo 'SOME STEPS FAILED OR SKIPPED')"
echo
echo "===== summary ($SUMMARY) ====="
cat "$SUMMARY"
exit "$FAILED"
