"""Many nodes on one host: a Ray cluster of 2 network namespaces, an IP each (conftest.netns_cluster,
cluster/netns.sh), so that Ray numbers them node 0 and node 1 as on a real cluster."""

import json
import os
import time
from pathlib import Path

import pytest
import ray
import ray.train
import test_strategies
import torch
import torch.distributed as dist
import yaml
from conftest import REPO, assert_close_but_for_rare_elements, run_workers, running, tiny_config
from safetensors.torch import load_file, save_file
from test_faults_cluster import (
    config,
    final_losses,
    last_step,
    recovery,
    reference,  # noqa: F401 - the fixture: uninterrupted runs on gloo processes
    wait_for,
)
from test_job_submit import ANSI, RAY, git_ignored
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

import raysft
from raysft.checkpoint import DirectorySink
from raysft.config import ConfigError, config_from_dict
from raysft.data import prepare_store
from raysft.data.tokenizer import load_tokenizer
from raysft.launch.ray_worker import ray_worker_context
from raysft.training.metrics import read_metrics
from raysft.training.trainer import Trainer

pytestmark = pytest.mark.slow  # starts Ray: not in make test-fast

SERVER = """
import socket, sys
with socket.create_server((sys.argv[1], 0)) as s:
    print(s.getsockname()[1], flush=True)
    conn, peer = s.accept()
    with conn:
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
        print(peer[0], len(got), flush=True)
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as c:
    c.sendall(b"x" * (1 << 20))
"""


def test_nodes_reach_each_other_over_their_private_network_and_nothing_else(netns_cluster):
    c = netns_cluster
    server = c.popen(1, "python3", "-c", SERVER, c.ip(1), stdout=-1, text=True)
    try:
        port = server.stdout.readline().strip()
        sent = c.run(0, "python3", "-c", CLIENT, c.ip(1), port, timeout=60)
        assert sent.returncode == 0, sent.stderr
        assert server.stdout.readline().split() == [c.ip(0), str(1 << 20)]  # from node 0's address, every byte
    finally:
        server.kill()
        server.wait()
    for node in range(c.nodes):
        # a node has its loopback and its one link, and a route to the cluster's /24 only: no way out of it
        links = c.run(node, "ip", "-o", "link").stdout
        assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == ["lo", "eth0"]
        assert c.run(node, "ip", "route").stdout.split() == \
            ["10.213.0.0/24", "dev", "eth0", "proto", "kernel", "scope", "link", "src", c.ip(node)]


FAULT_STEPS, EVERY = 8, 4  # the fault run: a full checkpoint every 4 steps, the memory tier every step
HSDP_SETS = {"parallel.sharding": "HYBRID_SHARD", "scaling.num_workers": 4, "train.max_steps": test_strategies.STEPS,
             "train.global_batch_size": 16, "train.micro_batch_size": 2}


def _train_and_record(loop: dict) -> None:
    """A Ray train worker: train, then record where it ran and its place in the mesh; rank 0 saves the weights."""
    ctx = ray_worker_context()
    cfg = config_from_dict(loop["config"])
    trainer = Trainer(cfg, Path(loop["store"]), None, DirectorySink(cfg.run_dir, ctx.rank), ctx)
    trainer.train()
    out = Path(loop["out"])
    weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.rank == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, out / "weights.safetensors")
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({
        "ip": ray.util.get_node_ip_address(), "node_rank": ctx.node_rank,
        "local_rank": ray.train.get_context().get_local_rank(),
        "mesh": [list(trainer.mesh.shape), list(trainer.mesh.mesh_dim_names)],
        "coordinate": trainer.mesh.get_coordinate(),
        "placements": sorted({repr(p.placements) for p in trainer.model.parameters() if isinstance(p, DTensor)})}))
    dist.barrier()


def drive_hybrid_shard(out: str) -> None:
    """The driver, inside node 0's namespace: raysft's driver refuses a shard group that straddles the nodes, then
    4 workers train HYBRID_SHARD with the mesh taken from Ray's node ranks (hsdp_shard_size 0)."""
    out_dir = Path(out)
    loop = json.loads((out_dir / "loop.json").read_text())
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})  # the workers import this module
    try:
        raysft.train(config_from_dict(loop["straddling"]))
    except ConfigError as e:
        (out_dir / "refused.txt").write_text(str(e))
    run_workers(_train_and_record, loop, out_dir, num_workers=4)


