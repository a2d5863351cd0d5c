"""A full checkpoint's tensors in files as Hugging Face writes a large model: groups of about SHARD_BYTES, each in
`{stem}-0000i-of-0000n.safetensors`, and `{stem}.safetensors.index.json` naming the file of every tensor. The
model has the stem "model" (transformers, vLLM and the safetensors tools read the directory as any HF model); the
optimizer state has the stem "optimizer", in files named and grouped alike, so a rank resuming reads its slices of
both the same way. What fits one group is one `{stem}.safetensors` and no index, as save_pretrained writes a small
model; both forms load and export alike.

SHARD_BYTES is transformers' own default for save_pretrained, so a large model's fp32 weights are many files
rather than one, each copied, checked and uploaded on its own. It bounds no memory: the save gathers one tensor at a
time whatever file it goes into (raysft.checkpoint.full).

The names of a checkpoint's tensor files are all here, so that every module telling them apart asks here: these, and
a sharded checkpoint's (torch.distributed.checkpoint's: each rank's `__<rank>_0.distcp` and the index `.metadata`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from raysft.errors import CheckpointError
from raysft.hf.weights import tensor_files

SHARD_BYTES = 5 * 2**30
STEMS = ("model", "optimizer")
_TENSOR_FILE = re.compile(r"(model|optimizer)(-\d{5}-of-\d{5})?\.safetensors")
DCP_SUFFIX = ".distcp"  # each rank's part of a sharded checkpoint
DCP_INDEX = ".metadata"  # rank 0's index of them
_DCP_SHARD = re.compile(rf"__(\d+)_\d+{re.escape(DCP_SUFFIX)}")  # the parts DCP's FileSystemWriter names


def is_tensor_file(name: str) -> bool:
    """A full checkpoint's weights or optimizer state file (not its index)."""
    return _TENSOR_FILE.fullmatch(name) is not None


def is_dcp_shard(name: str) -> bool:
    """A rank's part of a sharded checkpoint (torch.distributed.checkpoint's), not the index."""
    return name.endswith(DCP_SUFFIX)


def is_dcp_file(name: str) -> bool:
    """A sharded checkpoint's part or its index."""
    return name == DCP_INDEX or is_dcp_shard(name)


def dcp_shard_rank(name: str) -> int | None:
    """The rank that wrote a DCP part `__<rank>_<n>.distcp` (None for any other name)."""
    match = _DCP_SHARD.fullmatch(name)
    return int(match[1]) if match else None


def index_name(stem: str) -> str:
    return f"{stem}.safetensors.index.json"


def single_file(stem: str) -> str:
    """The stem's one file, where its tensors fit one group (no index then)."""
    return f"{stem}.safetensors"


MODEL_FILE, MODEL_INDEX = single_file("model"), index_name("model")
OPTIMIZER_FILE = single_file("optimizer")


def naming_file(ckpt_dir: Path, stem: str) -> Path:
    """The file that names all of the stem's tensors, for messages and checks: the index, or else the one file."""
    index = ckpt_dir / index_name(stem)
    return index if index.is_file() else ckpt_dir / single_file(stem)


def is_tensor_or_index_file(name: str) -> bool:
    """A tensor file or the index of one stem: what export and chat replace with their own."""
    return is_tensor_file(name) or name in {index_name(s) for s in STEMS}


def group(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names in their order, cut into groups of at most max_bytes (a bigger tensor gets a group of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def file_names(stem: str, count: int) -> list[str]:
    """save_pretrained's names: one file unnumbered, more numbered from 1 with the count."""
    if count == 1:
        return [single_file(stem)]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(out_dir: Path, stem: str, groups: list[list[str]], names: list[str], total_size: int) -> None:
    """The index that maps each tensor to its file (none for a single file, as save_pretrained does)."""
    if len(groups) > 1:
        weight_map = {tensor: name for tensors, name in zip(groups, names, strict=True) for tensor in tensors}
        (out_dir / index_name(stem)).write_text(json.dumps(
            {"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))


def listed_files(ckpt_dir: Path, stem: str) -> list[str]:
    """The files of one stem: those its index names (each a numbered file of the stem, beside the index), or the
    single file. Raises CheckpointError naming the index."""
    index = ckpt_dir / index_name(stem)
    if not index.is_file():
        return [single_file(stem)]
    names = list(dict.fromkeys(read_weight_map(index).values()))
    bad = [n for n in names if not (isinstance(n, str) and is_tensor_file(n) and n.startswith(f"{stem}-"))]
    if bad:
        raise CheckpointError(f"{index}: weight_map names {bad[0]!r}, which is no {stem} file of a checkpoint")
    return names


def tensor_map(ckpt_dir: Path, stem: str) -> dict[str, Path]:
    """{tensor: file} from the headers of the stem's files (only headers are read), which must agree with the
    index: transformers follows the index, raysft the headers. Raises CheckpointError naming the file."""
    files = [ckpt_dir / name for name in listed_files(ckpt_dir, stem)]
    try:
        found = tensor_files(files)
    except Exception as e:  # safetensors raises its own error types for truncated or malformed files
        raise CheckpointError(f"{_failing(files)}: cannot read: {e}") from e
    index = ckpt_dir / index_name(stem)
    if index.is_file():
        listed = {tensor: ckpt_dir / name for tensor, name in read_weight_map(index).items()}
        if listed != found:
            wrong = sorted(set(listed.items()) ^ set(found.items()))[0][0]
            raise CheckpointError(f"{index}: tensor {wrong!r} is not where the index says "
                                  f"(index: {listed.get(wrong)}, files: {found.get(wrong)})")
    return found


def read_weight_map(index: Path, error: type[Exception] = CheckpointError,
                    read_json: Callable[[Path], object] | None = None) -> dict:
    """The one parser of a `*.safetensors.index.json` (a checkpoint's, and a model directory's for raysft.hf.files):
    its weight_map, {tensor name: file name}, the names unchecked (each caller has its own rules for them).
    `read_json` reads the file with the caller's messages (default: CheckpointError, "unreadable index"); `error`
    names the index where it holds no weight_map."""
    data = (read_json or _read_index)(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise error(f"{index}: has no weight_map of tensor names to files")
    return weight_map


def _read_index(index: Path) -> dict:
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: unreadable index: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{index}: unreadable index: a JSON {type(data).__name__}, not an object")
    return data


def _failing(files: list[Path]) -> Path:
    """The first file whose header safetensors cannot read (for the message)."""
    for path in files:
        try:
            tensor_files([path])
        except Exception:  # noqa: BLE001 - the one to name
            return path
    return files[0]
