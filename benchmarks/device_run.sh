#!/usr/bin/env bash
# One device call (the workplace's `run` tool: kind nvidia-h200-x2 for tutorial, trainer-2gpu, ckpt and offload (30 CPUs),
# nvidia-h200 for the others), from the checkout's root:
#   bash .gpu/tree/benchmarks/device_run.sh SUITE DEADLINE_S [ONLY]
# where .gpu/ (git-ignored, carried) holds site-py312.tar.xz (Ray, DeepSpeed, datasets for the host's Python
# 3.12), whl/ (liger-kernel, torchao; trl for the trl suites) and tree/ (this repository's files). Results land in $OUT/SUITE/.
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
# The standalone checks a suite's table cites, run first; CHECKS (space-separated module names of benchmarks/:
# check_varlen fp8_shapes check_loss_chunks pin_stall import_profile) overrides the suite's own.
case $suite in trainer) checks=check_varlen;; fp8) checks=fp8_shapes;; *) checks=;; esac
for check in ${CHECKS-$checks}; do
  case $check in
    fp8_shapes) timeout 200 python3 -m benchmarks.fp8_shapes --out "$OUT/$suite/fp8_shapes.json" --deadline-s "${FP8_SHAPES_S:-150}";;
    *) timeout 150 python3 -m "benchmarks.$check" --out "$OUT/$suite/$check.json";;
  esac
done
python3 -m benchmarks.bench --suite "$suite" --out "$OUT/$suite" --deadline-s "$deadline" ${only:+--only "$only"}
tar -C /tmp/finetune-bench -czf "$OUT/$suite/logs.tar.gz" logs configs 2>/dev/null
ls -d /tmp/ray/session_* "${RAY_TMPDIR:-/tmp}"/ray* 2>&1 | head -4
# Ray's own logs of each local cluster (one session per app case): the controller's and workers' timelines.
(cd /tmp/ray && tar -czf "$OUT/$suite/ray-logs.tar.gz" --exclude='*events*' --exclude='*.out' session_2*/logs)
[ "$(stat -c %s "$OUT/$suite/ray-logs.tar.gz" 2>/dev/null || echo 0)" -lt 15000000 ] || \
  (cd /tmp/ray && tar -czf "$OUT/$suite/ray-logs.tar.gz" session_2*/logs/train)
