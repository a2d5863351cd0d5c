"""Every GPU config in jobs/configs states its memory as `raysft plan` prints it: the header names the plan command,
and each figure it quotes (parameters, the per-GPU terms and peak, the checkpoint, the memory tier's host memory)
is the one that command prints now. A change to the config, the model shapes or the memory model that moves a
figure fails here until the header is rewritten from plan's output."""

import re
import shlex
from pathlib import Path

import pytest
import yaml
from conftest import REPO, cli_in_process

CONFIGS = REPO / "jobs" / "configs"
GPU_CONFIGS = [p for p in sorted(CONFIGS.glob("*.yaml")) if (yaml.safe_load(p.read_text()).get("scaling") or {})
               .get("use_gpu")]
PLAN_COMMAND = re.compile(r"`raysft plan (jobs/configs/[^`]+)`")

# what the header quotes, and how: the figure is group 1 of the pattern, matched in the header's plan block
QUOTED = {
    "parameters": r"([\d,]+) parameters",
    "weights": r"\bweights ([\d.]+)",
    "gradients": r"\bgradients ([\d.]+)",
    "optimizer": r"\boptimizer ([\d.]+)",
    "gathered": r"\bgathered ([\d.]+)",
    "in flight": r"\bin flight ([\d.]+)",
    "activations": r"\bactivations ([\d.]+)",
    "logits": r"\blogits ([\d.]+)",
    "peak": r"\bpeak ([\d.]+)",
    "GPU memory": r"\bpeak [\d.]+ of ([\d.]+)",
    "share of the GPU": r"\bpeak [\d.]+ of [\d.]+ \((\d+%)\)",
    "checkpoint mode": r"\bcheckpoint \((\w+)\)",
    "checkpoint": r"\bcheckpoint \(\w+\): ([\d.]+)",
    "saving rank's host": r"\b([\d.]+) on each saving rank's host",
    "memory tier": r"\bmemory tier (off|every \d+ steps?)",
    "staging buffers": r"\bstaging buffers ([\d.]+)",
    "own snapshots": r"\bown snapshots ([\d.]+)",
    "partner copies": r"\bpartner copies ([\d.]+)",
    "tier total": r"\btotal ([\d.]+)",
    "tier in /dev/shm": r"\b([\d.]+) of it in /dev/shm",
}
# what every GPU config's header must quote (the tier's parts are checked where quoted)
REQUIRED = ["parameters", "weights", "gradients", "optimizer", "activations", "peak", "GPU memory",
            "share of the GPU", "checkpoint mode", "checkpoint", "saving rank's host", "memory tier", "tier total",
            "tier in /dev/shm"]


def plan_block(path: Path) -> tuple[str, str]:
    """(the plan command's arguments, the header's text from that line to the next bare '#' line)."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("#") and "`raysft plan jobs/configs/" in line),
                 None)
    assert start is not None, (f"{path.name}: its header names no `raysft plan jobs/configs/...` command to take its "
                               "memory from")
    block = []
    for line in lines[start:]:
        if not line.startswith("#") or line.strip() == "#":
            break
        block.append(line.lstrip("#").strip())
    text = " ".join(block)
    command = PLAN_COMMAND.search(text)
    assert command, f"{path.name}: the `raysft plan ...` of its header is not closed by a backquote"
    return command.group(1), text


def printed_figures(out: str) -> dict[str, str]:
    """The figures of `raysft plan`'s output, under the names of QUOTED."""
    figures = {"parameters": re.search(r"^model: [\d.]+B parameters \(([\d,]+)\)", out, re.M).group(1)}
    assert "per worker (GiB):" in out, "the headers quote GiB: plan printed another unit"
    for name in ("weights", "gradients", "optimizer", "gathered", "in flight", "activations", "logits", "peak"):
        figures[name] = re.search(rf"^  {name} +([\d.]+)$", out, re.M).group(1)
    fits = re.search(r"^  fits ([\d.]+) GiB per GPU: yes \((\d+%)", out, re.M)
    assert fits, f"plan says the config does not fit its GPU, or knows no GPU memory:\n{out}"
    figures["GPU memory"], figures["share of the GPU"] = fits.groups()
    mode, size, host = re.search(r"^  (\w+) +([\d.]+) +([\d.]+) <- checkpoint.mode$", out, re.M).groups()
    figures.update({"checkpoint mode": mode, "checkpoint": size, "saving rank's host": host})
    tier = re.search(r"^memory tier, host memory per node of \d+ worker\(s\) \(GiB\): (off|every (\d+) step)", out,
                     re.M)
    figures["memory tier"] = "off" if tier.group(1) == "off" else f"every {tier.group(2)} step"
    for name in ("staging buffers", "own snapshots", "partner copies"):
        figures[name] = re.search(rf"^  {name} +([\d.]+)$", out, re.M).group(1)
    figures["tier total"], figures["tier in /dev/shm"] = re.search(
        r"^  total +([\d.]+)  \(([\d.]+) of it in /dev/shm", out, re.M).groups()
    return figures


def quoted_figures(text: str) -> dict[str, str]:
    found = {name: re.search(pattern, text) for name, pattern in QUOTED.items()}
    figures = {name: m.group(1) for name, m in found.items() if m}
    if "memory tier" in figures:  # "every 10 steps" and plan's "every 10 step(s)" alike
        figures["memory tier"] = figures["memory tier"].removesuffix("s")
    return figures


def test_the_gpu_configs_are_found():
    names = {p.name for p in GPU_CONFIGS}
    assert {"llama3.2-1b-1gpu.yaml", "llama3-8b-1x8.yaml", "llama3-8b-2x8-hsdp.yaml", "llama3-70b-4x8.yaml"} <= names


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_the_memory_header_is_what_raysft_plan_prints(path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # plan would read a running cluster's GPUs instead
    monkeypatch.chdir(REPO)
    command, text = plan_block(path)
    args = shlex.split(command)
    assert args[0] == f"jobs/configs/{path.name}", f"{path.name}: its header plans {args[0]}, not itself"
    out = cli_in_process("plan", *args)
    assert out.returncode == 0, f"raysft plan {command}: exit {out.returncode}\n{out.stderr}"
    printed, quoted = printed_figures(out.stdout), quoted_figures(text)
    missing = [name for name in REQUIRED if name not in quoted]
    assert not missing, f"{path.name}: the header's plan block quotes no {', '.join(missing)}:\n{text}"
    drifted = {name: (value, printed[name]) for name, value in quoted.items() if value != printed[name]}
    assert not drifted, (f"{path.name}: header figures (quoted, printed) differ from `raysft plan {command}`: "
                         f"{drifted}; rewrite the header from plan's output:\n{out.stdout}")
