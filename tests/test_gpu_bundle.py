"""bench/gpu/bundle.py: the bundle a device call carries, built for this machine's Python (3.11; the device's is
3.12, the only difference a parameter) and installed, with no network, into a fresh venv that sees only what the
GPU machine has (bundle.DEVICE_PACKAGES, linked from this environment): Ray comes from the bundle alone, and
`raysft train` runs from it, and torchao's float8 training (parallel.fp8) imports from it.

The build downloads from PyPI into .gpubundle-cache/ (ignored by git), once: later runs reuse the wheels, as CI
with PyPI access does. Ray's tar is compressed at xz level 0 here, to keep the test short."""

import json
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO, cli_env
from packaging.requirements import Requirement

sys.path.insert(0, str(REPO / "bench" / "gpu"))
import bundle  # noqa: E402

pytestmark = pytest.mark.slow  # downloads once, then installs Ray into a venv and trains under it
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
CACHE = REPO / ".gpubundle-cache"
TRITON = "3.6.0"  # the GPU machine's (the device tool's KINDS.md)


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_closure() -> set[str]:
    """bundle.DEVICE_PACKAGES with what they require in this environment (the versions here may need packages the
    device's versions do not, e.g. a newer huggingface-hub), without Ray and without anything the bundle carries:
    those must come from the bundle."""
    carried = {normalized(r.partition("==")[0]) for r, _ in bundle.CARRIED} | {"ray"}
    todo, seen = list(bundle.DEVICE_PACKAGES), set()
    while todo:
        name = todo.pop()
        if name in seen or name in carried:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(normalized(requirement.name))
    return seen


