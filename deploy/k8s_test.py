#!/usr/bin/env python3
"""The deployment artifacts are valid and agree with kvtd's configuration, offline.

- Every kustomization (deploy/k8s/overlays/*, deploy/k8s/fit) renders with `kubectl kustomize`,
  and every rendered object validates against the Kubernetes JSON schemas that
  kubernetes-validate bundles (strict: unknown fields are errors), for the oldest and newest
  Kubernetes version we support. PodMonitor is the one kind not schema-checked: it is a
  Prometheus Operator CRD whose schema no offline package ships; its selector and port are
  checked against the Deployment instead.
- The ConfigMap's kvtd.yaml is parsed by kvtd's own loader (//deploy:kvtd_config_json), and
  ports, probes, grace period, memory, mount paths and hostIPC are checked against it.
- The fit Job runs fit-shard.sh with the env it reads (the script itself runs in fit_job_test).
- deploy/docker/Dockerfile: every repository path it copies and every Bazel target it builds
  exists, and its health check and entrypoint name real binaries and commands.

Runs with the project venv's Python (scripts/bootstrap.sh --python installs requirements.lock
there): scripts/test.sh puts the venv first on PATH; run on its own, the test
re-executes itself with $KVT_VENV or the workspace's .venv. Missing dependencies (the venv's
packages, kubectl) fail the test: they are never a skip.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unittest

# Kubernetes versions the manifests must be valid for: native gRPC probes are GA since 1.27;
# 1.37 is the newest schema set kubernetes-validate 1.37 bundles.
K8S_VERSIONS = ["1.29", "1.37"]
OVERLAYS = ["cpu", "gpu", "gpu-ipc", "prefix-cache"]
# Overlays sharing memory with the inference pods on their node.
SHARED_MEMORY_OVERLAYS = {"gpu-ipc", "prefix-cache"}
INFERENCE = "deploy/k8s/inference"
# The cluster tier (Mooncake Store) on top of prefix-cache, and its engine.
CLUSTER_TIER = "deploy/k8s/overlays/cluster-tier"
CLUSTER_INFERENCE = "deploy/k8s/overlays/cluster-tier/inference"
NOT_SCHEMA_CHECKED = {"PodMonitor"}  # CRD: see the module docstring
INFERENCE_LABEL = {"kvt.io/inference": "true"}


def _runfiles_root():
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        return os.path.join(srcdir, os.environ.get("TEST_WORKSPACE", "kvt"))
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


RUNFILES = _runfiles_root()


def _workspace_root():
    # Runfiles are symlinks to the source tree; its root holds the venv.
    marker = os.path.join(RUNFILES, "requirements.lock")
    return os.path.dirname(os.path.realpath(marker))


def _ensure_venv():
    """Re-executes this test with the venv's Python unless kubernetes_validate imports."""
    try:
        import kubernetes_validate  # noqa: F401
        import yaml  # noqa: F401
        return
    except ImportError as e:
        missing = str(e)
    venv = os.environ.get("KVT_VENV") or os.path.join(_workspace_root(), ".venv")
    python = os.path.join(venv, "bin", "python")
    if os.environ.get("KVT_K8S_TEST_REEXEC") or not os.path.exists(python):
        sys.exit(f"k8s_test: {missing}; the venv {venv} is not on requirements.lock: "
                 "run scripts/bootstrap.sh --python (CI does, via scripts/test.sh)")
    os.environ["KVT_K8S_TEST_REEXEC"] = "1"
    os.execv(python, [python] + sys.argv)


_ensure_venv()
import kubernetes_validate  # noqa: E402
import yaml  # noqa: E402


def path(*parts):
    return os.path.join(RUNFILES, *parts)


def read(*parts):
    with open(path(*parts)) as f:
        return f.read()


_K8S_COPY = []


