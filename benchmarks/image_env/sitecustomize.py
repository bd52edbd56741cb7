"""Benchmark runs on the GPU host only (benchmarks/device_run.sh puts this folder first on PYTHONPATH, so every
Python process of a run, the app's and the peers', imports it at start): the host's Python has torchvision and
scikit-learn, which the image (rayproject/ray) has not, and transformers imports both whenever they are installed,
torchvision.io through any model config (transformers.utils.type_validators -> video_utils -> image_utils: 4.8 s
there) and sklearn.metrics through the auto classes (generation.candidate_generator: 1.7 s). Hidden here, as
they are in the image: `import torchvision` fails and `importlib.util.find_spec` finds nothing. Text models need
neither."""

import sys

for _name in ("torchvision", "sklearn"):
    sys.modules.setdefault(_name, None)
