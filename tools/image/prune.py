"""Which images of the build cache's storage no current build needs: `prune.py GRAPHROOT KEEP...` prints their IDs.

Every rebuild of the image leaves its predecessor in buildah's storage (7 GB unpacked each when the dependencies
changed), and a machine's disk fills within a day of work. Kept: the images named KEEP (the current build, its
stand-in base and the Debian minbase), every untagged image whose top layer lies in one of their layer chains (the
steps buildah's --layers cache reuses on the next build), and every image with a name outside this project's three
repositories. Printed, one per line: the names of the other images of those repositories, and the IDs of the
untagged images of no kept chain (the steps of earlier builds). Reads containers-storage's
overlay-images/images.json and overlay-layers/layers.json (the storage of tools/image/build.sh, not locked while
no buildah runs); removes nothing.
"""

import json
import sys
from pathlib import Path

OURS = ("localhost/ray-finetune:", "localhost/ray-standin:", "localhost/finetune-debian:")


def stale(images: list[dict], parents: dict[str, str | None], keep: set[str]) -> list[str]:
    """What `buildah rmi` is given: names of stale tagged images, IDs of stale untagged ones."""
    kept = [i for i in images if keep & set(i.get("names") or [])]
    chain: set[str] = set()
    for image in kept:
        layer = image.get("layer")
        while layer and layer not in chain:
            chain.add(layer)
            layer = parents.get(layer)
    out = []
    for image in images:
        names = image.get("names") or []
        if image in kept:
            continue
        if names and all(n.startswith(OURS) for n in names):
            out += names  # by name: an image of several names is removed with its last (buildah refuses its ID)
        elif not names and image.get("layer") not in chain:
            out.append(image["id"])
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: prune.py GRAPHROOT KEEP_REF...", file=sys.stderr)
        return 2
    root = Path(argv[0])
    try:
        images = json.loads((root / "overlay-images" / "images.json").read_text())
        layers = json.loads((root / "overlay-layers" / "layers.json").read_text())
    except FileNotFoundError:
        return 0  # an empty storage
    parents = {layer["id"]: layer.get("parent") for layer in layers}
    for image_id in stale(images, parents, set(argv[1:])):
        print(image_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
