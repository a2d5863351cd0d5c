"""Memory of the data path, old against lazy: RSS of one process holding the training data set of a synthetic
200k-sample store
(whole table as Python lists) vs the lazy one. Usage: .venv/bin/python bench/data_memory.py [STORE_DIR]"""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

WORKER = r'''
import sys, time, numpy as np, pyarrow.parquet as pq
from pathlib import Path
def rss(kind="RssAnon"):  # anonymous memory: the process's own; RssFile is page cache it maps (shared)
    return int(open("/proc/self/status").read().split(kind + ":")[1].split()[0]) / 1024
from raysft.data.dataloader import TokenizedDataset, collate
store, how = Path(sys.argv[1]), sys.argv[2]
base, base_file = rss(), rss("RssFile"); t = time.perf_counter()
if how == "old":
    table = pq.read_table(store / "samples.parquet", columns=["input_ids", "labels", "num_loss_tokens"])
    class ds:
        input_ids = table.column("input_ids").to_pylist(); labels = table.column("labels").to_pylist()
        num_loss_tokens = table.column("num_loss_tokens").to_numpy()
    del table
    n = len(ds.input_ids)
else:
    ds = TokenizedDataset(store); n = len(ds)
opened, open_s = rss() - base, time.perf_counter() - t
opened_file = rss("RssFile") - base_file
order = np.random.default_rng(0).permutation(n)[:8000]
t = time.perf_counter()
for b in np.array_split(order, 1000):
    collate(ds, b, 0)
batch_ms = (time.perf_counter() - t)
print(f"{how}: anonymous RSS +{opened:.0f} MiB after opening ({open_s:.1f} s), +{rss() - base:.0f} MiB after 1000 "
      f"random micro-batches of 8 ({batch_ms:.2f} ms each); file-backed (page cache) RSS +{opened_file:.0f} MiB, "
      f"+{rss('RssFile') - base_file:.0f} MiB")
'''


def main():
    sys.path.insert(0, "tests")  # run from the repository root
    from test_dataloader import synthetic_store
    store = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()) / "store"
    lengths = np.random.default_rng(0).integers(32, 224, 200_000)
    if not store.exists():
        synthetic_store(store, lengths)
    size = sum(p.stat().st_size for p in store.iterdir())
    print(f"store: 200,000 samples, {lengths.sum() / 1e6:.1f}M tokens ({8 * lengths.sum() / 2**20:.0f} MiB as int32 "
          f"ids + labels), parquet {size / 2**20:.0f} MiB")
    for how in ("old", "lazy"):
        subprocess.run([sys.executable, "-c", WORKER, str(store), how], check=True)
    if len(sys.argv) == 1:
        shutil.rmtree(store.parent)


main()
