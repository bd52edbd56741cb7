"""checkov (pinned in requirements-checkov.txt, installed by `make test-tools`, which `make test` runs) over what
the repo ships: the chart rendered with its defaults and every examples/values-*.yaml, each Ray pod as KubeRay creates
it (checkov's Kubernetes checks cannot look inside a RayJob), k8s/ and the Dockerfile, in one invocation. Every check
that fails must be listed, with its reason, in tests/checkov-accepted.yaml, and every listed check must still fail."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import yaml
from k8s_support import EXAMPLE_VALUES, K8S, REPO, one, render, tool
from test_security import as_created

ACCEPTED = REPO / "tests" / "checkov-accepted.yaml"


def write_inputs(folder) -> None:
    for values in [[]] + [[p] for p in EXAMPLE_VALUES]:
        stem = values[0].stem if values else "defaults"
        objects = render(values)
        (folder / f"chart-{stem}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        name = one(objects, "RayJob")["metadata"]["name"]
        pods = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {**tpl.get("metadata", {}), "name": re.sub(r"[^a-z0-9-]", "-", f"{name}-{role}")},
                "spec": tpl["spec"],
            }
            for role, tpl in as_created(objects).items()
        ]
        (folder / f"pods-{stem}.yaml").write_text(yaml.safe_dump_all(pods, sort_keys=False))
    shutil.copytree(K8S, folder / "k8s")
    shutil.copy(REPO / "Dockerfile", folder / "Dockerfile")


def test_checkov_fails_only_the_accepted_checks(tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    write_inputs(inputs)
    # --skip-download: no calls to Prisma Cloud (the CI machines have no network); one process for everything.
    proc = subprocess.run(
        [
            tool("checkov"),
            "--directory",
            str(inputs),
            "--framework",
            "kubernetes",
            "dockerfile",
            "--output",
            "json",
            "--compact",
            "--quiet",
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode in (0, 1) and proc.stdout.strip(), proc.stderr[-3000:]
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}, "both frameworks ran"
    assert all(r["summary"]["parsing_errors"] == 0 for r in reports)
    assert sum(r["summary"]["passed"] for r in reports) > 500, "checkov saw the pods, not only the custom objects"
    failed: dict[str, set[str]] = {}
    for report in reports:
        for check in report["results"]["failed_checks"]:
            where = f"{check['file_path'].rsplit('/', 1)[-1]}: {check['resource']}"
            failed.setdefault(check["check_id"], set()).add(where)
    accepted = yaml.safe_load(ACCEPTED.read_text())
    unexpected = {k: sorted(v)[:5] for k, v in failed.items() if k not in accepted}
    assert not unexpected, (
        f"checkov checks failing that {ACCEPTED.name} does not list (fix, or list with a reason):\n"
        + yaml.safe_dump(unexpected)
    )
    stale = sorted(set(accepted) - set(failed))
    assert not stale, f"{ACCEPTED.name} lists checks that pass now: delete them: {stale}"
    for check_id, entry in accepted.items():
        assert entry.get("name") and len(entry.get("reason", "")) > 40, check_id
