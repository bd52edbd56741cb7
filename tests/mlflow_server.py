"""A real MLflow tracking server for tests: `mlflow server` on a SQLite file, on a free port.

The server comes from the venv of its own that `make test-tools` builds, as `make test` and `make e2e` do
(.venv/tools/mlflow, requirements-mlflow.txt): the full `mlflow` package pins pyarrow and python-dateutil below the
versions the app's lock holds. The app talks to it with mlflow-skinny, the client only, of the same version.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MLFLOW = REPO / ".venv" / "tools" / "mlflow" / "bin" / "mlflow"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MlflowServer:
    """`start()` waits until /health answers; `stop()` kills it (SIGKILL: a server that dies, not one that is
    shut down); `start()` again serves the same database on the same port."""

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int | None = None):
        assert MLFLOW.exists(), f"{MLFLOW} is missing: `make setup` installs the MLflow server for the tests"
        self.root, self.host, self.port = root, host, port or free_port(host)
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    @property
    def uri(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 180) -> MlflowServer:
        args = [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db"]
        args += ["--artifacts-destination", str(self.root / "artifacts"), "--host", self.host]
        args += ["--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        env.pop("MLFLOW_TRACKING_URI", None)
        log = (self.root / "server.log").open("a")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"mlflow server exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise AssertionError(f"mlflow server did not answer in {timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its uvicorn worker too
            self.proc.wait()

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)
