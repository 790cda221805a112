#!/usr/bin/env bash
# Build .devcarry/site.tar.xz: every Python package the GPU machine (the device tool's
# nvidia-h100-x1 / nvidia-h200: Python 3.12, torch 2.11+cu130, no network) lacks to run
# gradmon_ray from source: Ray 2.60 with RLlib and Tune (server binaries kept, so ray.init()
# starts a local Ray), mlflow-skinny with the sqlite store (sqlalchemy, alembic, Mako,
# cryptography), gymnasium, pydantic, dm-tree and their own missing dependencies.
#
#   bash tools/gpu_carry.sh              # rebuild .devcarry/ from scratch (about 100 MB of downloads)
#   bash tools/gpu_carry.sh --check-only # download and check the dependency closure, pack nothing
#
# Then: the device tool's run with carry [".devcarry"] and command "bash tools/gpu_check.sh"
# (tools/README.md).  Recipe: /work/shared/DESIGN.md, "Facts checked on this machine", GPU machine.
#
# Environment knobs:
#   GPU_CARRY_LIMIT_MIB=56     fail when the tarball is bigger (the working tree travels beside it,
#                              64 MiB in all)
#   GPU_CARRY_RAY_DEFAULT=1    also carry ray[default]'s extras (dashboard agent, opencensus, ...);
#                              off by default: gradmon_ray needs none of them and Ray runs in its
#                              "minimal" mode without them (the recipe verified on the H200)
#   GPU_CARRY_PYTHON=...       the Python that runs pip here (default: .venv/bin/python, else python3);
#                              its own version does not matter, pip is told the target's
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
DEST="$REPO/.devcarry"
LIMIT_MIB=${GPU_CARRY_LIMIT_MIB:-56}
TREE_LIMIT_MIB=63 # the device tool's 64 MiB for working tree + carried paths, with a margin
CHECK_ONLY=0
[[ "${1:-}" == "--check-only" ]] && CHECK_ONLY=1

if [[ -n "${GPU_CARRY_PYTHON:-}" ]]; then
    PY=$GPU_CARRY_PYTHON
elif [[ -x "$REPO/.venv/bin/python" ]]; then
    PY="$REPO/.venv/bin/python"
else
    PY=python3
fi

# --- what to carry --------------------------------------------------------------------------
# Pinned to the versions the repository's CPU venv runs (tested together).  One version per
# package (two stop the whole install).  To add a package the device lacks: add NAME==VERSION
# here; the closure check below names every requirement that is neither carried nor on DEVICE_HAS.
PACKAGES=(
    # Ray with RLlib and Tune (ray[rllib,tune] extras the image lacks)
    ray==2.60.0
    dm-tree==0.1.10
    gymnasium==1.2.2
    farama-notifications==0.0.6
    lz4==4.4.5
    ormsgpack==1.13.1
    tensorboardx==2.6.5
    jsonschema==4.26.0
    jsonschema-specifications==2025.9.1
    referencing==0.37.0
    rpds-py==2026.9.1
    # pydantic (gradmon_ray.config, ray, mlflow); typing-extensions carried too: pydantic 2.14
    # needs >= 4.16, newer than the image's may be (newer is backward compatible for torch)
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    # MLflow: the skinny client holds the whole `mlflow` package (sqlite store and its alembic
    # migrations included); the full `mlflow` wheel adds only the server UI and ML flavours
    mlflow-skinny==3.17.2
    cachetools==7.3.3
    databricks-sdk==0.162.0
    google-auth==2.63.0
    pyasn1==0.6.5
    pyasn1-modules==0.4.2
    fastapi==0.165.0
    starlette==1.10.0
    uvicorn==0.54.0
    gitpython==3.2.1
    gitdb==4.0.12
    smmap==5.0.3
    importlib-metadata==9.1.0
    opentelemetry-api==1.45.2
    opentelemetry-sdk==1.45.2
    opentelemetry-proto==1.45.2
    opentelemetry-semantic-conventions==0.66b2
    python-dotenv==1.2.4
    sqlparse==0.6.1
    # the sqlite tracking store
    sqlalchemy==2.1.9
    alembic==1.20.1
    mako==1.4.3
    cryptography==50.0.2
    cffi==2.1.1
    pycparser==3.12
)
RAY_EXTRAS=rllib,tune
if [[ "${GPU_CARRY_RAY_DEFAULT:-0}" == 1 ]]; then
    RAY_EXTRAS=default,rllib,tune
    PACKAGES+=(
        aiohttp-cors==0.8.1 colorful==0.5.8 py-spy==0.4.3 opencensus==0.11.4 opencensus-context==0.1.3
        opentelemetry-exporter-prometheus==0.66b2 smart-open==9.0.2 virtualenv==21.15.11 distlib==0.4.4
        platformdirs==4.14.8 python-discovery==1.9.6 google-api-core==2.44.0
        googleapis-common-protos==1.76.0 proto-plus==1.29.0
    )