def device_like_site(dest: Path) -> Path:
    """A folder of links to this environment's packages that the GPU machine has too (device_closure): each such
    distribution's top-level modules and its dist-info. Nothing else of this environment is there, Ray least of
    all."""
    dest.mkdir()
    names = device_closure()
    for dist in metadata.distributions():
        if normalized(dist.metadata["Name"]) not in names:
            continue
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith((".", "/"))}:
            source = base / top
            if source.exists() and not (dest / top).exists() and top not in ("bin", "__pycache__"):
                (dest / top).symlink_to(source)
    return dest


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv without system site packages, its site holding a .pth to the device-like folder; the bundle
    installed by bench/gpu/check.py's bundle step, run by that venv's Python as the device's runs it, into
    WORK/site, which goes first on PYTHONPATH for every later step (the check's prepare and titan steps run once
    here for test_the_check_installs_the_bundle_and_runs_torchtitans_leg_as_far_as_a_cpu_can: one install serves
    the module)."""
    tmp = tmp_path_factory.mktemp("bundle")
    out = tmp / "bundle"
    manifest = bundle.build(out, PYTHON, CACHE, preset=0)
    base = Path(sys.base_prefix) / "bin" / f"python{PYTHON}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(tmp / "venv")], check=True)
    python = tmp / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "device.pth").write_text(str(device_like_site(tmp / "device-site")) + "\n")
    # the GPU machine's Triton, which torchtitan imports and this machine's CPU build of torch lacks
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "PYTHONPATH": str(triton_site())}
    check = subprocess.run([str(python), str(REPO / "bench" / "gpu" / "check.py"), "--smoke", "--out",
                            str(tmp / "out"), "--work", str(tmp / "work"), "--only", "bundle,prepare,titan",
                            "--bundle", str(out)], cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    summary = json.loads((tmp / "out" / "summary.json").read_text())
    yield python, tmp / "work" / "site", manifest, out, {s["name"]: s for s in summary["steps"]}
    shutil.rmtree(tmp, ignore_errors=True)


def test_the_bundle_fits_a_device_call_and_carries_none_of_what_the_device_has(venv):
    _, _, manifest, out, _ = venv
    assert manifest["carried_bytes"] <= bundle.CARRY_LIMIT and manifest["python_version"] == PYTHON
    assert manifest["ray"].startswith("ray-") and (out / manifest["ray"]).is_file()
    names = {w.split("-")[0].replace("_", "-").lower() for w in manifest["wheels"]}
    assert {"torchtitan", "torchao"} <= names and not names & bundle.DEVICE_PACKAGES
    assert json.loads((out / "manifest.json").read_text())["carried_bytes"] == manifest["carried_bytes"]


def test_ray_comes_from_the_bundle_alone(venv):
    python, installed, _, _, _ = venv
    without = subprocess.run([str(python), "-c", "import ray"], capture_output=True, text=True)
    assert without.returncode != 0 and "No module named 'ray'" in without.stderr  # the base has no Ray
    probe = "import ray, ray.train.torch, torchtitan, tyro; print(ray.__file__, ray.__version__)"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(installed)})
    assert done.returncode == 0, done.stderr[-3000:]
    path, ray_version = done.stdout.split()
    assert Path(path).is_relative_to(installed) and ray_version == bundle.version("ray")


def test_fp8_training_comes_from_the_bundle(venv):
    # torchao is not on the GPU machine: the bundle's, imported against the torch there is, converts a model
    python, installed, _, _, _ = venv
    without = subprocess.run([str(python), "-c", "import torchao"], capture_output=True, text=True)
    assert without.returncode != 0 and "No module named 'torchao'" in without.stderr
    probe = ("import torchao, torch; from raysft.parallel.fp8 import convert_to_fp8; "
             "model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)); "
             "print(torchao.__file__, torchao.__version__, convert_to_fp8(model), type(model[0]).__name__)")
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{installed}:{REPO}"})
    assert done.returncode == 0, done.stderr[-3000:]
    path, version, converted, kind = done.stdout.split(maxsplit=3)
    assert Path(path).is_relative_to(installed) and version == "0.18.0"
    assert (converted, kind.strip()) == ("['0']", "Float8Linear")  # 64 x 8: not a multiple of 16 both ways
    assert not (installed / "ray" / "rllib").exists() and not (installed / "ray" / "jars").exists()


def test_raysft_train_runs_from_the_bundle(venv, tmp_path):
    python, installed, _, _, _ = venv
    with cli_env() as env:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAY_TMPDIR": env["RAY_TMPDIR"],
               "PYTHONPATH": f"{installed}:{REPO}", "TOKENIZERS_PARALLELISM": "false"}
        # one worker, as on the one-GPU device machine: a second would only import torch once more
        done = subprocess.run([str(python), "-m", "raysft", "train", "--set", "train.max_steps=2",
                               "--set", "scaling.num_workers=1",
                               "--set", "checkpoint.every_n_steps=2", "--set", "data.max_seq_len=64",
                               "--set", f"run.storage_path={tmp_path}", "--set", "run.name=bundle"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (tmp_path / "bundle" / "checkpoint_00000002").is_dir()


def triton_site() -> Path:
    """The GPU machine's Triton, which torchtitan imports at module level and this machine's CPU build of torch
    lacks: installed once into the cache, a folder for PYTHONPATH."""
    site = CACHE / f"triton-{TRITON}-py{PYTHON}"
    if not (site / "triton").is_dir():
        (wheel,) = bundle.download([f"triton=={TRITON}"], PYTHON, CACHE)
        partial = site.with_name(site.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                        str(partial), str(wheel)], check=True)
        partial.rename(site)
    return site


def test_the_check_installs_the_bundle_and_runs_torchtitans_leg_as_far_as_a_cpu_can(venv):
    # bench/gpu/check.py's bundle step (the venv fixture's run), then its titan leg with torchtitan from the bundle:
    # torchtitan's own config parsed from the leg's flags, its tokenizer and data loader built from it, one step's
    # batch drawn
    _, installed, _, _, steps = venv
    assert list(steps) == ["bundle", "prepare", "titan"]
    assert all(s["status"] == "ok" for s in steps.values()), {n: s.get("log_tail") for n, s in steps.items()}
    assert (installed / "ray").is_dir() and (installed / "torchtitan").is_dir()  # the bundle step's install
    titan = steps["titan"]["result"]
    data = titan["data"]
    rows, seq_len = data["local_batch_size"], data["tokens_per_step"] // data["local_batch_size"]
    assert titan["dry"]["batch_shape"] == titan["dry"]["label_shape"] == [rows, seq_len]
    assert titan["dry"]["model"] == "llama3 debugmodel" and titan["trained"].startswith("no: ")
