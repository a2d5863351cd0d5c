"""Live fault-tolerance prototype: Ray Train V2 + TorchftConfig + torchft Manager (CPU, gloo).

2 replica groups x 1 worker. Per step: a quorum (sync), the step's fixed global batch (sample ids)
split over the quorum's replica ids, gradients SUM-all-reduced through the manager (loss already
divided by the global batch size, so the sum is the global-batch mean gradient), should_commit()
gates the optimizer. A failed step is redone (the batch is a function of manager.current_step()).

Usage: python proto.py OUT_DIR [--kill-step K] [--kill-rg 1] [--steps N] [--report-every R]
Writes OUT_DIR/rg{i}.jsonl (one line per event) and OUT_DIR/final_rg{i}.pt, OUT_DIR/summary.json.
"""

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from datetime import timedelta

N_SAMPLES, GLOBAL_BATCH, DIN = 4096, 16, 8


def _sha(model, opt):
    import torch

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    for st in opt.state.values():
        for k in sorted(st):
            v = st[k]
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train_func(cfg):
    t_import = time.time()
    import ray.train
    import torch
    import torch.nn as nn
    from torch.distributed import ReduceOp
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import extract_trailing_digits

    ctx = ray.train.get_context()
    rg = ctx.get_world_rank()  # one worker per replica group in Ray 2.60
    out = cfg["out"]
    logf = open(os.path.join(out, f"rg{rg}.jsonl"), "a")

    def log(**kw):
        kw.update(t=time.time(), rg=rg, pid=os.getpid())
        logf.write(json.dumps(kw) + "\n")
        logf.flush()

    log(ev="start", import_s=round(time.time() - t_import, 3))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIN, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1234)
    X = torch.randn(N_SAMPLES, DIN, generator=g)
    Y = torch.sin(X.sum(dim=1, keepdim=True))

    pg = ProcessGroupGloo(timeout=timedelta(seconds=cfg["pg_timeout_s"]))
    if cfg["transport"] == "pg":
        transport = PGTransport(pg, timeout=timedelta(seconds=30), device=torch.device("cpu"))
    else:
        transport = HTTPTransport(timeout=timedelta(seconds=30), num_chunks=0)

    heal_events = []

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        heal_events.append(time.time())

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    manager = Manager(
        pg=pg,
        min_replica_size=cfg["min_replicas"],
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        world_size=1,
        rank=0,
        replica_id=f"rg_{rg}",
        timeout=timedelta(seconds=cfg["manager_timeout_s"]),
        quorum_timeout=timedelta(seconds=120),
        checkpoint_transport=transport,
        use_async_quorum=False,  # heal before the forward pass, so a rejoiner takes part at once
    )

    # The Manager does not keep the quorum's replica ids; capture them from its client.
    class _QuorumSpy:
        def __init__(self, c):
            self._c, self.last = c, None

        def _quorum(self, *a, **k):
            self.last = self._c._quorum(*a, **k)
            return self.last

        def __getattr__(self, n):
            return getattr(self._c, n)

    spy = _QuorumSpy(manager._client)
    manager._client = spy

    marker = os.path.join(out, "killed.marker")
    params = list(model.parameters())
    while manager.current_step() < cfg["steps"]:
        t0 = time.time()
        manager.start_quorum()  # sync quorum (+ heal if behind)
        t_q = time.time()
        step = manager.current_step()
        q = spy.last
        ids = sorted(extract_trailing_digits(r.split(":")[0]) for r in q.replica_ids)
        # The step's global batch depends on the step alone; its split on the quorum alone.
        gids = [(step * GLOBAL_BATCH + j) % N_SAMPLES for j in range(GLOBAL_BATCH)]
        mine = gids[ids.index(rg) :: len(ids)]
        if step == 0 and len(ids) < cfg["start_replicas"]:  # start only with the full quorum
            log(ev="wait_start", replicas=ids)
            time.sleep(0.2)
            continue

        if rg == cfg["kill_rg"] and step == cfg["kill_step"] and not os.path.exists(marker):
            open(marker, "w").write(str(time.time()))
            log(ev="kill", step=step)
            os._exit(1)

        lh_marker = os.path.join(out, "lighthouse_killed.marker")
        if rg == 0 and step == cfg["kill_lighthouse_step"] and not os.path.exists(lh_marker):
            import signal

            import psutil

            # Only a child of this worker's own raylet (this script's private Ray), by pid.
            raylet = psutil.Process(os.getppid())
            acts = [c for c in raylet.children() if "LighthouseServerActor" in " ".join(c.cmdline())]
            open(lh_marker, "w").write(str(time.time()))
            for a_ in acts:
                os.kill(a_.pid, signal.SIGKILL)
            log(ev="kill_lighthouse", step=step, pids=[a_.pid for a_ in acts])

        opt.zero_grad(set_to_none=False)
        loss = ((model(X[mine]) - Y[mine]) ** 2).sum() / GLOBAL_BATCH
        loss.backward()
        works = [manager.allreduce(p.grad, reduce_op=ReduceOp.SUM) for p in params]
        for w in works:
            w.wait()
        ok = manager.should_commit()
        if ok:
            opt.step()
        log(
            ev="step",
            step=step,
            committed=ok,
            replicas=ids,
            samples=mine,
            quorum_id=q.quorum_id,
            heal=bool(q.heal),
            quorum_s=round(t_q - t0, 4),
            step_s=round(time.time() - t0, 4),
            loss=float(loss),
            sha=_sha(model, opt) if ok else None,
            healed_at=heal_events[-1] if heal_events else None,
        )
        heal_events.clear()

        full = len(ids) == cfg["world"]
        if (
            ok
            and cfg["report_every"]
            and (step + 1) % cfg["report_every"] == 0
            and (full or not cfg["report_full_only"])
        ):
            tr = time.time()
            ckpt = None
            import tempfile

            d = tempfile.mkdtemp(dir=out)
            if rg == min(ids):  # lowest live replica id saves
                torch.save(state_dict(), os.path.join(d, "state.pt"))
                ckpt = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"step": step, "loss": float(loss), "rg": rg}, checkpoint=ckpt)
            log(ev="report", step=step, with_ckpt=ckpt is not None, report_s=round(time.time() - tr, 3))
        if cfg["sleep_s"]:
            time.sleep(cfg["sleep_s"])

    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, f"final_rg{rg}.pt"))
    log(ev="done", step=manager.current_step(), sha=_sha(model, opt))
    manager.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--kill-rg", type=int, default=1)
    ap.add_argument("--report-every", type=int, default=0)
    ap.add_argument("--sleep-s", type=float, default=0.2)
    ap.add_argument("--transport", default="http", choices=["http", "pg"])
    ap.add_argument("--heartbeat-ms", type=int, default=1000)
    ap.add_argument("--join-timeout-ms", type=int, default=10000)
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--start-replicas", type=int, default=2)
    ap.add_argument("--report-full-only", action="store_true")
    ap.add_argument("--kill-lighthouse-step", type=int, default=-1)
    ap.add_argument("--deadline-s", type=float, default=240)
    a = ap.parse_args()
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    tmp = os.path.join("/tmp", f"liveft_ray_{os.getpid()}")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=tmp,
        runtime_env={"env_vars": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
    )
    cfg = dict(
        out=out,
        steps=a.steps,
        kill_step=a.kill_step,
        kill_rg=a.kill_rg,
        report_every=a.report_every,
        sleep_s=a.sleep_s,
        transport=a.transport,
        pg_timeout_s=10,
        manager_timeout_s=10,
        min_replicas=a.min_replicas,
        start_replicas=a.start_replicas,
        report_full_only=a.report_full_only,
        world=2,
        kill_lighthouse_step=a.kill_lighthouse_step,
    )
    trainer = TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        torch_config=TorchftConfig(
            lighthouse_kwargs={
                "min_replicas": a.min_replicas,
                "heartbeat_timeout_ms": a.heartbeat_ms,
                "join_timeout_ms": a.join_timeout_ms,
            },
            backend="gloo",
        ),
        run_config=RunConfig(
            storage_path=os.path.join(out, "storage"), name="proto", failure_config=FailureConfig(max_failures=3)
        ),
    )
    res = {}

    def fit():
        t = time.time()
        try:
            r = trainer.fit()
            res.update(ok=True, metrics=r.metrics, checkpoint=str(r.checkpoint), error=str(r.error))
        except Exception as e:  # noqa: BLE001
            res.update(ok=False, error=repr(e)[:2000])
        res["fit_s"] = round(time.time() - t, 2)

    th = threading.Thread(target=fit, daemon=True)
    th.start()
    th.join(a.deadline_s)
    if th.is_alive():
        res.update(ok=False, error=f"deadline {a.deadline_s}s passed; shutting Ray down")
    json.dump(res, open(os.path.join(out, "summary.json"), "w"), indent=1, default=str)
    print("SUMMARY", json.dumps(res, default=str)[:3000], flush=True)
    ray.shutdown()
    os._exit(0 if res.get("ok") else 1)


if __name__ == "__main__":
    sys.exit(main())
