"""dtypes by their names, the one table of them: the configuration's (parallel.mixed_precision, reduce_dtype,
`raysft export --dtype`: fp32, bf16, fp16) and safetensors' (F32, BF16, I8, F8_E4M3, ...), each a torch dtype, which
gives its size. Training's policy, the checkpoint's files, exports, the weight checks and the planner read them here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import get_args

import torch

from raysft.config import Precision

# The configuration's names (raysft.config.Precision lists them) and the dtype each means, in that order.
DTYPES: dict[str, torch.dtype] = dict(zip(get_args(Precision), (torch.float32, torch.bfloat16, torch.float16),
                                          strict=True))
# safetensors' names of the dtypes raysft reads or writes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# The floating-point dtypes whose values a copy into a floating-point parameter keeps (exactly, or rounded as a cast
# rounds). Integers and fp8 are quantized codes that mean something only with their scales.
CONVERTED = ("F32", "BF16", "F16", "F64")


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a dtype (torch's for one it has no name for, in messages)."""
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def stored_bytes(name: str, shape: Iterable[int]) -> int:
    """The bytes of a tensor of safetensors dtype `name` and this shape."""
    return math.prod(shape) * SAFETENSORS_DTYPES[name].itemsize
