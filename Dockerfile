# syntax=docker/dockerfile:1
# One image for KubeRay's head, the workers and the RayJob submitter. Build, push, multi-arch, the build
# without Docker Hub (`make image`: buildah on a stand-in base) and what was (not) proven: docs/container.md.
#
# Base: the official Ray image of the Ray version that pyproject.toml pins. Ray tags its images
# {ray version}-py{python minor}-cu{CUDA major+minor}[-aarch64]; the GPU ones are built on
# nvidia/cuda:<CUDA>-cudnn-devel-ubuntu24.04, so nvcc and g++ are there for DeepSpeed's op build.
#   py311: the Python minor the project is tested and locked on (requires-python >= 3.11).
#   cu130: the CUDA that torch 2.13.0's default (PyPI) build uses; Ray 2.60.0 publishes cu130 images.
#          Nodes need an NVIDIA driver >= 580. For older drivers pick another pair, e.g. --build-arg CUDA=cu126
#          (torch 2.13.0 has cu126 builds and Ray a cu126 image).
# tests/test_image.py fails when the Ray version below, pyproject's ray pin and the chart's rayVersion disagree.
ARG CUDA=cu130
# "" for x86_64; "-aarch64" for arm64 nodes (Ray publishes one tag per architecture, not a manifest list).
ARG ARCH_SUFFIX=""
# The base pinned by digest, so a rebuild cannot pick up a re-pushed tag: --build-arg BASE_DIGEST=sha256:...
# (`docker buildx imagetools inspect rayproject/ray:2.60.0-py311-cu130` prints it). Empty: the tag alone.
ARG BASE_DIGEST=""
# The repository of the base: Ray's own. Another one (a mirror, or the stand-in that `make image` builds where
# Docker Hub is out of reach: docs/container.md) must carry the same tags, user, paths and sudo rule.
ARG BASE_IMAGE=rayproject/ray
FROM ${BASE_IMAGE}:2.60.0-py311-${CUDA}${ARCH_SUFFIX}${BASE_DIGEST:+@}${BASE_DIGEST}

# The project's version (pyproject.toml); the chart's appVersion and default image tag are the same.
ARG VERSION=0.1.0
# torch: the version the tests run with (Makefile's TORCH_CPU), in its CUDA build for the base's CUDA.
ARG TORCH_VERSION=2.13.0
# Where torch's CUDA build comes from: PyTorch's index, whose ${TORCH_INDEX}/${CUDA} serves torch==X+${CUDA}.
# Empty: PyPI alone, whose torch==X for Linux is one CUDA build (2.13.0: CUDA 13.0, i.e. CUDA=cu130 only).
ARG TORCH_INDEX=https://download.pytorch.org/whl
# 1: DeepSpeed's fused Adam (a CUDA op) is compiled at build time, which needs nvcc (the base has it).
# 0: left to DeepSpeed's JIT build on the first GPU job; for builders without nvcc (`make image`).
ARG BUILD_FUSED_ADAM=1
ARG CUDA
ARG ARCH_SUFFIX
ARG BASE_DIGEST
ARG BASE_IMAGE
# The commit the image is built from, for the revision label: --build-arg REVISION="$(git rev-parse HEAD)".
ARG REVISION=""
# GPU architectures that DeepSpeed's CUDA ops are compiled for: Ampere (A100, A10/A40/RTX 30xx) and
# Hopper (H100/H200). Plain numbers: DeepSpeed 0.19.8 cannot parse "9.0a" ("invalid literal for int()").
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;9.0"

LABEL org.opencontainers.image.title="ray-finetune" \
      org.opencontainers.image.description="Fine-tune causal LMs with Ray Train and DeepSpeed ZeRO on KubeRay" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/example/ray-deepspeed-finetune" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}:2.60.0-py311-${CUDA}${ARCH_SUFFIX}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The base image's user is ray (uid 1000, gid 100) and owns the conda environment, so everything below
# installs into that environment without root. pip --in-tree builds need the sources writable by it.
WORKDIR /home/ray/finetune
COPY --chown=1000:100 requirements.lock pyproject.toml ./