def render(kustomization_dir):
    """`kubectl kustomize` of a directory under deploy/k8s."""
    if not shutil.which("kubectl"):
        raise AssertionError("kubectl (>= 1.21: kustomize v4+ built in) is not on PATH; the "
                             "machine image ships it (docs/OPERATIONS.md, 'CI checks')")
    if not _K8S_COPY:
        # kustomize does not follow the runfiles' symlinks: render a plain copy of deploy/k8s.
        copy = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        shutil.copytree(path("deploy", "k8s"), os.path.join(copy, "deploy", "k8s"))
        _K8S_COPY.append(copy)
    result = subprocess.run(["kubectl", "kustomize", os.path.join(_K8S_COPY[0], kustomization_dir)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {kustomization_dir}: {result.stderr}")
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def one(docs, kind, name_prefix=""):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} {name_prefix}*, found {len(found)}"
    return found[0]


def kvtd_config(yaml_text):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=os.environ.get("TEST_TMPDIR"),
                                     delete=False) as f:
        f.write(yaml_text)
    result = subprocess.run([path("deploy", "kvtd_config_json"), f.name],
                            capture_output=True, text=True)
    os.unlink(f.name)
    if result.returncode != 0:
        raise AssertionError(f"kvtd rejects the ConfigMap's kvtd.yaml: {result.stderr}")
    return json.loads(result.stdout)


def flat(config):
    """kvtd_config_json's nested keys as {"section.key": value}."""
    return {f"{section}.{key}": value
            for section, keys in config.items() for key, value in keys.items()}


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def bytes_of(quantity):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(quantity))
    assert m, f"unsupported memory quantity {quantity}"
    return int(m.group(1)) * units.get(m.group(2), 1)


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def container_ports(container):
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


class SchemaTest(unittest.TestCase):
    def test_every_rendered_object_validates(self):
        checked = set()
        for directory in ([f"deploy/k8s/overlays/{o}" for o in OVERLAYS] +
                          ["deploy/k8s/fit", INFERENCE, CLUSTER_TIER, CLUSTER_INFERENCE]):
            for doc in render(directory):
                name = f"{directory}: {doc['kind']}/{doc['metadata']['name']}"
                if doc["kind"] in NOT_SCHEMA_CHECKED:
                    continue
                for version in K8S_VERSIONS:
                    try:
                        kubernetes_validate.validate(doc, version, strict=True)
                    except kubernetes_validate.ValidationError as e:
                        self.fail(f"{name} (Kubernetes {version}): {e.message} at "
                                  f"{'/'.join(str(p) for p in e.path)}")
                    except kubernetes_validate.SchemaNotFoundError as e:
                        self.fail(f"{name}: {e.message}")
                checked.add(doc["kind"])
        self.assertEqual(checked, {"ServiceAccount", "ConfigMap", "PersistentVolumeClaim",
                                   "Deployment", "Service", "PodDisruptionBudget",
                                   "NetworkPolicy", "Job"})

    def test_the_validator_rejects_a_broken_manifest(self):
        # The check above can fail: a misspelt field and a wrong type are caught.
        deployment = one(render("deploy/k8s/overlays/cpu"), "Deployment")
        broken = json.loads(json.dumps(deployment))
        pod_spec(broken)["terminationGracePeriod"] = 45
        with self.assertRaises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)
        broken = json.loads(json.dumps(deployment))
        broken["spec"]["replicas"] = "two"
        with self.assertRaises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


