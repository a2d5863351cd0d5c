"""The first step of bench/gpu/check.py: what the machine has, before anything of raysft is imported (so that a
raysft that cannot load there still leaves this record). `python bench/gpu/environment.py WORK` writes
WORK/environment.json: versions, the GPU, its measured bf16 matmul rate, whether flash varlen attention runs and
whether safetensors reads slices (raysft's per-rank pretrained loads), whether torchao's float8 training imports
and the GPU has FP8 tensor cores (parallel.fp8).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH_DIR))

from common import installed  # noqa: E402
from throughput import measured_matmul_tflops  # noqa: E402

PACKAGES = ("torch", "transformers", "triton", "peft", "safetensors", "tokenizers", "pyarrow", "numpy", "pytest",
            "ray", "torchtitan", "torchao")


def flash_varlen() -> dict:
    """Whether torch has flash varlen attention (torch.nn.attention.varlen) and, on CUDA, whether it runs in bf16."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return {"importable": False, "error": str(e)}
    result: dict = {"importable": True}
    if torch.cuda.is_available():
        try:
            q, k, v = (torch.randn(24, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            cu = torch.tensor([0, 10, 24], device="cuda", dtype=torch.int32)
            out = varlen_attn(q, k, v, cu, cu, 14, 14, window_size=(-1, 0))
            result["runs_in_bf16"] = bool(torch.isfinite(out.float()).all())
        except Exception as e:  # noqa: BLE001 - what the check is for: report it
            result.update(runs_in_bf16=False, error=f"{type(e).__name__}: {e}")
    return result


def fp8_support() -> dict:
    """Whether torchao's float8 training imports here (the bundle's torchao against this torch) and, on CUDA, whether
    the GPU is one parallel.fp8 takes (compute capability 8.9 or higher)."""
    result: dict = {}
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401

        result.update(torchao_float8=True, torchao_file=torchao.__file__)
    except Exception as e:  # noqa: BLE001 - what the check is for: report it
        result.update(torchao_float8=False, error=f"{type(e).__name__}: {e}")
    if torch.cuda.is_available():
        result["fp8_tensor_cores"] = torch.cuda.get_device_capability() >= (8, 9)
    return result


def slice_reader(work: Path) -> dict:
    """Whether safetensors reads a slice of a tensor without the rest, and whether torch's DCP
    HuggingFaceStorageReader, which reads that way, is there."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = work / "slice.safetensors"
    tensor = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    save_file({"w": tensor}, str(path))
    with safe_open(str(path), framework="pt") as f:
        part = f.get_slice("w")[2:4]
    path.unlink()
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: F401

        reader = True
    except ImportError:
        reader = False
    return {"get_slice": bool(torch.equal(part, tensor[2:4])), "dcp_hf_reader": reader}


def main() -> None:
    out_path = Path(sys.argv[1]) / "environment.json"
    record: dict = {}

    def note(**fields) -> None:  # written after each finding: a crash later still leaves the earlier ones
        record.update(fields)
        out_path.write_text(json.dumps(record, indent=1))

    note(python=platform.python_version(), packages={name: installed(name) for name in PACKAGES},
         cpus=os.cpu_count(), cuda=torch.version.cuda if torch.cuda.is_available() else None)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        note(gpu={"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": [p.major, p.minor],
                  "multiprocessors": p.multi_processor_count})
        note(bf16_matmul_tflops=measured_matmul_tflops())
    note(flash_varlen=flash_varlen())
    note(safetensors_slice_reader=slice_reader(out_path.parent))
    note(fp8=fp8_support())
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        print(smi.stdout, flush=True)
        note(nvidia_smi=smi.returncode == 0)
    except (OSError, subprocess.TimeoutExpired) as e:
        note(nvidia_smi=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