# 1. torch, CUDA build matching the base image. requirements.lock (pip freeze of the test venv, which has
#    the CPU build of torch) holds neither torch nor nvidia-* nor triton; it pins torch's other dependencies.
#    setuptools is pinned here because pip freeze leaves it out of the lock (torch needs >=77.0.3).
#    From PyTorch's index the version carries the CUDA tag (+cu130); from PyPI (TORCH_INDEX empty) it has none.
RUN pip install --no-cache-dir -c requirements.lock \
        ${TORCH_INDEX:+--extra-index-url "${TORCH_INDEX}/${CUDA}"} \
        "torch==${TORCH_VERSION}${TORCH_INDEX:++${CUDA}}" "setuptools==84.2.1" \
 && python -c "import torch, sys; c = torch.version.cuda or ''; want = '${CUDA}'[2:]; \
sys.exit(0 if c.replace('.', '') == want else f'torch {torch.__version__} has CUDA {c!r}, the base has ${CUDA}')"

# 2. DeepSpeed at the locked version, with CPU Adam and fused Adam compiled now rather than JIT-compiled on
#    every worker at job start. No GPU is visible during a build, so the CUDA accelerator is named explicitly
#    (prebuilt ops are used only when the runtime accelerator matches the one they were built for).
#    --no-build-isolation: DeepSpeed's setup.py must see the torch installed above. DeepSpeed skips a requested
#    op that it finds incompatible without failing, hence the check for the compiled modules afterwards.
#    BUILD_FUSED_ADAM=0 leaves out fused Adam alone (it needs nvcc); CPU Adam is always prebuilt.
RUN DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM="${BUILD_FUSED_ADAM}" \
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    pip install --no-cache-dir --no-build-isolation -c requirements.lock "$(grep '^deepspeed==' requirements.lock)" \
 && ds="$(python -c 'import importlib.util as u; print(u.find_spec("deepspeed").submodule_search_locations[0])')" \
 && ls "$ds"/ops/adam/cpu_adam_op*.so \
 && if [ "${BUILD_FUSED_ADAM}" = 1 ]; then ls "$ds"/ops/adam/fused_adam_op*.so; fi

# 3. The project's runtime dependencies from pyproject.toml, pinned by the lock (dev tools stay out), and its
#    `gpu` extra (Liger's Triton kernels; triton itself came with torch's CUDA build in step 1).
#    Packages that the base image already has are moved to the locked versions where the project uses them.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" \
        > /tmp/requirements.txt \
 && pip install --no-cache-dir -c requirements.lock -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# 4. DeepSpeed's shared-memory collectives, which CPU workers (training.scaling.use_gpu false) load: DeepSpeed
# compiles them at first use, 1-2 minutes in every pod at every start (a pod's home folder does not outlive it).
# Built once here into the torch extensions folder of uid 1000's home; a pod's load then finds the build up to
# date and compiles nothing. GPU workers never load it.
RUN DS_ACCELERATOR=cpu python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)" \
 && ls "${HOME}"/.cache/torch_extensions/*/deepspeed_shm_comm/deepspeed_shm_comm.so

# 5. The project itself (its dependencies are all in place), then the example configs users start from.
COPY --chown=1000:100 README.md ./
COPY --chown=1000:100 app/ app/
RUN pip install --no-cache-dir --no-deps . \
 && rm -rf build ./*.egg-info \
 && finetune --help > /dev/null
COPY --chown=1000:100 examples/ examples/

# Any other DeepSpeed op that is JIT-built at run time gets plain-number architectures too (see above).
ENV TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}"

# The base image gives its user passwordless sudo (a "ray ALL=NOPASSWD: ALL" line in /etc/sudoers and the sudo
# group), so the non-root uid 1000 could become root. Nothing needs root at run time: the line, the group
# membership and the setuid/setgid bit of every file (sudo, su, mount, passwd, ...) go, and the build fails if
# any of them is still there (docs/container.md).
USER 0
RUN sed -i '/^ray[[:space:]]/d' /etc/sudoers \
 && rm -f /etc/sudoers.d/ray \
 && if id -nG ray | grep -qw sudo; then gpasswd -d ray sudo; fi \
 && find / -xdev -type f -perm /6000 -exec chmod ug-s {} + \
 && if grep -rqsE '^(ray|%users|%sudo)[[:space:]].*NOPASSWD' /etc/sudoers /etc/sudoers.d \
       || id -nG ray | grep -qw sudo || [ -n "$(find / -xdev -type f -perm /6000 -print -quit)" ]; then \
      echo "uid 1000 can still become root (a sudo rule, the sudo group or a setuid/setgid file)" >&2; exit 1; \
    fi

# The base image's non-root user, numeric so that Kubernetes' runAsNonRoot can verify it.
USER 1000:100

# No ENTRYPOINT (the NVIDIA base's banner script is dropped): `docker run IMAGE finetune --help` runs the
# CLI as given, and KubeRay sets command and args of head, workers and submitter (ray start, ray job submit).
ENTRYPOINT []
CMD ["finetune", "--help"]