def test_hybrid_shard_on_two_nodes_replicates_across_and_shards_within_them(netns_cluster, tmp_path):
    cfg = tiny_config(tmp_path, **HSDP_SETS)
    store = prepare_store(cfg.data, load_tokenizer(cfg.model, cfg.data.chat_template), cfg.store_dir).path
    # 6 workers of half a CPU: Ray packs 4 on one node, 2 on the other; groups of 3 would span the link
    straddling = tiny_config(tmp_path, **{**HSDP_SETS, "scaling.num_workers": 6, "scaling.cpus_per_worker": 0.5,
                                          "parallel.hsdp_shard_size": 3, "train.global_batch_size": 12,
                                          "run.name": "straddling"})
    (tmp_path / "loop.json").write_text(json.dumps({"config": cfg.to_dict(), "store": str(store), "out": str(tmp_path),
                                                    "straddling": straddling.to_dict()}))
    drive = "import sys, test_multinode; test_multinode.drive_hybrid_shard(sys.argv[1])"
    driver = netns_cluster.python(0, "-c", drive, str(tmp_path))
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]

    refused = (tmp_path / "refused.txt").read_text()
    assert "'parallel.hsdp_shard_size'" in refused and "straddle nodes that hold 4, 4 workers" in refused, refused
    assert not list((tmp_path / "runs").glob("straddling/checkpoint_*"))  # refused before any worker started

    info = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    # two nodes by address, each node's workers on consecutive ranks, numbered by Ray from its topology
    assert [i["ip"] for i in info] in ([netns_cluster.ip(0)] * 2 + [netns_cluster.ip(1)] * 2,
                                       [netns_cluster.ip(1)] * 2 + [netns_cluster.ip(0)] * 2), info
    assert [i["node_rank"] for i in info] == [0, 0, 1, 1]
    assert [i["local_rank"] for i in info] == [0, 1, 0, 1]
    # replicate dim across the nodes (coordinate 0 = node rank), shard dim within one (coordinate 1 = local rank)
    assert all(i["mesh"] == [[2, 2], ["replicate", "shard"]] for i in info)
    assert [i["coordinate"] for i in info] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert all(i["placements"] == [repr((Replicate(), Shard(0)))] for i in info), info[0]["placements"]

    ref_losses, ref_weights = test_strategies.reference(cfg, store)  # one process, no FSDP
    losses = [m["loss"] for m in read_metrics(cfg.run_dir) if "loss" in m]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    weights = load_file(tmp_path / "weights.safetensors")
    assert weights.keys() == ref_weights.keys()
    for key, value in weights.items():  # as tests/test_strategies.py holds every layout to the same reference
        assert_close_but_for_rare_elements(value, ref_weights[key], rtol=1e-4, atol=1e-5,
                                           bound=cfg.train.max_steps * cfg.train.lr, what=key)


