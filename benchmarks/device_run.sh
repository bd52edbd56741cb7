#!/usr/bin/env bash
# One device call (the workplace's `run` tool: kind nvidia-h200-x2 for the 2-GPU suites, nvidia-h200 for chat), from the checkout's root:
#   bash .gpu/tree/benchmarks/device_run.sh SUITE DEADLINE_S [ONLY]
# where .gpu/ (git-ignored, carried) holds site-py312.tar.xz (Ray, DeepSpeed, datasets for the host's Python
# 3.12), whl/ (liger-kernel; trl for the chat suite) and tree/ (this repository's files). Results land in $OUT/SUITE/.
set -uo pipefail
suite=$1 deadline=$2 only=${3:-}
G=$PWD/.gpu
mkdir -p /tmp/site && tar -C /tmp/site -xJf "$G/site-py312.tar.xz" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl || exit 1
# Bytecode, as pip writes it at install (the image has it): otherwise the first processes of a call (driver, Ray's
# prestarted workers, controller, workers, each on its own) compile Ray, DeepSpeed and datasets from source.
python3 -m compileall -q -j 0 /tmp/site >/dev/null 2>&1
# The same for the host's own packages: its torch ships no bytecode at all and its environment sets
# PYTHONDONTWRITEBYTECODE=1, so every process compiled torch from source (import torch 2.6 s there). The image has it.
started=$SECONDS
python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1
echo "host bytecode: $((SECONDS - started)) s"
cd "$G/tree" || exit 1
# benchmarks/image_env first: the host's torchvision and scikit-learn hidden from every process, as the image lacks them.
export PYTHONPATH=$PWD/benchmarks/image_env:$PWD:/tmp/site${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
mkdir -p "$OUT/$suite"
if [ "$suite" = peer ] || [ "$suite" = peer1 ] || [ "$suite" = features ] || [ "$suite" = warm2 ]; then timeout 150 python3 -m benchmarks.check_varlen --out "$OUT/$suite/check_varlen.json"; fi
case $suite${FP8_SHAPES_S:+-fp8shapes} in fp8*|*-fp8shapes) timeout 200 python3 -m benchmarks.fp8_shapes --out "$OUT/$suite/fp8_shapes.json" --deadline-s "${FP8_SHAPES_S:-150}";; esac
if [ "${suite%2}" = losschunk ]; then timeout 120 python3 -m benchmarks.check_loss_chunks --out "$OUT/$suite/check_loss_chunks.json"; fi
if [ "$suite" = pin1 ]; then timeout 150 python3 -m benchmarks.pin_stall --out "$OUT/$suite/pin_stall.json"; fi
if [ "$suite" = start ]; then timeout 90 python3 -m benchmarks.import_profile --out "$OUT/$suite/imports.json"; fi
python3 -m benchmarks.bench --suite "$suite" --out "$OUT/$suite" --deadline-s "$deadline" ${only:+--only "$only"}
tar -C /tmp/finetune-bench -czf "$OUT/$suite/logs.tar.gz" logs configs 2>/dev/null
ls -d /tmp/ray/session_* "${RAY_TMPDIR:-/tmp}"/ray* 2>&1 | head -4
# Ray's own logs of each local cluster (one session per app case): the controller's and workers' timelines.
(cd /tmp/ray && tar -czf "$OUT/$suite/ray-logs.tar.gz" --exclude='*events*' --exclude='*.out' session_2*/logs)
[ "$(stat -c %s "$OUT/$suite/ray-logs.tar.gz" 2>/dev/null || echo 0)" -lt 15000000 ] || \
  (cd /tmp/ray && tar -czf "$OUT/$suite/ray-logs.tar.gz" session_2*/logs/train)