class KvtdManifestTest(unittest.TestCase):
    def check_overlay(self, overlay):
        docs = render(f"deploy/k8s/overlays/{overlay}")
        deployment = one(docs, "Deployment", "kvtd")
        spec = pod_spec(deployment)
        (container,) = spec["containers"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        self.assertEqual(deployment["spec"]["selector"]["matchLabels"], labels)

        # The config: a ConfigMap made from a kvtd.yaml that kvtd itself accepts, mounted where
        # --config points.
        config_map = one(docs, "ConfigMap", "kvtd-config")
        self.assertEqual(list(config_map["data"]), ["kvtd.yaml"])
        config = kvtd_config(config_map["data"]["kvtd.yaml"])
        config_arg = [a for a in container["args"] if a.startswith("--config=")]
        self.assertEqual(len(config_arg), 1)
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        config_volume = [n for n, v in volumes.items()
                         if v.get("configMap", {}).get("name") == config_map["metadata"]["name"]]
        self.assertEqual(len(config_volume), 1, "the generated ConfigMap is mounted")
        self.assertEqual(config_arg[0], "--config=" + os.path.join(
            mounts[config_volume[0]]["mountPath"], "kvtd.yaml"))

        # Ports: kvtd's listeners = container ports = probes = Service = PodMonitor.
        ports = container_ports(container)
        self.assertEqual(ports["grpc"], port_of(config["server"]["listen_address"]))
        self.assertTrue(config["metrics"]["listen_address"],
                        "metrics must be on for the PodMonitor")
        self.assertEqual(ports["metrics"], port_of(config["metrics"]["listen_address"]))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertEqual(container[probe]["grpc"]["port"], ports["grpc"], probe)
        self.assertFalse(config["security"]["tls_cert_file"],
                         "native gRPC probes are plaintext (docs/OPERATIONS.md)")
        service = one(docs, "Service", "kvtd")
        self.assertEqual(service["spec"]["selector"], labels)
        self.assertEqual({p["name"]: p["targetPort"] for p in service["spec"]["ports"]},
                         {"grpc": "grpc", "metrics": "metrics"})
        monitor = one(docs, "PodMonitor", "kvtd")
        self.assertEqual(monitor["spec"]["selector"]["matchLabels"], labels)
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            self.assertIn(endpoint["port"], ports)

        # Shutdown: the kubelet waits longer than kvtd's drain + deadline.
        self.assertGreater(spec["terminationGracePeriodSeconds"],
                           config["shutdown"]["drain_grace_seconds"]
                           + config["shutdown"]["deadline_seconds"])

        # Memory (docs/OPERATIONS.md, "Sizing"): request = limit >= every admitted cache + the
        # host budget of the mappers (explicit: its default is a share of the node's memory) +,
        # on the CPU backend, its fp32 copies (device budget; 0 = the host budget) + 2 GiB of
        # workspace and process.
        resources = container["resources"]
        memory = bytes_of(resources["limits"]["memory"])
        self.assertEqual(bytes_of(resources["requests"]["memory"]), memory)
        store, limits = config["mapper_store"], config["limits"]
        self.assertGreater(store["host_budget_bytes"], 0)
        needed = limits["max_inflight_bytes"] + store["host_budget_bytes"] + 2 * 2**30
        if overlay == "cpu":
            needed += store["device_budget_bytes"] or store["host_budget_bytes"]
        self.assertGreaterEqual(memory, needed)
        self.assertGreaterEqual(limits["max_inflight_bytes"], limits["max_request_bytes"])

        # The mapper store: the PVC, read-only, where kvtd looks.
        self.assertEqual(mounts["mappers"]["mountPath"], config["mapper_store"]["path"])
        self.assertTrue(mounts["mappers"]["readOnly"])
        pvc = one(docs, "PersistentVolumeClaim", "kvt-mappers")
        self.assertEqual(volumes["mappers"]["persistentVolumeClaim"]["claimName"],
                         pvc["metadata"]["name"])

        # Non-root, read-only root filesystem, no privilege escalation.
        self.assertTrue(spec["securityContext"]["runAsNonRoot"])
        self.assertTrue(container["securityContext"]["readOnlyRootFilesystem"])
        self.assertFalse(container["securityContext"]["allowPrivilegeEscalation"])

        # Backend and GPUs per overlay: gpu takes one from the device plugin; gpu-ipc sees the
        # node's GPUs (those of the inference pods, for CUDA IPC) with a capped device budget.
        # hostIPC + hostPID (with shared memory on) only in gpu-ipc.
        backend = [a for a in container["args"] if a.startswith("--backend=")]
        gpus = resources["limits"].get("nvidia.com/gpu")
        visible = {e["name"]: e.get("value") for e in container.get("env", [])}.get(
            "NVIDIA_VISIBLE_DEVICES")
        cpu = overlay in ("cpu", "prefix-cache")
        self.assertEqual(backend, ["--backend=cpu" if cpu else "--backend=cuda"])
        self.assertEqual(gpus, 1 if overlay == "gpu" else None)
        self.assertEqual(resources["requests"].get("nvidia.com/gpu"), gpus)
        self.assertEqual(visible, "all" if overlay == "gpu-ipc" else None)
        if overlay == "gpu-ipc":
            self.assertGreater(config["mapper_store"]["device_budget_bytes"], 0)
        self.assertEqual(spec.get("hostIPC", False), overlay in SHARED_MEMORY_OVERLAYS)
        self.assertEqual(spec.get("hostPID", False), overlay == "gpu-ipc")
        self.assertEqual(config["shared_memory"]["allow_client_regions"],
                         overlay in SHARED_MEMORY_OVERLAYS)
        self.assertEqual(config["prefix_cache"]["enabled"], overlay == "prefix-cache")
        affinity = spec["affinity"]["podAffinity"]
        preferred = [t["podAffinityTerm"]["labelSelector"]["matchLabels"]
                     for t in affinity.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
        required = [t["labelSelector"]["matchLabels"]
                    for t in affinity.get("requiredDuringSchedulingIgnoredDuringExecution", [])]
        self.assertIn(INFERENCE_LABEL, preferred + required)
        if overlay in SHARED_MEMORY_OVERLAYS:  # shared memory does not cross nodes
            self.assertEqual(required, [INFERENCE_LABEL])

        # Voluntary disruptions take one replica at a time.
        pdb = one(docs, "PodDisruptionBudget", "kvtd")
        self.assertEqual(pdb["spec"]["selector"]["matchLabels"], labels)
        self.assertLess(pdb["spec"].get("maxUnavailable", 0), deployment["spec"]["replicas"])

        # Callers only from the router's namespace; metrics only from monitoring.
        policy = one(docs, "NetworkPolicy", "kvtd")
        self.assertEqual(policy["spec"]["podSelector"]["matchLabels"], labels)
        self.assertEqual(policy["spec"]["policyTypes"], ["Ingress"])
        allowed = {}
        for rule in policy["spec"]["ingress"]:
            self.assertTrue(rule.get("from"), "a rule without 'from' admits everyone")
            for peer in rule["from"]:
                self.assertEqual(list(peer), ["namespaceSelector"], peer)
                namespace = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                for port in rule["ports"]:
                    allowed.setdefault(port["port"], set()).add(namespace)
        callers = {"llm-router", "llm-serving"} if overlay == "prefix-cache" else {"llm-router"}
        self.assertEqual(allowed, {"grpc": callers, "metrics": {"monitoring"}})
        return config

    def test_cpu(self):
        self.check_overlay("cpu")

    def test_gpu(self):
        self.check_overlay("gpu")

    def test_gpu_ipc_differs_from_gpu_in_shared_memory_and_device_budget_only(self):
        ipc = self.check_overlay("gpu-ipc")
        gpu = self.check_overlay("gpu")
        differ = ("shared_memory.allow_client_regions", "mapper_store.device_budget_bytes")
        self.assertEqual({k: v for k, v in flat(ipc).items() if k not in differ},
                         {k: v for k, v in flat(gpu).items() if k not in differ})


    def test_prefix_cache_differs_from_cpu_in_prefix_cache_and_shared_memory_only(self):
        node = self.check_overlay("prefix-cache")
        cpu = self.check_overlay("cpu")
        differ = ("shared_memory.allow_client_regions", "prefix_cache.enabled",
                  "prefix_cache.max_bytes")
        self.assertEqual({k: v for k, v in flat(node).items() if k not in differ},
                         {k: v for k, v in flat(cpu).items() if k not in differ})
        docs = render("deploy/k8s/overlays/prefix-cache")
        # Each engine reaches the kvtd of its own node, and there is one per node.
        self.assertEqual(one(docs, "Service", "kvtd")["spec"]["internalTrafficPolicy"], "Local")
        anti = pod_spec(one(docs, "Deployment", "kvtd"))["affinity"]["podAntiAffinity"]
        (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        self.assertEqual(term["topologyKey"], "kubernetes.io/hostname")
        self.assertEqual(term["labelSelector"]["matchLabels"], {"app.kubernetes.io/name": "kvtd"})


class InferencePodTest(unittest.TestCase):
    """deploy/k8s/inference: vLLM with the KvtConnector, pointed at the prefix-cache kvtd."""

    def setUp(self):
        self.engine = one(render(INFERENCE), "Deployment")
        self.kvtd_docs = render("deploy/k8s/overlays/prefix-cache")
        (self.container,) = pod_spec(self.engine)["containers"]
        (flag,) = [a for a in self.container["args"] if a.startswith("--kv-transfer-config=")]
        self.transfer = json.loads(flag.split("=", 1)[1])

    def test_connector_is_the_projects(self):
        self.assertEqual(self.transfer["kv_connector"], "KvtConnector")
        self.assertEqual(self.transfer["kv_role"], "kv_both")
        module = self.transfer["kv_connector_module_path"]
        self.assertEqual(module, "kvt.vllm")
        package = os.path.join(_workspace_root(), "clients", "python", *module.split("."))
        self.assertTrue(os.path.exists(os.path.join(package, "__init__.py")), package)

    def test_connector_reaches_the_kvtd_on_its_node(self):
        extra = self.transfer["kv_connector_extra_config"]
        service = one(self.kvtd_docs, "Service", "kvtd")
        host, port = extra["kvtd_address"].rsplit(":", 1)
        namespace = service["metadata"]["namespace"]
        self.assertEqual(host, f"{service['metadata']['name']}.{namespace}.svc.cluster.local")
        grpc_port = [p for p in service["spec"]["ports"] if p["name"] == "grpc"][0]["port"]
        self.assertEqual(int(port), grpc_port)
        # The engine's namespace is one kvtd's NetworkPolicy admits on gRPC.
        policy = one(self.kvtd_docs, "NetworkPolicy", "kvtd")
        admitted = {peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                    for rule in policy["spec"]["ingress"] for peer in rule["from"]
                    if any(p["port"] == "grpc" for p in rule["ports"])}
        self.assertIn(self.engine["metadata"]["namespace"], admitted)
        # The model name mappers use is the name the engine serves.
        served = [a for a in self.container["args"] if a.startswith("--served-model-name=")]
        self.assertEqual(served, ["--served-model-name=" + extra["model_name"]])

    def test_engine_shares_memory_and_is_scheduled_beside_kvtd(self):
        spec = pod_spec(self.engine)
        self.assertTrue(spec["hostIPC"])
        labels = self.engine["spec"]["template"]["metadata"]["labels"]
        self.assertEqual({k: labels[k] for k in INFERENCE_LABEL}, INFERENCE_LABEL)
        mounts = [m["mountPath"] for m in self.container.get("volumeMounts", [])]
        self.assertNotIn("/dev/shm", mounts)  # the node's /dev/shm, seen by kvtd

    def test_dockerfile_paths_exist(self):
        text = read("deploy", "docker", "Dockerfile.vllm")
        lines = [l.strip() for l in re.sub(r"\\\n", " ", text).splitlines()
                 if l.strip() and not l.strip().startswith("#")]
        repo = _workspace_root()
        for line in lines:
            if line.startswith("COPY "):
                for source in line.split()[1:-1]:
                    self.assertTrue(os.path.exists(os.path.join(repo, source)), source)
        self.assertIn("clients/python/gen_protos.py", " ".join(lines))
        self.assertEqual(self.container["image"].split(":")[0].rsplit("/", 1)[-1], "kvt-vllm")
        self.assertIn('ENTRYPOINT ["/opt/venv/bin/vllm"]', lines)
        self.assertEqual(self.container["args"][0], "serve")


class FitJobTest(unittest.TestCase):
    def test_indexed_job_runs_the_shard_script(self):
        docs = render("deploy/k8s/fit")
        job = one(docs, "Job", "kvt-fit")
        spec = pod_spec(job)
        (container,) = spec["containers"]
        env = {e["name"]: e for e in container["env"]}
        self.assertEqual(job["spec"]["completionMode"], "Indexed")
        shards = int(env["KVT_FIT_SHARDS"]["value"])
        # Shards wait for each other: all must run at once.
        self.assertEqual(job["spec"]["completions"], shards)
        self.assertEqual(job["spec"]["parallelism"], shards)
        self.assertIn(spec["restartPolicy"], ("OnFailure", "Never"))

        # The script comes from the generated ConfigMap, byte for byte.
        script_map = one(docs, "ConfigMap", "kvt-fit-script")
        script = read("deploy", "k8s", "fit", "fit-shard.sh")
        self.assertEqual(script_map["data"], {"fit-shard.sh": script})
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        (script_volume,) = [n for n, v in volumes.items()
                            if v.get("configMap", {}).get("name") == script_map["metadata"]["name"]]
        self.assertEqual(container["command"],
                         ["/bin/sh", os.path.join(mounts[script_volume]["mountPath"],
                                                  "fit-shard.sh")])

        # Every variable the Job sets is one the script reads, and the required ones are set.
        read_by_script = set(re.findall(r"\$\{(KVT_[A-Z_]+)", script))
        self.assertLessEqual(set(env), read_by_script)
        self.assertLessEqual({"KVT_FIT_SHARDS", "KVT_FIT_OUT", "KVT_FIT_WORK", "KVT_FIT_FLAGS"},
                             set(env))
        self.assertEqual(env["KVT_FIT_RUN"]["valueFrom"]["fieldRef"]["fieldPath"],
                         "metadata.labels['batch.kubernetes.io/controller-uid']")

        # The flags are real `kvt` flags; the script adds the per-shard ones itself.
        helpfull = subprocess.run([path("cli", "kvt"), "--helpfull"], capture_output=True,
                                  text=True).stdout
        for variable in ("KVT_FIT_FLAGS", "KVT_FIT_MERGE_FLAGS"):
            for flag in shlex.split(env[variable]["value"]):
                name = flag[2:].split("=", 1)[0]
                self.assertTrue(f"-{name} (" in helpfull, f"{variable}: unknown kvt flag {flag}")
                self.assertNotIn(name, ("out", "shard", "partial", "plan"), variable)

        # The mapper lands in the store volume kvtd reads (the base's PVC).
        self.assertEqual(volumes["mappers"]["persistentVolumeClaim"]["claimName"], "kvt-mappers")
        out = env["KVT_FIT_OUT"]["value"]
        self.assertEqual(os.path.dirname(out), mounts["mappers"]["mountPath"])
        self.assertFalse(mounts["mappers"].get("readOnly", False))
        self.assertTrue(env["KVT_FIT_WORK"]["value"].startswith(mounts["fit"]["mountPath"] + "/"))


def cluster_option_keys():
    """The keys kv_connector_extra_config.cluster accepts: ClusterOptions' fields, read from
    clients/python/kvt/vllm/options.py without importing it (kvt.vllm imports vllm)."""
    import ast
    with open(os.path.join(_workspace_root(), "clients", "python", "kvt", "vllm",
                           "options.py")) as f:
        tree = ast.parse(f.read())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ClusterOptions"]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


class ClusterTierTest(unittest.TestCase):
    """deploy/k8s/overlays/cluster-tier: prefix-cache plus a Mooncake master and segment
    holders; ./inference: the engine with the connector's cluster section pointed at them."""

    def setUp(self):
        self.docs = render(CLUSTER_TIER)
        self.engine = one(render(CLUSTER_INFERENCE), "Deployment")
        (self.container,) = pod_spec(self.engine)["containers"]
        (flag,) = [a for a in self.container["args"] if a.startswith("--kv-transfer-config=")]
        self.extra = json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"]
        self.cluster = self.extra["cluster"]
        self.master = one(self.docs, "Service", "mooncake-master")

    def service_address(self, port_name):
        meta = self.master["metadata"]
        (port,) = [p["port"] for p in self.master["spec"]["ports"] if p["name"] == port_name]
        return f"{meta['name']}.{meta['namespace']}.svc.cluster.local:{port}"

    def test_kvtd_is_the_prefix_cache_overlays(self):
        mine = [d for d in self.docs
                if d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") != "mooncake"]
        self.assertEqual(mine, render("deploy/k8s/overlays/prefix-cache"))

    def test_engine_points_at_the_master(self):
        self.assertEqual(set(self.cluster) - cluster_option_keys(), set())
        self.assertEqual(self.cluster["master_server_address"], self.service_address("rpc"))
        self.assertEqual(self.cluster["metadata_server"],
                         f"http://{self.service_address('metadata')}/metadata")
        # The engine advertises its pod IP to the transfer engines of the other nodes.
        env = {e["name"]: e for e in self.container["env"]}
        self.assertEqual(env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP")
        self.assertEqual(env["MC_TCP_BIND_ADDRESS"]["value"], "$(POD_IP)")
        # Everything else is the plain inference pod's.
        plain = one(render(INFERENCE), "Deployment")
        (plain_flag,) = [a for a in pod_spec(plain)["containers"][0]["args"]
                         if a.startswith("--kv-transfer-config=")]
        plain_extra = json.loads(plain_flag.split("=", 1)[1])["kv_connector_extra_config"]
        self.assertEqual({k: v for k, v in self.extra.items() if k != "cluster"}, plain_extra)

    def test_master_and_segments_agree(self):
        master = pod_spec(one(self.docs, "Deployment", "mooncake-master"))["containers"][0]
        ports = container_ports(master)
        args = dict(a[2:].split("=", 1) for a in master["args"])
        self.assertEqual(int(args["rpc_port"]), ports["rpc"])
        self.assertEqual(int(args["http_metadata_server_port"]), ports["metadata"])
        self.assertEqual(int(args["metrics_port"]), ports["metrics"])
        self.assertEqual(args["enable_http_metadata_server"], "true")
        self.assertEqual({p["name"]: p["targetPort"] for p in self.master["spec"]["ports"]},
                         {"rpc": "rpc", "metadata": "metadata", "metrics": "metrics"})
        segment = one(self.docs, "Deployment", "mooncake-segment")
        (holder,) = pod_spec(segment)["containers"]
        args = dict(a[2:].split("=", 1) for a in holder["args"])
        self.assertEqual(args["master_server_address"], self.cluster["master_server_address"])
        self.assertEqual(args["metadata_server"], self.cluster["metadata_server"])
        self.assertEqual(args["protocol"], self.cluster["protocol"])
        # The pod's memory covers the segment.
        limit = bytes_of(holder["resources"]["limits"]["memory"])
        self.assertGreater(limit, int(args["global_segment_size"]))
        self.assertEqual(holder["resources"]["requests"]["memory"],
                         holder["resources"]["limits"]["memory"])
        # The binaries are the wheel's, in the engine image's venv (Python of debian:12).
        text = read("deploy", "docker", "Dockerfile.vllm")
        self.assertIn("FROM debian:12", text)
        for lib in ("libibverbs1", "libnl-3-200", "libnl-route-3-200"):
            self.assertIn(lib, text)
        for container in (master, holder):
            self.assertEqual(container["image"].rsplit("/", 1)[-1].split(":")[0], "kvt-vllm")
            self.assertRegex(container["command"][0],
                             r"^/opt/venv/lib/python3\.11/site-packages/mooncake/mooncake_")

    def test_only_the_engines_reach_the_store(self):
        policy = one(self.docs, "NetworkPolicy", "mooncake")
        self.assertEqual(policy["spec"]["podSelector"]["matchLabels"],
                         {"app.kubernetes.io/part-of": "mooncake"})
        namespaces = {peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                      for rule in policy["spec"]["ingress"] for peer in rule["from"]
                      if "namespaceSelector" in peer and "ports" not in rule}
        self.assertEqual(namespaces, {self.engine["metadata"]["namespace"]})
        for name in ("mooncake-master", "mooncake-segment"):
            labels = one(self.docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
            self.assertEqual(labels["app.kubernetes.io/part-of"], "mooncake")


class DockerfileTest(unittest.TestCase):
    def setUp(self):
        text = read("deploy", "docker", "Dockerfile")
        # Join continuation lines, drop comments.
        self.lines = [l.strip() for l in re.sub(r"\\\n", " ", text).splitlines()
                      if l.strip() and not l.strip().startswith("#")]

    def test_paths_and_targets_exist(self):
        repo = _workspace_root()
        copies = [l.split()[1:] for l in self.lines if l.startswith("COPY ")]
        local_sources = [args[0] for args in copies if not args[0].startswith("--from")]
        self.assertIn(".", local_sources)  # the build stage gets the whole tree
        for source in local_sources:
            self.assertTrue(os.path.exists(os.path.join(repo, source)), source)
        runs = " ".join(l for l in self.lines if l.startswith("RUN "))
        for script in re.findall(r"bash (\S+\.sh)", runs):
            self.assertTrue(os.path.exists(os.path.join(repo, script)), script)
        targets = re.findall(r"bazel build ((?://\S+ ?)+)", runs)
        self.assertEqual(len(targets), 1)
        targets = targets[0].split()
        self.assertEqual(sorted(targets), ["//cli:kvt", "//loadtest:kvt-load", "//server:kvtd"])
        for target in targets:
            package, name = target[2:].split(":")
            # Built by this test's data dependencies: the target exists and builds.
            self.assertTrue(os.access(path(package, name), os.X_OK), target)
            self.assertIn(f"bazel-bin/{package}/{name}", runs)
        # The binaries copied into the image are the ones built; the entrypoint is one of them.
        self.assertIn("COPY --from=build /out/bin/ /usr/local/bin/", self.lines)
        self.assertIn('ENTRYPOINT ["kvtd"]', self.lines)
        # Nothing the build needs is excluded from the build context.
        ignored = [l.strip() for l in read("deploy", "docker", "Dockerfile.dockerignore").splitlines()
                   if l.strip() and not l.startswith("#")]
        for needed in ("scripts", "server", "WORKSPACE", ".bazelrc", "third_party"):
            self.assertFalse(any(re.fullmatch(p.replace("*", ".*"), needed) for p in ignored),
                             needed)

    def test_base_images_are_one_cuda_13_release(self):
        froms = [l.split()[1] for l in self.lines if l.startswith("FROM ")]
        self.assertEqual(froms, ["nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04", "debian:12",
                                 "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04"])
        (version,) = [l for l in self.lines if l.startswith("ARG CUDA_VERSION=")]
        self.assertRegex(version, r"=13\.0\.\d+$")

    def test_health_check_uses_the_cli_against_kvtds_port(self):
        (check,) = [l for l in self.lines if l.startswith("HEALTHCHECK ")]
        command = json.loads(check.split(" CMD ", 1)[1])
        self.assertEqual(command[:2], ["kvt", "health"])
        usage = subprocess.run([path("cli", "kvt"), "help"], capture_output=True, text=True)
        self.assertRegex(usage.stdout, r"\n  health ")
        default_config = kvtd_config(read("server", "kvtd.yaml"))
        server = [a for a in command if a.startswith("--server=")]
        grpc_port = port_of(default_config["server"]["listen_address"])
        self.assertEqual(server, [f"--server=127.0.0.1:{grpc_port}"])
        self.assertIn('CMD ["--config=/etc/kvt/kvtd.yaml"]', self.lines)
        self.assertIn("COPY server/kvtd.yaml /etc/kvt/kvtd.yaml", self.lines)
        self.assertRegex(" ".join(self.lines), r"USER 10001:10001")


if __name__ == "__main__":
    unittest.main(verbosity=2)
