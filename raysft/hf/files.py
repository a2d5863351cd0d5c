"""Checks on a Hugging Face model or tokenizer directory before transformers reads anything from it.

A model directory is data from someone else: its files may be damaged (a copy cut off, a disk error) or crafted
(a safetensors header that claims terabytes, a config that names Python code of its own). transformers meets such
files deep inside a load: on a Ray worker after the cluster started, or at a terminal prompt asking whether to run
the directory's code. raysft never runs code from a model directory, so these checks refuse such a directory on
the driver, naming the file and what is wrong, and every load passes trust_remote_code=False besides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from raysft.errors import ModelDirError
from raysft.hf.shards import DCP_SUFFIX, MODEL_INDEX, read_weight_map

# The safetensors library's own limit on a header (its MAX_HEADER_SIZE): a larger length field is no real header.
MAX_HEADER_BYTES = 100_000_000
# The files whose `auto_map` asks transformers to import Python modules from the directory.
CODE_NAMING_FILES = ("config.json", "tokenizer_config.json", "processor_config.json")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a model directory, or ModelDirError naming it."""
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{path}: not valid JSON ({e}): a damaged or incomplete copy?") from None
    except OSError as e:
        raise ModelDirError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: holds a JSON {type(data).__name__}, not the object transformers expects")
    return data


def refuse_code(directory: Path) -> None:
    """ModelDirError if a config of the directory asks for its own Python code: an `auto_map`, whose modules
    transformers imports with trust_remote_code (asking on a terminal first)."""
    for name in CODE_NAMING_FILES:
        if (directory / name).is_file():
            check_config_file(directory / name)


def check_config_file(path: Path) -> None:
    """A config file that transformers reads without running any code: a JSON object without auto_map."""
    auto_map = read_json(path).get("auto_map")
    if auto_map:
        described = ", ".join(f"{k}: {v}" for k, v in auto_map.items()) if isinstance(auto_map, dict) else auto_map
        raise ModelDirError(
            f"{path}: auto_map asks for Python code shipped with the model ({described}); raysft never runs code "
            "from a model directory. If transformers' own classes load the same model, use a copy of the "
            "directory without auto_map")


def refuse_quantized(directory: Path) -> None:
    """ModelDirError if config.json says the weights are quantized (a `quantization_config`): raysft reads weights
    as values, and quantized ones are codes that mean something only with their scales and method."""
    config = directory / "config.json"
    quantization = read_json(config).get("quantization_config") if config.is_file() else None
    if quantization is not None:
        method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
        raise ModelDirError(f"{config}: quantization_config says the weights are quantized ({method}); raysft trains, "
                            "exports and chats with unquantized weights only (float32, bfloat16, float16): use the "
                            "model's unquantized release, or dequantize it first")


def check_model_dir(directory: Path) -> None:
    """What from_pretrained reads in a model directory: its configs (JSON, asking for no code) and the header of
    each safetensors weight file (within the file, readable by safetensors), without reading the weights. A
    sharded raysft checkpoint is refused with what to do: its weights are in torch.distributed.checkpoint files."""
    refuse_code(directory)
    refuse_quantized(directory)
    if any(directory.glob(f"*{DCP_SUFFIX}")):
        raise ModelDirError(
            f"{directory} is a sharded raysft checkpoint: its weights are in torch.distributed.checkpoint files "
            f"(*{DCP_SUFFIX}), which no Hugging Face load reads. Export it first (`raysft export {directory} OUT`) "
            "and use OUT; a full checkpoint (checkpoint.mode: full) is read as it is")
    for path in weight_files(directory):
        check_safetensors(path)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files the directory's index lists (each inside the directory and present), or all of them."""
    index = directory / MODEL_INDEX
    if not index.is_file():
        return sorted(directory.glob("*.safetensors"))
    weight_map = read_weight_map(index, ModelDirError, read_json)
    files = []
    for name in dict.fromkeys(weight_map.values()):
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise ModelDirError(f"{index}: weight_map names {name!r}, which is not a .safetensors file of the "
                                "directory")
        if not (directory / name).is_file():
            raise ModelDirError(f"{index}: weight_map names {name}, which is missing from {directory}")
        files.append(directory / name)
    return files


def check_safetensors(path: Path) -> None:
    """ModelDirError unless the file's header is in the file, under safetensors' size limit, JSON, and places every
    tensor inside the file; then safetensors itself validates the header (dtypes, shapes against offsets)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        length_field = f.read(8)
        if len(length_field) < 8:
            raise ModelDirError(f"{path}: {size} bytes, too short for a safetensors file (cut off?)")
        length = int.from_bytes(length_field, "little")
        if length > size - 8:
            raise ModelDirError(f"{path}: the safetensors header claims {length} bytes but the file has {size}: the "
                                "file is cut off or is no safetensors file")
        if length > MAX_HEADER_BYTES:
            raise ModelDirError(f"{path}: the safetensors header claims {length} bytes, over safetensors' limit of "
                                f"{MAX_HEADER_BYTES}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelDirError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelDirError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
    data_bytes = size - 8 - length
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) and name != "__metadata__" else None
        if isinstance(offsets, list) and len(offsets) == 2 and isinstance(offsets[1], int) and offsets[1] > data_bytes:
            raise ModelDirError(f"{path}: tensor {name!r} ends at byte {offsets[1]} of the data, but the file holds "
                                f"{data_bytes} bytes of data: the file is cut off")
    try:
        with safe_open(path, framework="pt"):
            pass
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError) for any fault
        raise ModelDirError(f"{path}: safetensors cannot read it: {e}") from None
