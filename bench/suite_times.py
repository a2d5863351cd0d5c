"""Where the test suite's time goes: each test file's seconds inside the whole suite and alone, and at each file's
start the machine's load, swap and the processes the suite left alive (descendants of pytest: Ray heads, pools).

    python bench/suite_times.py suite --out DIR [PYTEST_ARGS...]   # the suite, probed (DIR/suite.xml, DIR/probe.jsonl);
                                                                   # `-n 2 --dist loadgroup` as make test runs it
    python bench/suite_times.py alone --out DIR FILE...            # each file in a pytest of its own (DIR/alone/*.xml)
    python bench/suite_times.py report DIR                         # the table: file, in suite, alone, ratio, leftovers

The probe is tests/conftest.py's, switched on by RAYSFT_SUITE_PROBE (a JSON-lines path)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def pytest(out_xml: Path, args: list[str], env: dict | None = None) -> int:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={out_xml}", *args]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}).returncode


def file_seconds(xml: Path) -> dict[str, float]:
    """Seconds per test file in a junit report (setup, call and teardown: pytest's junit_duration_report=total)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((f"{p}.py" for p in module if p.startswith("test_")), module[0])
        seconds[name] += float(case.get("time", 0))
    return dict(seconds)


def report(out: Path) -> str:
    suite = file_seconds(out / "suite.xml") if (out / "suite.xml").exists() else {}
    alone = {}
    for xml in sorted((out / "alone").glob("*.xml")):
        alone.update(file_seconds(xml))
    probes = {}
    if (out / "probe.jsonl").exists():
        for line in (out / "probe.jsonl").read_text().splitlines():
            p = json.loads(line)
            if p.get("worker") or p["file"] not in probes:  # older probes also logged xdist's controller: no worker
                probes[p["file"]] = p
    rows = ["| file | in suite s | alone s | suite/alone | load at start | swap MiB | processes left before it |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name in sorted(set(suite) | set(alone), key=lambda n: -suite.get(n, alone.get(n, 0))):
        s, a, p = suite.get(name), alone.get(name), probes.get(name, {})
        ratio = f"{s / a:.2f}" if s and a else ""
        left = ", ".join(f"{k} x{v}" for k, v in sorted(p.get("left", {}).items())) or ""
        rows.append(f"| {name} | {s or 0:.0f} | {a or 0:.0f} | {ratio} | {p.get('load1', '')} | "
                    f"{p.get('swap_mib', '')} | {left} |")
    total = f"in suite: {sum(suite.values()):.0f} s; alone: {sum(alone.values()):.0f} s"
    # side by side (make test's two streams), a file's seconds are spent beside the other stream's
    by_worker: dict[str, float] = defaultdict(float)
    for name, seconds in suite.items():
        by_worker[probes.get(name, {}).get("worker") or "one process"] += seconds
    streams = "; ".join(f"{w}: {s:.0f} s" for w, s in sorted(by_worker.items()))
    return "\n".join(rows + ["", total, f"by pytest process: {streams}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["suite", "alone", "report"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--out", type=Path)
    args, extra = parser.parse_known_args()
    if args.what == "report":
        print(report(Path(args.rest[0])))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "suite":
        code = pytest(args.out / "suite.xml", [*args.rest, *extra],
                      {"RAYSFT_SUITE_PROBE": str((args.out / "probe.jsonl").resolve())})
    else:
        (args.out / "alone").mkdir(exist_ok=True)
        code = max(pytest(args.out / "alone" / f"{Path(f).stem}.xml", [f, *extra]) for f in args.rest)
    print(report(args.out))
    sys.exit(code)


if __name__ == "__main__":
    main()
