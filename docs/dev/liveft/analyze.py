import json
import os
import sys

import torch

out = sys.argv[1]
ev = []
for f in sorted(os.listdir(out)):
    if f.endswith(".jsonl"):
        ev += [json.loads(line) for line in open(os.path.join(out, f))]
ev.sort(key=lambda e: e["t"])
t0 = ev[0]["t"]
kill = [e for e in ev if e["ev"] == "kill"]
tk = kill[0]["t"] if kill else None
pids = {}
for e in ev:
    pids.setdefault(e["rg"], set()).add(e["pid"])
print("pids per rg:", {k: sorted(v) for k, v in pids.items()})
last = {}
for e in ev:
    if e["ev"] == "step":
        key = (e["step"], e["rg"])
    if e["ev"] in ("start", "kill", "done", "report") or (
        e["ev"] == "step"
        and (
            tk is None
            or abs(e["t"] - tk) < 40
            and e["step"] >= kill[0]["step"] - 1
            and e["step"] <= kill[0]["step"] + 3
            or e.get("heal")
            or len(e["replicas"]) < 2
            and e["step"] % 5 == 0
            or (not e["committed"])
        )
    ):
        d = {
            k: e.get(k)
            for k in (
                "ev",
                "rg",
                "pid",
                "step",
                "committed",
                "replicas",
                "samples",
                "heal",
                "quorum_s",
                "step_s",
                "sha",
                "import_s",
                "report_s",
                "with_ckpt",
            )
        }
        d["t_rel"] = round(e["t"] - t0, 2)
        if tk:
            d["t_from_kill"] = round(e["t"] - tk, 2)
        print({k: v for k, v in d.items() if v is not None})
steps = [e for e in ev if e["ev"] == "step"]
if tk:
    surv = [e for e in steps if e["rg"] != kill[0]["rg"] and e["t"] > tk and e["committed"]]
    print(
        "survivor next committed step after kill: step",
        surv[0]["step"],
        "at +%.2fs" % (surv[0]["t"] - tk),
        "replicas",
        surv[0]["replicas"],
    )
    newpid = [e for e in ev if e["rg"] == kill[0]["rg"] and e["t"] > tk]
    st = [e for e in newpid if e["ev"] == "start"]
    if st:
        print("replacement worker start (train_func entered) +%.2fs" % (st[0]["t"] - tk), "import_s", st[0]["import_s"])
    rj = [e for e in newpid if e["ev"] == "step" and e["committed"]]
    if rj:
        print(
            "replacement first committed step",
            rj[0]["step"],
            "+%.2fs" % (rj[0]["t"] - tk),
            "heal",
            rj[0]["heal"],
            "quorum_s",
            rj[0]["quorum_s"],
        )
# committed sample sets per step
by = {}
for e in steps:
    if e["committed"]:
        by.setdefault(e["step"], {})[e["rg"]] = e
bad = []
for s, d in sorted(by.items()):
    samp = sorted(x for e in d.values() for x in e["samples"])
    exp = sorted((s * 16 + j) % 4096 for j in range(16))
    reps = sorted(d)
    shas = {e["sha"] for e in d.values()}
    if samp != exp and set(reps) == set(next(iter(d.values()))["replicas"]):
        bad.append((s, "samples", reps))
    if len(shas) > 1:
        bad.append((s, "sha differs", reps))
print("committed steps:", len(by), "min", min(by), "max", max(by), "missing", sorted(set(range(max(by) + 1)) - set(by)))
print("per-step sample/sha problems:", bad[:10])
print("uncommitted attempts:", [(e["rg"], e["step"]) for e in steps if not e["committed"]])
fin = [torch.load(os.path.join(out, f)) for f in sorted(os.listdir(out)) if f.startswith("final_rg")]
if len(fin) == 2:
    print("final weights bit-equal across rgs:", all(torch.equal(fin[0][k], fin[1][k]) for k in fin[0]))
if len(sys.argv) > 2:
    ref = torch.load(os.path.join(sys.argv[2], "final_rg0.pt"))
    print(
        "vs uninterrupted: bit-equal",
        all(torch.equal(fin[0][k], ref[k]) for k in ref),
        f"max abs diff {max((fin[0][k] - ref[k]).abs().max().item() for k in ref):.3g}",
    )
print(open(os.path.join(out, "summary.json")).read()[:600])
