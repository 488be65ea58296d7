#!/usr/bin/env bash
# The GPU check, in one call on one GPU: at most 6 minutes on a fresh machine, compiles included
# (GPU_CHECK_SECONDS, default 350, bounds the whole; each step has a limit of its own, cut to
# what is left). Every line streams as it comes; logs and JSON in $OUT (else /tmp/gpu-check).
#
#   prerequisites  python, torch with CUDA, triton, pyzmq, msgpack (wheels in .whl/ are
#                  installed into $OUT/site where they are missing), the job's modules,
#                  gcc, nvidia-smi: stops at once, naming each one missing (exit 2)
#   build    60 s  setup.py build_ext --inplace (the C kernels), checked by importing them
#   tests   100 s  the CUDA tests, in the background beside warm and budget (lines marked
#                  [tests]), joined before the kernel step, which times alone
#   warm     60 s  every fibre-kernel variant the kernel step runs, compiled into Triton's
#                  on-disk cache (TRITON_CACHE_DIR, else $OUT/triton-cache) by making those
#                  very calls once, in parallel processes on the GPU
#   budget   45 s  benchmarks/kernel_budget.py for those sets and dtypes, on every core
#                  (variants over budget are a finding, not a failed step)
#   kernel   75 s  benchmarks/gpu_kernel.py: ResNet-50, VGG-16, BERT-base in float32 and
#                  bfloat16, with and without error feedback, per-tensor and batched apart:
#                  kernel-only ms (CUDA events), host ms, wall ms, against a global torch.topk
#                  and reading once measured in the same run; VGG-16's fc1 on lines of its own
#   job      40 s  a short GPU run of the training job (2 workers, 2 servers)
#   e2e      70 s  dense, top-k and ADTopk end to end with GPU workers at 10 Gbit/s (over
#                  loopback, unshaped, where the machine cannot make network namespaces)
#
# It ends with one line naming the failed steps (exit 1), or saying every step passed.
#
#     bash benchmarks/gpu_check.sh                  # on the GPU machine
#     bash benchmarks/gpu_check.sh --check-only     # the prerequisites only
#     bash benchmarks/gpu_check.sh --cpu-dry-run    # every step on the CPU, tiny sizes: the flow
#
# Fashion-MNIST is read from .data/fashion-mnist/ where it is there (else the job trains on
# digits). See docs/gpu.md, "The GPU check".
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

dry=${GPU_CHECK_DRY_RUN:-0}
check_only=0
for arg in "$@"; do
    case $arg in
        --cpu-dry-run) dry=1 ;;
        --check-only) check_only=1 ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
started=$SECONDS
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-$([ "$dry" = 1 ] && echo 900 || echo 350)}))
failed=()
took=()

# ---- prerequisites: everything named at once, before any step runs ----
missing=()
stop() {  # stop: name what is missing and end (exit 2)
    echo "GPU check: missing prerequisites:"
    printf '  %s\n' "${missing[@]}"
    echo "GPU check: failed: prerequisites"
    exit 2
}
if ! command -v "$py" >/dev/null 2>&1; then
    missing+=("python: no '$py' here (PYTHON=/path/to/python3 names another)")
    stop
fi
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
if [ -z "$pyver" ]; then
    missing+=("python: '$py' does not run")
    stop
fi
for tool in timeout tee nproc; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool: not on PATH (coreutils)")
done
command -v "${CC:-gcc}" >/dev/null 2>&1 ||
    missing+=("gcc: no C compiler '${CC:-gcc}' on PATH: the build step (setup.py build_ext) compiles the C kernels with it (apt-get install gcc, or CC=...)")
if [ "$dry" = 1 ]; then
    echo "prerequisites: a dry run on the CPU: nvidia-smi and torch's CUDA are not checked"
else
    command -v nvidia-smi >/dev/null 2>&1 ||
        missing+=("nvidia-smi: not on PATH: no NVIDIA driver here?")
fi

