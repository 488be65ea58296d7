#!/usr/bin/env bash
# The GPU check, in one go on one GPU (about 5 minutes): the CUDA tests, the compression table
# on the three gradient sets, a short GPU run of the training job (2 workers, 2 servers), and a
# short e2e comparison of dense, top-k and ADTopk with GPU workers on 10 and 25 Gbit/s links
# (over loopback, unshaped, where the machine cannot make network namespaces; it says so).
#
#     bash benchmarks/gpu_check.sh            # logs in $OUT (else /tmp/gpu-check)
#
# A machine without pyzmq can take it as wheels in .whl/ (see docs/gpu.md); Fashion-MNIST is
# read from .data/fashion-mnist/ where it is there (else the job trains on digits).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

if ! "$py" -c "import zmq" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

failed=()
step() {  # step NAME SECONDS COMMAND...: run it bounded in time, log it, note a failure
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    local began=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local status=${PIPESTATUS[0]}
    echo "=== $name: status $status in $((SECONDS - began)) s"
    [ "$status" = 0 ] || failed+=("$name ($status)")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$out/device.txt"

step tests 120 "$py" -m pytest -q -x -p no:cacheprovider tests/test_fibre_triton.py tests/test_seeded.py \
    tests/test_job_device.py tests/test_policy.py tests/test_stateful_compressors.py \
    tests/test_adtopk_properties.py tests/test_roundtrip_properties.py tests/test_dense_allreduce.py -k "cuda or nccl or device"

step compression 90 "$py" benchmarks/compression.py --device cuda --sets resnet50 vgg16 bert-base

data=(--config configs/digits-cnn.yaml)
if [ -f .data/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    data=(--config configs/fashion-cnn.yaml --set "dataset_args={root: $PWD/.data/fashion-mnist}")
fi
step job 90 "$py" -m adtopk_ps.launcher --local --num-workers 2 --num-servers 2 --timeout 80 -- \
    "$py" -m worker "${data[@]}" --steps 300 --set device=cuda --set progress=false

links=(10gbit 25gbit)
if ! "$py" -c "from adtopk_ps.testing import netns; import sys; sys.exit(bool(netns.unavailable()))"; then
    echo "=== e2e: network namespaces cannot be made here: over loopback, unshaped"
    links=(loopback)
fi
step e2e 200 "$py" benchmarks/e2e.py --device cuda --models vgg --links "${links[@]}" \
    --systems ps-dense ps-topk ps-adtopk ddp-dense --trials 1 --steps 5 --warmup 2 --out "$out"

if [ ${#failed[@]} -gt 0 ]; then
    echo "GPU check: failed: ${failed[*]}"
    exit 1
fi
echo "GPU check: every step passed"
