#!/usr/bin/env bash
# The GPU checks of issue 31 in one prepared command (see ../shared/gpu/README.md):
#
#   bash bench/gpu_check.sh prepare   # here, with a package registry: wheels and scripts into .device/
#   bash bench/gpu_check.sh run       # on the GPU machine, with .device/ carried beside the tree
#
# `run` installs the carried wheels into /tmp/site, writes the bench archive, runs the GPU yardstick
# with decode="gpu" (and again with decode="cpu" for the baseline of the same machine), the project's
# stage of the GPU bench (epochs cold/warm, CPU vs GPU decode, device tier) and the project's GPU
# tests; everything lands under $OUT (else /tmp/out).
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo /.device/ >> .git/info/exclude
    mkdir -p .device/whl
    cp ../shared/gpu/check.py ../shared/bench/make_dataset.py .device/
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .device/whl zarr==3.1.6 numcodecs==0.16.6 obstore==0.12.1 \
        donfig==0.8.1.post1 google-crc32c==1.9.0 crc32c xarray==2026.9.0 dask==2026.8.0 partd locket \
        nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12 kvikio-cu13 libkvikio-cu13 \
        pytest hypothesis iniconfig pluggy sortedcontainers attrs \
        pyyaml pygments toolz cloudpickle fsspec click tqdm packaging typing_extensions
    ls .device/whl | wc -l
    ;;
run)
    # one log (the device tool brings back few files), -X faulthandler: a crash in CUDA code says where
    OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"; export OUT; L="$OUT/log.txt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .device/whl/*.whl > "$L" 2>&1 || exit 3
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    py() { timeout "$1" python3 -X faulthandler -W ignore "${@:2}" 2>&1 | grep -v "^Extension modules" | tail -c 8000 >> "$L"; }
    python3 -m xinsitu doctor >> "$L" 2>&1
    timeout 90 python3 -W ignore .device/make_dataset.py /tmp/era5.zarr > /dev/null 2>&1
    py 150 -m pytest -q -rfE --tb=short -p no:cacheprovider -m gpu tests/test_gpu_path.py tests/test_gpu_device.py \
        tests/test_gpu_decode.py tests/test_gpu_cache.py tests/test_transform.py
    py 150 .device/check.py /tmp/era5.zarr --stages correctness,throughput --kw '{"decode": "gpu"}'
    mv "$OUT/gpu.json" "$OUT/check_decode_gpu.json" 2>/dev/null
    py 100 .device/check.py /tmp/era5.zarr --stages throughput --kw '{"decode": "cpu"}'
    mv "$OUT/gpu.json" "$OUT/check_decode_cpu.json" 2>/dev/null
    py 150 bench/gpu_bench.py /tmp/era5.zarr --stages epochs,decode
    py 90 bench/gpu_profile.py /tmp/era5.zarr
    ;;
*)
    echo "usage: bash bench/gpu_check.sh prepare|run" >&2; exit 2;;
esac
