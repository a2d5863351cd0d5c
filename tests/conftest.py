import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
SHARED_DATASETS = REPO.parent / "shared" / "datasets"


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """One local Ray per test module (4 logical CPUs: room for 2 workers and a second concurrent task)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    ray.shutdown()