def test_a_node_killed_and_a_link_cut_resume_from_the_memory_tier_on_a_replacement(
        netns_cluster, tmp_path, reference):  # noqa: F811 - the fixture imported above
    """Two faults in one HYBRID_SHARD run over both nodes with the memory tier every step, submitted as a Ray job
    (`ray job submit` to the head's job API, `python jobs/sft.py CONFIG` from the uploaded working dir; its driver
    runs on the head, which the faults never touch): every process of node 1 killed; later node 1's link cut
    mid-step, until Ray declares the node dead, then restored (its raylet, told it is dead, ends itself). After
    each, a replacement node joins with no snapshot of its own; its workers get their parts from the replicas'
    snapshots on node 0, and the run goes on from the step before the fault (not the last stored checkpoint), bit
    for bit the uninterrupted run; the job succeeds, its workers ran on both nodes, its checkpoints are in the
    run directory every node sees, and no snapshot is left on any node. The faults come where the stored tier
    would lose more: node 1 killed before the first stored checkpoint, its link cut 2 steps after one."""
    c = netns_cluster
    hsdp = {"parallel.sharding": "HYBRID_SHARD", "train.micro_batch_size": 2, "scaling.num_workers": 4,
            "train.max_steps": FAULT_STEPS, "checkpoint.every_n_steps": EVERY}
    ref = reference(4, **hsdp, **{"parallel.hsdp_shard_size": 2})  # gloo processes on one host: explicit groups
    shm = tmp_path / "shm"  # each node's snapshots apart by its Ray node id (the namespaces share the host's files)
    cfg = config(tmp_path, "netns", **hsdp, **{"checkpoint.memory_every_n_steps": 1,  # groups from Ray's node ranks
                                               "checkpoint.memory_dir": str(shm)})
    config_file = tmp_path / "netns.yaml"
    config_file.write_text(yaml.safe_dump(cfg.to_dict()))
    # the job's driver and workers get the suite's Ray Train and lease settings from the job's runtime env
    settings = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAYSFT_LEASE_SETTLE_S")
    runtime_env = {"excludes": [f"/{path}" for path in git_ignored()],
                   "env_vars": {k: os.environ[k] for k in settings}}
    submission_id = f"netns-{tmp_path.name}"
    log = (tmp_path / "job.log").open("w")
    started = time.time()
    job = c.popen(0, str(RAY), "job", "submit", "--address", f"http://{c.ip(0)}:8265", "--submission-id",
                  submission_id, "--working-dir", str(REPO), "--runtime-env-json", json.dumps(runtime_env), "--",
                  "python", "jobs/sft.py", str(config_file), stdout=log, stderr=log)
    try:
        wait_for(lambda: last_step(cfg.run_dir) >= 3, 300, "step 3")  # before the first stored checkpoint
        killed = c.kill_node(1)
        assert killed
        kill_time = time.time()
        c.wait_node(1, alive=False)
        c.join(1)

        wait_for(lambda: sum(m.get("event") == "resume" for m in read_metrics(cfg.run_dir)) == 1 and
                 last_step(cfg.run_dir) >= EVERY + 2, 300, f"step {EVERY + 2} after the first resume")
        raylets = [p for p in c.pids(1) if Path(f"/proc/{p}/comm").read_text().strip() == "raylet"]
        c.set_link(1, up=False)
        cut_time = time.time()
        c.wait_node(1, alive=False)
        c.set_link(1, up=True)
        # back on the network, the raylet learns from the GCS that its node was declared dead, and ends itself
        wait_for(lambda: not any(running(p) for p in raylets), 120, "node 1's raylet to end once back")
        c.kill_node(1)  # what it leaves behind (its log monitor), by PID
        c.join(1)
        assert job.wait(timeout=600) == 0, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        log.close()
    assert f"Job '{submission_id}' succeeded" in ANSI.sub("", (tmp_path / "job.log").read_text())
    # the job's workers, on each node: 2 on node 0 for each of the 3 worker groups; 2 on node 1 for each group
    # (its first Ray node, killed; the first replacement, cut off; the second replacement, to the end)
    assert all(len(c.actor_logs(node, "RayTrainWorker", started)) >= 6 for node in (0, 1))
    assert len(raylets) == 1  # the replacement's, when the link went down
    killed_row = recovery(cfg.run_dir, kill_time, "node's processes killed (network namespaces, memory tier)",
                          "SIGKILL to every process in node 1's namespace; a replacement node joins", 1)
    cut_row = recovery(cfg.run_dir, cut_time, "node's link cut mid-step (network namespaces, memory tier)",
                       "`ip link set eth0 down` on node 1 until Ray declares it dead, then up; a replacement joins", 1)
    for row in (killed_row, cut_row):  # the snapshot of the step before the fault, or of the one before it
        assert 0 <= row["steps_lost"] <= 2, row
    resumes = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "resume"]
    assert [(m["world_size"], m.get("tier")) for m in resumes] == [(4, "memory"), (4, "memory")], resumes
    assert not shm.exists() or [p.name for p in shm.iterdir()] == [".raysft.lock"]  # every node's snapshots gone
    ref_losses, ref_weights = ref
    assert final_losses(cfg.run_dir) == ref_losses
    # the checkpoints the run keeps, complete, on the storage the nodes share (written after the two resumes)
    assert sorted(p.name for p in cfg.run_dir.glob("checkpoint_*") if p.is_dir()) == \
        [f"checkpoint_{step:08d}" for step in range(EVERY, FAULT_STEPS + 1, EVERY)][-cfg.checkpoint.keep:]
    weights = load_file(cfg.run_dir / f"checkpoint_{FAULT_STEPS:08d}" / "model.safetensors")
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)