fi

# Already in the GPU machine's image ('cuda'), as /work/.library/device/KINDS.md read it on
# 2026-11-17 ("Python packages already there"); versions there are unknown here: tools/gpu_check.sh
# runs `pip check` on the device and logs any mismatch.
DEVICE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

# The device's interpreter: CPython 3.12 on x86_64 Linux.  Its glibc is not recorded here, so
# manylinux tags stop at 2_28 (the device README's flags; its torch wheels need 2_28 too):
# cryptography then comes as its manylinux_2_28 wheel, not the 2_34 one pip would prefer.
PLATFORM_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORM_ARGS+=(--platform "${p}_x86_64")
done

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/gradmon-devcarry.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
echo "gpu_carry: staging in $STAGE (pip: $("$PY" -m pip --version | cut -d' ' -f1-2), $PY)"

# --- 1. download ----------------------------------------------------------------------------
mkdir -p "$STAGE/wheels"
# (the grep drops pip's warnings about this machine's missing local index folders, if any)
"$PY" -m pip download -q --no-deps --disable-pip-version-check "${PLATFORM_ARGS[@]}" \
    -d "$STAGE/wheels" "${PACKAGES[@]}" 2> >(grep -v "^WARNING: Location 'file:" >&2)
echo "gpu_carry: downloaded $(find "$STAGE/wheels" -name '*.whl' | wc -l) wheels, $(du -sm "$STAGE/wheels" | cut -f1) MB"

# --- 2. closure check: every requirement carried or on the device ---------------------------
RAY_EXTRAS="$RAY_EXTRAS" DEVICE_HAS="$DEVICE_HAS" "$PY" - "$STAGE/wheels" "$REPO/pyproject.toml" <<'PYEOF'
import os, sys, zipfile
from email.parser import Parser
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
try:
    import tomllib
except ImportError:
    from pip._vendor import tomli as tomllib

wheels, pyproject = Path(sys.argv[1]), Path(sys.argv[2])
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}
device = {canonicalize_name(n) for n in os.environ["DEVICE_HAS"].split()}
carried, requires = {}, {}
for whl in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode())
    name = canonicalize_name(msg["Name"])
    if name in carried:
        sys.exit(f"gpu_carry: FAIL: two versions of {name}: {carried[name]} and {msg['Version']}")
    carried[name] = msg["Version"]
    requires[name] = msg.get_all("Requires-Dist") or []

# Roots: gradmon-ray's own runtime dependencies (torch is the device's), with ray's extras.
deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
extras = {"ray": set(os.environ["RAY_EXTRAS"].split(","))}
problems, from_device = [], set()

# `mlflow` (gradmon-ray's requirement) is served by mlflow-skinny: the same `mlflow` package,
# without the server UI and the ML flavours' dependencies (pandas, scikit-learn, flask, ...).
SUBSTITUTES = {"mlflow": "mlflow-skinny"}

def check(req: Requirement, by: str) -> None:
    name = canonicalize_name(req.name)
    name = SUBSTITUTES.get(name, name)
    if name in carried:
        if req.specifier and not req.specifier.contains(carried[name], prereleases=True):
            problems.append(f"{by} needs {req}, carried {name}=={carried[name]}")
    elif name in device:
        if req.specifier:
            from_device.add(f"{name}{req.specifier}")
        else:
            from_device.add(name)
    else:
        problems.append(f"{by} needs {req}: neither carried nor on the device (add it to PACKAGES)")

for spec in deps:
    req = Requirement(spec)
    if not req.marker or req.marker.evaluate(env):
        check(req, "gradmon-ray")
