"""What the GPU machine lacks for raysft's Ray path, torchtitan and FP8 training (torchao), built here into one folder
the device call carries, and installed from it there without a network.

    .venv/bin/python bench/gpu/bundle.py build                      # .gpubundle/ for the device's Python 3.12
    .venv/bin/python bench/gpu/bundle.py build --python-version 3.11 --out DIR   # the same for this machine's
    python3 bench/gpu/bundle.py install .gpubundle SITE             # on the device (bench/gpu/check.py does it)

The device has Python 3.12, torch, transformers, pyarrow, pandas, numpy and the rest of DEVICE_PACKAGES, no Ray, no
torchao and no network; a call carries 64 MiB in all. Ray's wheel (about 76 MiB) does not fit as it is: its tree
without `ray/jars` (Java) and `ray/rllib`, in a tar compressed with xz, does. The other packages are the wheels of
CARRIED, each pinned: the requirements of Ray[train] and torchtitan 0.3.0 (their METADATA) that the device does not
have, with theirs, and torchao for parallel.fp8. tests/test_gpu_bundle.py shows they suffice: `raysft train` runs,
torchtitan's config and data loader are built, and torchao converts a model, from a bundle installed over a base
holding only DEVICE_PACKAGES.

The build refuses when the bundle, the repository's files and .benchdata would exceed what a call carries.
Downloads are kept in .gpubundle-cache/ (ignored, not carried) and reused by later builds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
CARRY_LIMIT = 64 * 2**20  # what one device call carries: the working tree and every carried path together
STRIPPED = ("ray/jars/", "ray/rllib/")  # Java and RLlib: raysft uses neither

# Of the device image's Python packages (the device tool's KINDS.md, "Python packages already there"), those that
# matter to raysft, Ray and torchtitan, by the names pip normalizes to: what the bundle never carries.
DEVICE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cycler cython einops filelock flatbuffers
fonttools frozenlist fsspec grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna iniconfig
jinja2 joblib markdown markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict networkx ninja
numpy packaging pandas pathspec peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pygments pyparsing pytest pytest-timeout python-dateutil pyyaml regex requests rich safetensors scipy sentencepiece
setuptools shellingham six sympy tabulate tensorboard tensorboard-data-server tokenizers torch tqdm transformers
triton typer typing-extensions urllib3 werkzeug wheel xxhash yarl zipp
""".split())

# (requirement, who needs it). Pinned: to the version this checkout's environment runs where it has the package,
# else to the version whose METADATA was read. Every other dependency of Ray[train] and torchtitan 0.3.0 is in
# DEVICE_PACKAGES, or is not imported on the paths the check runs (Ray's dashboard, wandb, tensorboardX).
CARRIED = [
    ("jsonschema", "ray"), ("jsonschema-specifications", "ray"), ("referencing", "ray"), ("rpds-py", "ray"),
    ("pydantic", "ray.train.v2"), ("pydantic-core", "ray.train.v2"), ("annotated-types", "ray.train.v2"),
    ("typing-inspection", "ray.train.v2"),
    ("torchtitan==0.3.0", "torchtitan"), ("tyro==1.0.17", "torchtitan"), ("docstring-parser==0.18.0", "tyro"),
    ("typeguard==4.6.1", "tyro"), ("shtab==1.13.0", "tyro"), ("torchdata==0.11.0", "torchtitan"),
    ("spmd-types==0.2.3", "torchtitan"), ("torch-checkpointing==0.1.1", "torchtitan"),
    ("datasets==4.7.0", "torchtitan (its data loaders)"), ("dill", "datasets"), ("multiprocess", "datasets"),
    # 0.18.0: the newest torchao, built against torch 2.11 (the device's); one cp310-abi3 wheel of 3.4 MB, no
    # requirements of its own
    ("torchao==0.18.0", "parallel.fp8 (raysft.parallel.fp8)"),
]


def pinned(requirement: str) -> str:
    """`name==version`: as written where it says, else the version installed here."""
    return requirement if "==" in requirement else f"{requirement}=={version(requirement)}"


