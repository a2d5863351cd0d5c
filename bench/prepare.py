"""Records/s of `raysft prepare` (local tokenization into the parquet store) on FastChat's dummy conversations, this
tree against a baseline tree (another checkout of raysft, e.g. the commit before a change), interleaved repeats,
each in a fresh process and a fresh store directory. Chat templates: the demo's with `{% generation %}` blocks,
the same without them (the labelling that finds assistant text in the rendering), and FastChat's Vicuna v1.1.

    git worktree add /tmp/raysft-base <commit> && python bench/prepare.py --baseline /tmp/raysft-base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import median_span, save_results

REPO = Path(__file__).resolve().parent.parent
FASTCHAT = REPO.parent / "shared" / "datasets" / "fastchat" / "dummy_conversation.json"
TEMPLATES = ("demo_generation_blocks", "demo_plain", "vicuna")

WORKER = r'''
import json, sys, tempfile, time
from pathlib import Path
from raysft.config import DataConfig, ModelConfig
from raysft.data import prepare_store
from raysft.data.demo import DEMO_CHAT_TEMPLATE
from raysft.data.tokenizer import load_tokenizer
import raysft
data, template, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = load_tokenizer(ModelConfig(), "vicuna" if template == "vicuna" else "auto")
if template == "demo_plain":
    tok.chat_template = DEMO_CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
times = []
for _ in range(repeats):
    root = Path(tempfile.mkdtemp())
    t = time.perf_counter()
    store = prepare_store(DataConfig(paths=[data], max_seq_len=2048, prepare="local"), tok, root)
    times.append(time.perf_counter() - t)
manifest = json.loads((store.path / "manifest.json").read_text())
print(json.dumps({"seconds": min(times), "records": manifest["counts"]["records"],
                  "samples": manifest["counts"]["samples"], "raysft": raysft.__file__}))
'''


def run(tree: Path, data: str, template: str, repeats: int) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKER, data, template, str(repeats)], check=True, text=True,
                         capture_output=True, cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["raysft"]).resolve().is_relative_to(tree.resolve()), result
    return {**result, "records_per_s": result["records"] / result["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a checkout of raysft to compare against")
    parser.add_argument("--data", default=str(FASTCHAT))
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs of each variant (fresh processes)")
    parser.add_argument("--repeats", type=int, default=3, help="timed preparations per run; the fastest counts")
    parser.add_argument("--out", default=str(REPO / "docs" / "bench" / "cpu-prepare.json"))
    args = parser.parse_args()
    trees = {"baseline": Path(args.baseline).resolve(), "this": REPO}
    results = []
    for i in range(args.runs):
        order = list(trees.items()) if i % 2 == 0 else list(reversed(trees.items()))
        for template in TEMPLATES:
            for name, tree in order:
                print(f"bench: run {i} {template} {name}", file=sys.stderr, flush=True)
                results.append({"tree": name, "template": template, **run(tree, args.data, template, args.repeats)})
    rows = ["| template | baseline records/s | this records/s | this / baseline | samples (baseline, this) |",
            "| --- | --- | --- | --- | --- |"]
    for template in TEMPLATES:
        runs = {n: [r for r in results if r["tree"] == n and r["template"] == template] for n in trees}
        ratio = statistics.median(r["records_per_s"] for r in runs["this"]) / statistics.median(
            r["records_per_s"] for r in runs["baseline"])
        rows.append(f"| {template} | {median_span(runs['baseline'], 'records_per_s', 0)} | "
                    f"{median_span(runs['this'], 'records_per_s', 0)} | {ratio:.2f} | "
                    f"{runs['baseline'][0]['samples']}, {runs['this'][0]['samples']} |")
    save_results(args.out, args, results, "\n".join(rows))


if __name__ == "__main__":
    main()
