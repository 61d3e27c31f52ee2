"""Reading `.safetensors` files with NumPy alone (no PyTorch, no `safetensors`)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
}


def read_safetensors(path: str | os.PathLike) -> dict:
    """The tensors of a `.safetensors` file as NumPy arrays (bfloat16, which
    NumPy lacks, as float32), read without the `safetensors` package.

    Format: an 8-byte little-endian header size, a JSON header naming each
    tensor's dtype, shape and byte range, then the raw little-endian data.
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        (header_size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_size])
    except (struct.error, ValueError) as error:
        raise ValueError(f"{path} is not a safetensors file: {error}") from error
    body = memoryview(data)[8 + header_size :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = entry.get("dtype"), entry.get("shape")
        start, end = entry.get("data_offsets", (0, -1))
        if not 0 <= start <= end <= len(body):
            raise ValueError(
                f"{path}: tensor {name!r} has data offsets {start}..{end} outside "
                f"the file's {len(body)} data bytes."
            )
        raw = body[start:end]
        if dtype == "BF16":  # the upper half of a float32
            array = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _SAFETENSORS_DTYPES:
            little_endian = np.dtype(_SAFETENSORS_DTYPES[dtype]).newbyteorder("<")
            array = np.frombuffer(raw, little_endian)
        else:
            raise ValueError(
                f"{path}: tensor {name!r} has unsupported dtype {dtype!r}."
            )
        if array.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(
                f"{path}: tensor {name!r} has {array.size} values for shape {shape}."
            )
        tensors[name] = array.reshape(shape)
    return tensors
