"""Cloud TPU slices and Kubernetes, simulated: each host's environment faked as the platform
sets it, and 2 processes on this machine joined through meshfit (real coordinator, on
127.0.0.1).

- A TPU VM slice (`gcloud compute tpus tpu-vm ssh --worker=all`): JAX reads the worker's number
  and the slice's workers from the GCE metadata server, here one small HTTP server per process.
- A TPU slice in GKE (tools/k8s/tpu-jobset.yaml): GKE sets TPU_WORKER_ID and TPU_WORKER_HOSTNAMES.
- An Indexed Job (tools/k8s/train-job.yaml): the manifest's MESHFIT_* variables, the process id
  from the pod's completion index.
Both TPU cases also need JAX to believe it is on a TPU VM, which it finds by looking for libtpu
and TPU chips when imported: the processes set that flag by hand.
"""

import http.server
import os
import re
import subprocess
import sys
import threading

import pytest
import yaml
from helpers import environment

from meshfit.launch.local import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "guides", "schedulers.md")
JOB, JOBSET = (os.path.join(ROOT, "tools", "k8s", name) for name in ("train-job.yaml", "tpu-jobset.yaml"))
INFO = ["info", "--simulate-devices", "2"]  # joins the job, then prints the discovery report
ON_A_TPU_VM = """
import os, sys
from jax._src.clusters import cloud_tpu_cluster, cluster
cloud_tpu_cluster.running_in_cloud_tpu_vm = cluster.running_in_cloud_tpu_vm = True
os.environ.pop("TPU_SKIP_MDS_QUERY", None)  # set by JAX's import where it found no TPU chips
from meshfit.cli import main
sys.exit(main(sys.argv[1:]))
"""
QUIET = {"MESHFIT_INIT_TIMEOUT": "120", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
         "TPU_SKIP_MDS_QUERY": None, "MESHFIT_NUM_PROCESSES": None, "MESHFIT_COORDINATOR": None,
         "MESHFIT_PROCESS_ID": None}


def join_processes(command, environments, timeout=300):
    """Start one process of `command` per environment (changes over this one's), wait for all;
    their (exit code, stdout + stderr)."""
    jobs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=environment({**QUIET, **changes})) for changes in environments]
    results = []
    for job in jobs:
        try:
            output = job.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            for other in jobs:
                other.kill()
            output = job.communicate()[0]
        results.append((job.returncode, output))
    return results


def assert_joined(results):
    """Every process succeeded, without warnings, and process 0 reports the job of all of them."""
    for code, output in results:
        assert code == 0 and "warning" not in output, output[-3000:]
    pattern = rf"^\s+hosts\s+{len(results)} \(this is process 0\)$"
    assert re.search(pattern, results[0][1], re.M), results[0][1][-3000:]


class MetadataServer(http.server.ThreadingHTTPServer):
    """A GCE metadata server on 127.0.0.1 answering instance attributes from a dict (404 else)."""

    def __init__(self, attributes):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                key = self.path.rpartition("/computeMetadata/v1/instance/attributes/")[2]
                value = attributes.get(key) if self.headers.get("Metadata-Flavor") == "Google" else None
                body = (value or "").encode()
                self.send_response(200 if value is not None else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self):
        return f"127.0.0.1:{self.server_address[1]}"


@pytest.mark.slow
def test_tpu_vm_slice_workers_join_through_jax_metadata_detection():
    """`gcloud compute tpus tpu-vm ssh NAME --worker=all --command="meshfit train ..."` starts the
    same command on every worker; each finds its number and the slice in the metadata."""
    workers = "t1v-n-0-w-0:0:127.0.0.1,t1v-n-0-w-1:1:127.0.0.1"  # name:number:address
    servers = [MetadataServer({"agent-worker-number": str(i), "worker-network-endpoints": workers,
                               "tpu-env": "ACCELERATOR_TYPE: 'v5litepod-8'\n"}) for i in (0, 1)]
    try:
        port = str(free_port())
        results = join_processes([sys.executable, "-c", ON_A_TPU_VM, *INFO],
                                 [{"GCE_METADATA_IP": s.address, "JAX_COORDINATOR_PORT": port} for s in servers])
    finally:
        for server in servers:
            server.shutdown()
    assert_joined(results)


@pytest.mark.slow
def test_tpu_pods_of_the_gke_jobset_join_through_jax_detection():
    """tools/k8s/tpu-jobset.yaml: GKE gives each of its pods TPU_WORKER_ID and the slice's
    TPU_WORKER_HOSTNAMES."""
    with open(JOBSET) as f:
        jobset = yaml.safe_load(f)
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    hosts = job["parallelism"]
    assert job["completions"] == hosts and job["completionMode"] == "Indexed"
    assert job["template"]["spec"]["containers"][0]["command"][:2] == ["meshfit", "train"]
    server = MetadataServer({"tpu-env": ""})  # on GKE the node's metadata has no slice settings
    try:
        port = str(free_port())
        results = join_processes([sys.executable, "-c", ON_A_TPU_VM, *INFO], [
            {"TPU_WORKER_ID": str(i), "TPU_WORKER_HOSTNAMES": ",".join(["localhost"] * hosts),
             "GCE_METADATA_IP": server.address, "JAX_COORDINATOR_PORT": port} for i in range(hosts)])
    finally:
        server.shutdown()
    assert_joined(results)


def pod_environment(container, index):
    """The variables Kubernetes gives the container of the Indexed Job's pod `index`."""
    variables = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": str(index)}
    for entry in container["env"]:
        if "value" in entry:
            variables[entry["name"]] = entry["value"]
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']", path
            variables[entry["name"]] = str(index)
    return variables


@pytest.mark.slow
def test_pods_of_the_indexed_job_join_through_the_manifests_variables():
    """tools/k8s/train-job.yaml: pod i is process i; all reach pod 0 by its name in the headless
    Service (here its address, 127.0.0.1: there is no cluster DNS)."""
    with open(JOB) as f:
        service, job = yaml.safe_load_all(f)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["subdomain"] == service["metadata"]["name"]
    environments = [pod_environment(pod["containers"][0], i) for i in range(spec["parallelism"])]
    port = str(free_port())
    for variables in environments:
        host, _, _ = variables["MESHFIT_COORDINATOR"].rpartition(":")
        assert host == f"{job['metadata']['name']}-0.{pod['subdomain']}"  # pod 0's DNS name
        assert variables["MESHFIT_NUM_PROCESSES"] == str(spec["parallelism"])
        variables["MESHFIT_COORDINATOR"] = f"127.0.0.1:{port}"
    assert pod["containers"][0]["command"][:2] == ["meshfit", "train"]
    assert_joined(join_processes([sys.executable, "-m", "meshfit", *INFO], environments))


def test_the_guide_shows_the_repository_files():
    """docs/guides/schedulers.md shows the sbatch script and the manifests as they are here, which
    the tests run."""
    with open(GUIDE) as f:
        guide = f.read()
    for path in (os.path.join(ROOT, "tools", "slurm", "train.sbatch"), JOB, JOBSET):
        with open(path) as f:
            assert f.read().strip() in guide, f"{path} differs from what {GUIDE} shows"
