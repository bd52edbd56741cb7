"""tools/image/prune.py names exactly the build cache's images that no current build needs: earlier builds and
their steps, never the current build's layer chain nor an image of another repository."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

PRUNE = REPO / "tools" / "image" / "prune.py"
APP, BASE, DEB = (
    "localhost/ray-finetune:0.1.0-new",
    "localhost/ray-standin:2.60.0-py311-cu130-new",
    ("localhost/finetune-debian:bookworm-minbase-k"),
)


OLD_BASE = "localhost/ray-standin:2.60.0-py311-cu130-old"


def storage(tmp_path, images, layers):
    (tmp_path / "overlay-images").mkdir()
    (tmp_path / "overlay-layers").mkdir()
    (tmp_path / "overlay-images" / "images.json").write_text(json.dumps(images))
    (tmp_path / "overlay-layers" / "layers.json").write_text(json.dumps(layers))
    return tmp_path


def prune(root, *keep):
    out = subprocess.run([sys.executable, str(PRUNE), str(root), *keep], capture_output=True, text=True, check=True)
    return sorted(out.stdout.split())


def test_earlier_builds_and_their_steps_are_named_the_current_chain_is_kept(tmp_path):
    # deb <- base <- torch <- app(new); an earlier build forked after torch (old-deps <- old-app).
    chain = {"deb": None, "base": "deb", "torch": "base", "app": "torch", "olddeps": "torch", "oldapp": "olddeps"}
    layers = [{"id": k, "parent": v} for k, v in chain.items()] + [{"id": "oldbase", "parent": "deb"}]
    images = [
        {"id": "i-deb", "names": [DEB], "layer": "deb"},
        {"id": "i-base", "names": [BASE, "localhost/ray-standin:2.60.0-py311-cu130"], "layer": "base"},
        {"id": "i-torch-step", "names": [], "layer": "torch"},  # a step the next build's cache reuses
        {"id": "i-app", "names": [APP], "layer": "app"},
        {"id": "i-olddeps-step", "layer": "olddeps"},  # a step of the earlier build only
        # Two keys of one image (a rebuild whose steps were all cached): removed by name, as buildah refuses its ID.
        {
            "id": "i-oldapp",
            "names": ["localhost/ray-finetune:0.1.0-old", "localhost/ray-finetune:0.1.0-older"],
            "layer": "oldapp",
        },
        {"id": "i-oldbase", "names": [OLD_BASE], "layer": "oldbase"},
        {"id": "i-user", "names": ["docker.io/library/python:3.11"], "layer": "oldapp"},  # not ours to remove
    ]
    root = storage(tmp_path, images, layers)
    assert prune(root, APP, BASE, DEB) == sorted(
        ["i-olddeps-step", "localhost/ray-finetune:0.1.0-old", "localhost/ray-finetune:0.1.0-older", OLD_BASE]
    )


def test_nothing_is_named_when_storage_holds_only_the_current_build(tmp_path):
    layers = [{"id": "deb"}, {"id": "base", "parent": "deb"}, {"id": "app", "parent": "base"}]
    images = [
        {"id": "i-deb", "names": [DEB], "layer": "deb"},
        {"id": "i-base", "names": [BASE], "layer": "base"},
        {"id": "i-app", "names": [APP], "layer": "app"},
    ]
    assert prune(storage(tmp_path, images, layers), APP, BASE, DEB) == []


def test_an_empty_storage_names_nothing(tmp_path):
    assert prune(tmp_path, APP) == []