for name, reqs in requires.items():
    wanted = extras.get(name, set()) | {""}
    for spec in reqs:
        req = Requirement(spec)
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in wanted):
            continue
        check(req, f"{name}=={carried[name]}")

print("gpu_carry: relies on the device for:", ", ".join(sorted(from_device)))
if problems:
    print("gpu_carry: FAIL: unmet requirements:", *problems, sep="\n  ")
    sys.exit(1)
print(f"gpu_carry: closure OK: {len(carried)} carried packages (ray extras: {os.environ['RAY_EXTRAS']})")
PYEOF

if [[ $CHECK_ONLY == 1 ]]; then
    echo "gpu_carry: --check-only: nothing packed"
    exit 0
fi

# --- 3. install into a staging site folder (no compile: .pyc files are made there) ----------
"$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --disable-pip-version-check \
    "${PLATFORM_ARGS[@]}" --target "$STAGE/site" "$STAGE/wheels"/*.whl 2> >(grep -v "^WARNING: Location 'file:" >&2)
echo "gpu_carry: installed: $(du -sm "$STAGE/site" | cut -f1) MB"

# --- 4. prune ---------------------------------------------------------------------------------
rm -rf "$STAGE/site/ray/jars"                   # 34 MB of Java (Ray's Java workers): unused
rm -rf "$STAGE/site/ray/dashboard/client/build" # the dashboard's web client: include_dashboard=False
find "$STAGE/site" -depth -type d \( -name __pycache__ -o -name tests \) -exec rm -rf {} +
find "$STAGE/site" -type f -name '*.pyc' -delete
for must in ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet \
    ray/rllib/__init__.py ray/tune/__init__.py mlflow/__init__.py mlflow/store/db_migrations/alembic.ini; do
    [[ -e "$STAGE/site/$must" ]] || { echo "gpu_carry: FAIL: $must missing after pruning" >&2; exit 1; }
done
echo "gpu_carry: pruned: $(du -sm "$STAGE/site" | cut -f1) MB"

# --- 5. manifest and pack -------------------------------------------------------------------
{
    echo "# gradmon-ray device carry, built $(date -u +%Y-%m-%dT%H:%M:%SZ) by tools/gpu_carry.sh"
    echo "# ray extras: $RAY_EXTRAS; target: cp312 manylinux x86_64"
    for whl in "$STAGE/wheels"/*.whl; do basename "$whl"; done
} >"$STAGE/site/CARRY_MANIFEST.txt"

rm -rf "$DEST"
mkdir -p "$DEST"
echo "gpu_carry: packing (xz -9, one thread; a minute or two) ..."
tar -C "$STAGE/site" --sort=name --owner=0 --group=0 --numeric-owner -cf - . |
    xz -9 -T1 >"$DEST/site.tar.xz.part"
mv "$DEST/site.tar.xz.part" "$DEST/site.tar.xz"
cp "$STAGE/site/CARRY_MANIFEST.txt" "$DEST/MANIFEST.txt"
(cd "$DEST" && sha256sum site.tar.xz >>MANIFEST.txt)

# --- 6. size checks ---------------------------------------------------------------------------
bytes=$(stat -c %s "$DEST/site.tar.xz")
carry_bytes=$(du -sb "$DEST" | cut -f1)
tree_bytes=$(git ls-files -z --cached --others --exclude-standard |
    xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "gpu_carry: .devcarry/site.tar.xz = $(mib "$bytes") MiB ($bytes bytes); .devcarry/ = $(mib "$carry_bytes") MiB"
echo "gpu_carry: working tree that travels = $(mib "$tree_bytes") MiB; together $(mib $((tree_bytes + carry_bytes))) MiB of 64"
if ((bytes > LIMIT_MIB * 1048576)); then
    echo "gpu_carry: FAIL: the carry is over ${LIMIT_MIB} MiB: prune more or carry less" >&2
    exit 1
fi
if ((tree_bytes + carry_bytes > TREE_LIMIT_MIB * 1048576)); then
    echo "gpu_carry: FAIL: working tree + carry over ${TREE_LIMIT_MIB} MiB: the device tool would refuse the call" >&2
    exit 1
fi
echo "gpu_carry: OK: run the device tool with carry [\".devcarry\"], command \"bash tools/gpu_check.sh\", timeout_s 590"