# modules that may travel as wheels in .whl/ (docs/gpu.md): installed where they are missing
wheels=(.whl/*.whl)
[ -e "${wheels[0]}" ] || wheels=()
absent=$("$py" -c 'import importlib.util as u
print(" ".join(m for m in ("zmq", "msgpack", "yaml", "tqdm", "sklearn") if u.find_spec(m) is None))' 2>/dev/null)
if [ -n "$absent" ] && [ ${#wheels[@]} -gt 0 ]; then
    site="$out/site"
    echo "prerequisites: $absent not importable: installing ${wheels[*]} into $site"
    if "$py" -m pip --version >/dev/null 2>&1; then
        PIP_ROOT_USER_ACTION=ignore "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "${wheels[@]}" 2>&1 | tail -5
    else  # no pip: a wheel is a zip of the files to put on the path
        "$py" -c 'import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$site" "${wheels[@]}"
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

# the modules, torch's CUDA and the GPU, in one python: each problem on a line of its own
carry="on a machine with internet: pip download --no-deps --only-binary=:all: --python-version $pyver --platform manylinux_2_28_x86_64 -d .whl"
found=$(GPU_CHECK_DRY="$dry" GPU_CHECK_CARRY="$carry" GPU_CHECK_WHEELS="${wheels[*]}" \
    "$py" - 2>"$out/prerequisites.err" <<'EOF'
import importlib, os, sys
dry, carry, wheels = os.environ["GPU_CHECK_DRY"] == "1", os.environ["GPU_CHECK_CARRY"], os.environ["GPU_CHECK_WHEELS"]
problems, versions = [], [f"python {sys.version.split()[0]} ({sys.executable})"]
def need(module, label, package, how, why_needed=""):
    try:
        m = importlib.import_module(module)
    except Exception as exc:  # an ImportError, or a wheel built for another python
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        tried = f"; the wheels in .whl/ ({wheels}) did not give it: built for python {sys.version_info[0]}.{sys.version_info[1]} and x86_64?" if wheels and how.startswith("carry") else ""
        problems.append(f"{label}{why_needed}: cannot import {module} ({why}); {how.format(package=package)}{tried}")
        return None
    versions.append(f"{label} {getattr(m, '__version__', '')}".strip())
    return m
wheel = f"carry a wheel: {carry} {{package}} (the script installs .whl/*.whl into $OUT/site)"
torch = need("torch", "torch", "torch", "install torch (a CUDA build)")
if torch is not None and not dry:
    if torch.version.cuda is None:
        problems.append(f"torch with CUDA: torch {torch.__version__} is a CPU-only build: install a CUDA build")
    elif not torch.cuda.is_available():
        problems.append(f"torch with CUDA: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU (driver? CUDA_VISIBLE_DEVICES?)")
    else:
        versions[-1] += f" (CUDA {torch.version.cuda}, {torch.cuda.get_device_name()})"
need("triton", "triton", "triton", "pip install triton (the CUDA kernels are Triton kernels)")
for module, label, package in (("zmq", "pyzmq", "pyzmq"), ("msgpack", "msgpack", "msgpack"),
                               ("yaml", "pyyaml", "pyyaml"), ("tqdm", "tqdm", "tqdm"),
                               ("sklearn", "scikit-learn", "scikit-learn")):
    need(module, label, package, wheel)
need("numpy", "numpy", "numpy", wheel)
need("pytest", "pytest", "pytest", wheel, " (for the tests step)")
need("hypothesis", "hypothesis", "hypothesis", wheel, " (for the tests step)")
print("\n".join(problems), file=sys.stderr)
print(", ".join(versions))
sys.exit(1 if problems else 0)
EOF
)
status=$?
while IFS= read -r problem; do
    [ -n "$problem" ] && missing+=("$problem")
done <"$out/prerequisites.err"
[ "$status" = 0 ] || [ ${#missing[@]} -gt 0 ] || missing+=("python: the check of the modules failed (status $status)")
[ ${#missing[@]} -eq 0 ] || stop
echo "prerequisites: ok: $found"
[ "$check_only" = 1 ] && exit 0

# ---- the steps ----
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$out/triton-cache}"
cores=$(nproc)

declare -A pid_of began_of cap_of
run_step() {  # run_step MARK NAME SECONDS COMMAND...: its lines to the log and out (MARK before each)
    local mark=$1 name=$2 limit=$3
    shift 3
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/$name.log" | sed -u "s/^/$mark/"
    local status=${PIPESTATUS[0]}
    date +%s >"$out/$name.ended"  # a background step ends before it is joined
    return "$status"
}
limit_of() {  # limit_of SECONDS: the step's limit cut to the time left; 0 where too little is left
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 15 ]; then echo 0; elif [ "$1" -le "$left" ]; then echo "$1"; else echo "$left"; fi
}
ended() {  # ended NAME STATUS LIMIT: its status line; a failure noted (kernel_budget's 1 with its
    #        "over budget" line is a finding, not a failure: the step ran and said so)
    local name=$1 status=$2 limit=$3 note="" spent
    spent=$(($(cat "$out/$name.ended") - ${began_of[$name]}))
    [ "$status" = 124 ] && note=", stopped at its limit of $limit s"
    if [ "$name" = budget ] && [ "$status" = 1 ] && grep -Eq '^[0-9]+ variants, [1-9][0-9]* over budget' "$out/$name.log"; then
        note=" (variants over budget: the MISS lines)"
        findings+=("budget: $(grep -E '^[0-9]+ variants, ' "$out/$name.log")")
        status=0
    fi
    echo "=== $name: status $2 in $spent s$note"
    took+=("$name $spent s")
    [ "$status" = 0 ] || failed+=("$name ($2)")
}
budgeted() {  # budgeted NAME SECONDS: sets the caller's limit (cut to what is left) and the
    #           step's start; 1 where no time is left, noted as a failure
    limit=$(limit_of "$2")
    if [ "$limit" = 0 ]; then
        echo "=== $1: not run: the check's time is spent"
        failed+=("$1 (no time left)")
        return 1
    fi
    began_of[$1]=$(date +%s)
}
step() {  # step NAME SECONDS COMMAND...: bounded in time (cut to what is left), streamed, logged
    local name=$1 limit
    budgeted "$name" "$2" || return 0
    shift 2
    echo "=== $name (at most $limit s): $*"
    run_step "" "$name" "$limit" "$@"
    ended "$name" $? "$limit"
}
background() {  # background NAME SECONDS COMMAND...: as step, beside the next steps, its lines
    #             marked [NAME] as they come; join NAME waits for it
    local name=$1 limit
    budgeted "$name" "$2" || return 0
    shift 2
    echo "=== $name (in the background, at most $limit s, its lines marked [$name]): $*"
    run_step "[$name] " "$name" "$limit" "$@" &
    pid_of[$name]=$!
    cap_of[$name]=$limit
}
join() {  # join NAME: wait for a background step, then its status line
    local name=$1
    [ -n "${pid_of[$name]:-}" ] || return 0
    echo "=== $name: waiting for it to end"
    wait "${pid_of[$name]}"
    ended "$name" $? "${cap_of[$name]}"
}
findings=()

if [ "$dry" = 1 ]; then
    dev=cpu
    sets=(dry)
    dtypes=(float32)
    interp=(env TRITON_INTERPRET=1)  # the kernel steps: CPU tensors, Triton's interpreter
    kernel_opts=(--reps 1)
    echo "device: none: a dry run on the CPU (tiny sizes; the kernel under Triton's interpreter)" | tee "$out/device.txt"
else
    dev=cuda
    sets=(resnet50 vgg16 bert-base)
    dtypes=(float32 bfloat16)
    interp=()
    kernel_opts=(--reps 10)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
fi
echo "$found; $cores cores; Triton's cache $TRITON_CACHE_DIR" | tee -a "$out/device.txt"

# shellcheck disable=SC2016  # $0 is the inner shell's: the python
step build 60 bash -c '"$0" setup.py -q build_ext --inplace && "$0" -c "import adtopk_ps.compression._fibre, server._sparse_sum; print(\"C kernels built and importable\")"' "$py"

# the CUDA tests beside the compiles (they use one core and little of the GPU); joined before the
# kernel step, which times alone
background tests 100 "$py" -m pytest -q -x -p no:cacheprovider tests/test_fibre_triton.py tests/test_seeded.py \
    tests/test_job_device.py tests/test_policy.py tests/test_stateful_compressors.py \
    tests/test_adtopk_properties.py tests/test_roundtrip_properties.py tests/test_dense_allreduce.py \
    -k "cuda or nccl"

step warm 60 "${interp[@]}" "$py" benchmarks/gpu_kernel.py --warm --device "$dev" --sets "${sets[@]}" \
    --dtypes "${dtypes[@]}" --processes "$cores"

# compiles in CPU seconds, which the tests beside it do not inflate
step budget 45 "$py" benchmarks/kernel_budget.py --sets "${sets[@]}" --dtypes "${dtypes[@]}" \
    --processes "$cores" --json "$out/kernel_budget.json"

join tests

step kernel 75 "${interp[@]}" "$py" benchmarks/gpu_kernel.py --device "$dev" --sets "${sets[@]}" \
    --dtypes "${dtypes[@]}" "${kernel_opts[@]}" --json "$out/gpu_kernel.json"

data=(--config configs/digits-cnn.yaml)
if [ -f .data/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    data=(--config configs/fashion-cnn.yaml --set "dataset_args={root: $PWD/.data/fashion-mnist}")
fi
job_steps=$([ "$dry" = 1 ] && echo 20 || echo 150)
step job 40 "$py" -m adtopk_ps.launcher --local --num-workers 2 --num-servers 2 --timeout 35 -- \
    "$py" -m worker "${data[@]}" --steps "$job_steps" --set device="$dev" --set progress=false

links=(10gbit)
if ! "$py" -c "from adtopk_ps.testing import netns; import sys; sys.exit(bool(netns.unavailable()))"; then
    echo "=== e2e: network namespaces cannot be made here: over loopback, unshaped"
    links=(loopback)
fi
model=$([ "$dry" = 1 ] && echo vgg-1024 || echo vgg)
e2e_steps=$([ "$dry" = 1 ] && echo "--steps 2 --warmup 1" || echo "--steps 5 --warmup 2")
# shellcheck disable=SC2086  # e2e_steps: two options and their values
step e2e 70 "$py" benchmarks/e2e.py --device "$dev" --models "$model" --links "${links[@]}" \
    --systems ps-dense ps-topk ps-adtopk --trials 1 $e2e_steps --out "$out"

for finding in "${findings[@]}"; do
    echo "GPU check: found: $finding"
done
summary=$(printf '%s, ' "${took[@]}")
echo "GPU check: ${summary%, }; $((SECONDS - started)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
    echo "GPU check: failed: ${failed[*]}"
    exit 1
fi
echo "GPU check: every step passed"