def download(requirements: list[str], python_version: str, dest: Path) -> list[Path]:
    """The wheels of `requirements` for CPython `python_version` on manylinux x86_64, without their dependencies
    (the list is complete on its own); files already in `dest` are not downloaded again."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64",
                    "-d", str(dest), *requirements], check=True)
    return [wheel_for(r, python_version, dest) for r in requirements]


def wheel_for(requirement: str, python_version: str, folder: Path) -> Path:
    """The downloaded wheel of a pinned requirement that fits `python_version` (a cache holds several)."""
    name, _, wanted = requirement.partition("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    tag = "cp" + python_version.replace(".", "")
    py = "py" + python_version.replace(".", "")
    for wheel in sorted(folder.glob("*.whl")):
        dist, ver, *_, pytag, abi, _ = wheel.stem.split("-")
        fits = bool(set(pytag.split(".")) & {"py3", tag, py}) or abi == "abi3"
        if re.sub(r"[-_.]+", "_", dist).lower() == stem and ver == wanted and fits:
            return wheel
    raise FileNotFoundError(f"no wheel of {requirement} for Python {python_version} in {folder}")


def strip_ray(wheel: Path, out: Path, preset: int) -> Path:
    """Ray's wheel as an xz tar of its files without STRIPPED, file modes kept (Ray's raylet and GCS server are
    executables, which a plain unzip would lose); the dist-info stays, for importlib.metadata."""
    target = out / (wheel.stem + ".tar.xz")
    with zipfile.ZipFile(wheel) as zf, tarfile.open(target, "w:xz", preset=preset) as tar:
        for info in zf.infolist():
            if info.is_dir() or info.filename.startswith(STRIPPED):
                continue
            entry = tarfile.TarInfo(info.filename)
            entry.size, entry.mode = info.file_size, (info.external_attr >> 16) & 0o777 or 0o644
            with zf.open(info) as src:
                tar.addfile(entry, src)
    return target


def carried_size(bundle: Path) -> dict[str, int]:
    """Bytes a device call carries with this bundle: the repository's files (tracked and untracked that git does
    not ignore), .benchdata and the bundle."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    tree = sum((REPO / name).stat().st_size for name in listed if name and (REPO / name).is_file())
    return {"repository": tree, ".benchdata": folder_size(REPO / ".benchdata"), "bundle": folder_size(bundle)}


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def build(out: Path, python_version: str, cache: Path, preset: int = 6) -> dict:
    """The bundle in `out` (made afresh): Ray stripped, the CARRIED wheels, manifest.json. Raises SystemExit when
    it would not fit a device call."""
    ray = pinned("ray")
    requirements = [pinned(r) for r, _ in CARRIED]
    carried_names = {re.sub(r"[-_.]+", "-", r.partition("==")[0]).lower() for r in requirements}
    if carried_names & DEVICE_PACKAGES:
        raise SystemExit(f"bundle: CARRIED repeats what the device has: {sorted(carried_names & DEVICE_PACKAGES)}")
    shutil.rmtree(out, ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    ray_wheel, *wheels = download([ray, *requirements], python_version, cache)
    ray_tar = strip_ray(ray_wheel, out, preset)
    for wheel in wheels:
        shutil.copy2(wheel, out / "wheels" / wheel.name)
    manifest = {"python_version": python_version, "ray": ray_tar.name, "ray_wheel_bytes": ray_wheel.stat().st_size,
                "wheels": sorted(w.name for w in wheels), "needed_by": dict(CARRIED)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    sizes = carried_size(out)
    manifest.update(sizes=sizes, carried_bytes=sum(sizes.values()), limit_bytes=CARRY_LIMIT)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for name, size in {**sizes, "total": manifest["carried_bytes"]}.items():
        print(f"bundle: {name:12s} {size / 2**20:7.2f} MiB")
    if manifest["carried_bytes"] > CARRY_LIMIT:
        raise SystemExit(f"bundle: {manifest['carried_bytes'] / 2**20:.1f} MiB would be carried, over the "
                         f"{CARRY_LIMIT / 2**20:.0f} MiB a device call takes")
    return manifest


def install(bundle: Path, site: Path) -> dict:
    """Ray's tree extracted and the wheels installed into `site` (a folder for PYTHONPATH), with no network."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python_version"] != here:
        raise SystemExit(f"bundle: {bundle} is for Python {manifest['python_version']}, this is {here} "
                         f"(bench/gpu/bundle.py build --python-version {here})")
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(bundle / manifest["ray"]) as tar:
        tar.extractall(site, filter="tar")
    wheels = [str(bundle / "wheels" / name) for name in manifest["wheels"]]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--disable-pip-version-check", "--target", str(site), *wheels], check=True,
                   env={**os.environ, "PIP_NO_INPUT": "1"})
    return {"site": str(site), "ray": manifest["ray"], "wheels": manifest["wheels"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the bundle (here, with PyPI)")
    b.add_argument("--python-version", default="3.12", help="the Python the bundle is for (the device's: 3.12)")
    b.add_argument("--out", type=Path, default=REPO / ".gpubundle")
    b.add_argument("--cache", type=Path, default=REPO / ".gpubundle-cache", help="downloaded wheels, reused")
    b.add_argument("--xz-preset", type=int, default=6, help="xz level of Ray's tar (6: about 32 MB)")
    i = sub.add_parser("install", help="install a bundle into a folder for PYTHONPATH (on the device)")
    i.add_argument("bundle", type=Path)
    i.add_argument("site", type=Path)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out, args.python_version, args.cache, args.xz_preset)
    else:
        print(json.dumps(install(args.bundle, args.site)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
