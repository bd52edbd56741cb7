"""MLflow through the chart: `helm install` of examples/values-cpu.yaml with training.tracking.mlflow.uri pointing
at a real `mlflow server` (SQLite) on the host, on the pod network's gateway, which the pods of the real node
reach; the credentials
Secret becomes env of head and workers by reference only (never in the RayJob spec or the ConfigMap); the
NetworkPolicy gets one egress rule, the server's address and port. The run, read back with MLflow's client, holds
the config, every step's loss and ends FINISHED."""

from __future__ import annotations

import json

import pytest
import yaml
from mlflow_server import MlflowServer

from e2e import support
from e2e.test_train import CPU_VALUES, put_model, total_steps, wait_job_end

pytestmark = pytest.mark.e2e


def test_helm_install_tracks_the_run_in_mlflow(cluster, namespace, node, tiny_model, tmp_path):
    ns = namespace
    server = MlflowServer(tmp_path / "mlflow", host=node.gateway).start()
    try:
        claim = put_model(node, ns, "tracked", tiny_model)
        secret_value = "not-a-real-password-7f3a"
        literals = [f"--from-literal={k}={v}" for k, v in (("USERNAME", "finetune"), ("PASSWORD", secret_value))]
        literals = [arg.replace("=", "=MLFLOW_TRACKING_", 1) for arg in literals]
        cluster.kubectl("create", "secret", "generic", "mlflow-credentials", "-n", ns, *literals)
        sets = [
            f"training.tracking.mlflow.uri={server.uri}",
            "training.tracking.mlflow.experiment=e2e-finetunes",
            "tracking.mlflow.credentialsSecret=mlflow-credentials",
            f"tracking.mlflow.egressTo[0].ipBlock.cidr={node.gateway}/32",
            *node.image_sets(),
        ]
        support.install(cluster, "tracked", ns, CPU_VALUES, sets)
        status = wait_job_end(cluster, node, ns, "tracked")
        assert status.get("jobStatus") == "SUCCEEDED", f"{status}\n{node.logs(ns)[-20000:]}"

        # The Secret by reference only, on head and workers; its value nowhere in the RayJob or the ConfigMap.
        job = support.get(cluster, "rayjob", ns, "tracked")
        config_map = support.get(cluster, "configmap", ns, "tracked")
        assert secret_value not in json.dumps(job) + json.dumps(config_map)
        groups = [job["spec"]["rayClusterSpec"]["headGroupSpec"]] + job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
        for group in groups:
            env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
            ref = env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "mlflow-credentials", "key": "MLFLOW_TRACKING_PASSWORD", "optional": True}
        # The NetworkPolicy: the chart's egress plus exactly the server's address and port.
        egress = support.get(cluster, "networkpolicy", ns, "tracked")["spec"]["egress"]
        to_server = [
            {
                "to": [{"ipBlock": {"cidr": f"{node.gateway}/32"}}],
                "ports": [{"protocol": "TCP", "port": server.port}],
            }
        ]
        assert egress[-1:] == to_server, egress

        # The run, read back from the server.
        run_dir = claim / "tracked"
        record = json.loads((run_dir / "mlflow_run.json").read_text())
        client = server.client()
        run = client.get_run(record["run_id"])
        assert run.info.status == "FINISHED" and run.info.run_name == "tracked", run.info
        assert client.get_experiment(run.info.experiment_id).name == "e2e-finetunes"
        assert run.data.params["ds_config.zero_optimization.stage"] == "3"
        assert run.data.tags["final_model"] == "/mnt/cluster_storage/tracked/final"
        steps = sorted({m.step for m in client.get_metric_history(run.info.run_id, "loss")})
        every = yaml.safe_load(CPU_VALUES[0].read_text())["training"]["train"]["log_every_steps"]
        assert steps == list(range(every, total_steps(CPU_VALUES[0]) + 1, every)), steps
        assert (run_dir / "loss.png").stat().st_size > 10_000
    finally:
        server.stop()
