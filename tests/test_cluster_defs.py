"""The cluster definitions stay usable: every YAML parses, the AWS launcher config passes Ray's own schema, the
KubeRay manifests pass (a trimmed copy of) KubeRay's CRD schema, and the job configs load (their memory headers are
raysft plan's figures: tests/test_config_headers.py); the cluster scripts refuse a bad option by name before doing
anything. (cluster/local.sh runs for real in tests/test_job_submit.py: a 2-node cluster with token auth that takes
jobs, and whose stop ends only what it started.)"""

import copy
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from raysft.config import load_config

REPO = Path(__file__).resolve().parent.parent
CLUSTER = REPO / "cluster"
CONFIGS = REPO / "jobs" / "configs"
LOCAL_SH = CLUSTER / "local.sh"
YAMLS = sorted([*CLUSTER.glob("*.yaml"), *CONFIGS.glob("*.yaml")])


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_every_yaml_parses(path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs and all(isinstance(d, dict) for d in docs), f"{path}: every document must be a mapping"


# --- AWS: Ray's cluster launcher -----------------------------------------------------------------------------


def aws_config() -> dict:
    return yaml.safe_load((CLUSTER / "aws-gpu.yaml").read_text())


def validate_like_ray_up(config: dict) -> None:
    """What `ray up` does before launching anything: merge the provider's defaults, check ray-schema.json."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


def test_aws_config_passes_rays_schema():
    validate_like_ray_up(aws_config())


@pytest.mark.parametrize("where", ["top level", "GPU node type", "auth"])
def test_rays_schema_check_rejects_an_unknown_field(where):
    config = aws_config()
    {"top level": config, "GPU node type": config["available_node_types"]["ray.worker.gpu"],
     "auth": config["auth"]}[where]["bogus_field"] = 1
    with pytest.raises(jsonschema.ValidationError, match="bogus_field"):
        validate_like_ray_up(config)


def test_aws_cluster_has_token_auth_and_no_public_dashboard():
    c = aws_config()
    head, workers = " ".join(c["head_start_ray_commands"]), " ".join(c["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token ray start --head" in head
    assert "RAY_AUTH_MODE=token ray start --address" in workers
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert c["file_mounts"]["/home/ubuntu/.ray/auth_token"] == "~/.ray/auth_token"
    assert c["available_node_types"][c["head_node_type"]]["resources"] == {"CPU": 0}
    ssh_rules = c["provider"]["security_group"]["IpPermissions"]
    assert [(r["FromPort"], r["ToPort"]) for r in ssh_rules] == [(22, 22)]  # nothing but SSH from outside
    assert all(ip["CidrIp"] != "0.0.0.0/0" for r in ssh_rules for ip in r["IpRanges"])


# --- KubeRay: RayJob / RayCluster against the CRD's openAPIV3Schema ----------------------------------------------


def crd_schemas() -> dict[str, dict]:
    subset = yaml.safe_load((REPO / "tests" / "data" / "kuberay_crd_subset.yaml").read_text())
    schemas = {kind: {**subset[key], "$defs": subset["$defs"]} for kind, key in
               (("RayJob", "rayjob"), ("RayCluster", "raycluster"))}
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    return schemas


def kuberay_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted(CLUSTER.glob("kuberay-*.yaml")) for d in yaml.safe_load_all(p.read_text())]


def validate_crd(doc: dict) -> None:
    jsonschema.validate(doc, crd_schemas()[doc["kind"]], cls=jsonschema.Draft202012Validator)


def the(kind: str) -> dict:
    (doc,) = [d for _, d in kuberay_docs() if d["kind"] == kind]
    return copy.deepcopy(doc)


def test_kuberay_manifests_pass_the_crd_schema():
    kinds = set()
    for name, doc in kuberay_docs():
        if doc["apiVersion"] == "ray.io/v1":
            validate_crd(doc)
            kinds.add(doc["kind"])
        else:  # the objects a RayJob needs beside it: nothing else may slip in unchecked
            assert (doc["apiVersion"], doc["kind"]) in {("v1", "PersistentVolumeClaim"), ("v1", "ServiceAccount")}, name
    assert kinds == {"RayJob", "RayCluster"}


@pytest.mark.parametrize("path", [
    ("spec",),
    ("spec", "rayClusterSpec"),
    ("spec", "rayClusterSpec", "headGroupSpec"),
    ("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers", 0),
    ("spec", "rayClusterSpec", "workerGroupSpecs", 0),
    ("spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "spec", "volumes", 0),
], ids=lambda p: ".".join(map(str, p)))
def test_crd_schema_rejects_an_unknown_field(path):
    rayjob = the("RayJob")
    node = rayjob
    for key in path:
        node = node[key]
    node["bogusField"] = 1
    with pytest.raises(jsonschema.ValidationError, match="bogusField"):
        validate_crd(rayjob)


def test_crd_schema_rejects_wrong_types_enums_and_missing_required_fields():
    for change in (lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas="two"),
                   lambda j: j["spec"]["rayClusterSpec"]["authOptions"].update(mode="password"),
                   lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"),
                   lambda j: j["spec"].update(shutdownAfterJobFinishes="yes")):
        rayjob = the("RayJob")
        change(rayjob)
        with pytest.raises(jsonschema.ValidationError):
            validate_crd(rayjob)


def test_rayjob_runs_the_8b_config_on_as_many_gpus_as_it_has_workers():
    spec = the("RayJob")["spec"]
    assert spec["entrypoint"] == "python jobs/sft.py jobs/configs/llama3-8b-2x8-hsdp.yaml"
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    config = load_config(REPO / spec["entrypoint"].split()[-1])
    (group,) = cluster["workerGroupSpecs"]
    gpus = group["replicas"] * int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == config.scaling.num_workers and config.scaling.use_gpu


@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_kuberay_cluster_has_token_auth_and_no_public_dashboard(kind):
    doc = the(kind)
    cluster = doc["spec"]["rayClusterSpec"] if kind == "RayJob" else doc["spec"]
    assert cluster["authOptions"] == {"mode": "token"}
    major, minor, _ = map(int, cluster["rayVersion"].split("."))
    assert (major, minor) >= (2, 52)  # KubeRay refuses token auth below Ray 2.52
    head = cluster["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and not head.get("enableIngress", False)


# --- jobs/configs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_job_config_loads(path):
    load_config(path)


def test_llama3_8b_config_is_hsdp_on_2x8_gpus():
    c = load_config(CONFIGS / "llama3-8b-2x8-hsdp.yaml")
    assert (c.scaling.num_workers, c.scaling.use_gpu) == (16, True)
    assert (c.parallel.sharding, c.parallel.hsdp_shard_size) == ("HYBRID_SHARD", 8)
    assert (c.parallel.mixed_precision, c.parallel.activation_checkpointing) == ("bf16", "full")
    assert (c.checkpoint.mode, c.checkpoint.async_save) == ("sharded", True)
    assert c.run.storage_path.startswith("s3://") and c.data.max_seq_len == 4096
    assert c.model.path == "/mnt/shared/models/Meta-Llama-3.1-8B-Instruct"


def test_llama3_70b_config_is_full_shard_on_4x8_gpus():
    c = load_config(CONFIGS / "llama3-70b-4x8.yaml")
    assert (c.scaling.num_workers, c.scaling.use_gpu, c.parallel.sharding) == (32, True, "FULL_SHARD")
    assert (c.parallel.mixed_precision, c.parallel.activation_checkpointing) == ("bf16", "full")
    assert (c.checkpoint.mode, c.checkpoint.async_save) == ("sharded", True)
    assert c.run.storage_path.startswith("s3://")


# --- cluster/*.sh: usage errors ---------------------------------------------------------------------------------

BAD_SCRIPT_ARGS = [
    ("netns.sh", "up 2 --rate", {}, "--rate needs a value"),
    ("netns.sh", "up 2 --rate --cpus 2", {}, "--rate needs a value"),
    ("netns.sh", "up 2 --cpus", {}, "--cpus needs a value"),
    ("netns.sh", "up 2 --cpus two", {}, "--cpus must be a positive integer, got 'two'"),
    ("netns.sh", "up 2 --rate fast", {}, "--rate must be a rate in tc's units (e.g. 1gbit, 100mbit), got 'fast'"),
    ("netns.sh", "up two", {}, "up: N (the number of nodes) must be a positive integer, got 'two'"),
    ("netns.sh", "up 2 --bogus", {}, "up: unknown option '--bogus'"),
    ("netns.sh", "up 2", {"RAYSFT_NETNS_OBJECT_STORE_MB": "lots"},
     "RAYSFT_NETNS_OBJECT_STORE_MB must be a positive integer (MB), got 'lots'"),
    ("netns.sh", "join", {}, "join: I must be a worker node's index (1 or more), got ''"),
    ("netns.sh", "join 1 2", {}, "join: unexpected argument '2'"),
    ("netns.sh", "exec 0", {}, "exec: no command to run in node 0"),
    ("netns.sh", "down Bad!", {}, "down: TAG must be 1-12 of [a-z0-9], got 'Bad!'"),
    ("netns.sh", "status now", {}, "status: unexpected argument 'now'"),
    ("netns.sh", "", {}, "unknown command ''"),
    ("local.sh", "start x", {}, "WORKER_NODES must be a whole number, got 'x'"),
    ("local.sh", "start 1 2", {}, "start: unexpected argument '2'"),
    ("local.sh", "start", {"RAYSFT_LOCAL_OBJECT_STORE_MB": "512MB"},
     "RAYSFT_LOCAL_OBJECT_STORE_MB must be a whole number, got '512MB'"),
    ("local.sh", "start", {"RAYSFT_LOCAL_PORT": "http"}, "RAYSFT_LOCAL_PORT must be a whole number, got 'http'"),
    ("local.sh", "stop now", {}, "stop: unexpected argument 'now'"),
    ("local.sh", "status x", {}, "status: unexpected argument 'x'"),
    ("local.sh", "restart", {}, "unknown command 'restart'"),
]


@pytest.mark.parametrize(("script", "args", "env", "message"), BAD_SCRIPT_ARGS,
                         ids=[f"{s} {a}" + (f" {next(iter(e))}" if e else "") for s, a, e, _ in BAD_SCRIPT_ARGS])
def test_a_bad_script_option_is_a_usage_error_naming_it_before_anything_is_made(tmp_path, script, args, env, message):
    """Each script parses every argument and numeric setting before it acts: a missing or malformed value is exit 2
    with the option's name and the usage, not bash's `$2: unbound variable` or an arithmetic error, and nothing is
    made (no state directory, no namespace: RAY names no executable, the first thing checked after parsing)."""
    state = tmp_path / "state"
    run_env = {**os.environ, "RAYSFT_NETNS_DIR": str(state), "RAYSFT_LOCAL_DIR": str(state),
               "RAY": str(tmp_path / "no-ray"), **env}
    out = subprocess.run(["bash", str(CLUSTER / script), *args.split()], env=run_env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert f"{script}: {message}\nusage: " in out.stderr, out.stderr
    assert not state.exists()


# --- KubeRay GPU pods: room for what the configs they run need on a node --------------------------------------

# The configs each manifest's GPU pods run: the RayJob's entrypoint; the RayCluster takes either multi-node config
RUNS_ON = {"RayJob": ["llama3-8b-2x8-hsdp.yaml"], "RayCluster": ["llama3-8b-2x8-hsdp.yaml", "llama3-70b-4x8.yaml"]}
WORKER_PROCESS_GIB = 8  # a worker process itself (torch, CUDA, the data loader), which plan does not count


def gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(Gi|Ti)", quantity).groups()
    return float(number) * {"Gi": 1, "Ti": 1024}[unit]


def node_needs(config: str, workers_per_node: int) -> tuple[float, float]:
    """(host memory, /dev/shm) of one node, in GiB, from the config's header (raysft plan's figures, checked by
    tests/test_config_headers.py): the memory tier's total and its /dev/shm part, each worker's async save staging,
    the worker processes."""
    from test_config_headers import plan_block, quoted_figures

    figures = quoted_figures(plan_block(CONFIGS / config)[1])
    host = float(figures["tier total"]) + workers_per_node * (float(figures["saving rank's host"]) + WORKER_PROCESS_GIB)
    return host, float(figures["tier in /dev/shm"])


@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_kuberay_gpu_pods_have_the_host_memory_and_dev_shm_the_memory_tier_needs(kind):
    """The memory tier keeps its snapshots in /dev/shm: a pod's default is 64 MiB, so the GPU pods mount an emptyDir
    of medium Memory there, whose pages count against the container's memory limit. Both must hold what the
    configs the pods run need on a node, as their headers give it."""
    doc = the(kind)
    cluster = doc["spec"]["rayClusterSpec"] if kind == "RayJob" else doc["spec"]
    (group,) = cluster["workerGroupSpecs"]
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts, f"{kind}: no volume at /dev/shm: the memory tier would have 64 MiB"
    (shm,) = [v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"]]
    assert shm["emptyDir"].get("medium") == "Memory", f"{kind}: /dev/shm is not memory-backed"
    limit = gib(container["resources"]["limits"]["memory"])
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    for config in RUNS_ON[kind]:
        host, in_shm = node_needs(config, gpus)
        assert host <= limit, f"{kind}: {config} needs {host:.0f} GiB of host memory per pod, the limit is {limit:.0f}"
        assert in_shm <= gib(shm["emptyDir"]["sizeLimit"]), \
            f"{kind}: {config} keeps {in_shm:.0f} GiB in /dev/shm, more than its sizeLimit"
