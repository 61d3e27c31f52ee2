"""Mixed-precision policy selection."""

from __future__ import annotations

from pathlib import Path

import keras

MIXED_PRECISION_CHOICES = ("auto", "bfloat16", "float16", "off")


def cpu_supports_bfloat16() -> bool:
    """Whether the CPU has native bfloat16 matmuls (AMX-BF16 or AVX-512 BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))


def gpu_available() -> bool:
    """Whether the Keras backend sees a GPU (imports only that backend)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return any(device.platform == "gpu" for device in jax.devices())
    if backend == "torch":
        import torch

        return torch.cuda.is_available()
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def resolve_mixed_precision(mode: str) -> str:
    """The Keras dtype policy for a mixed-precision mode.

    `"auto"`: `mixed_float16` on a GPU, `mixed_bfloat16` on a CPU with AMX or
    AVX-512 BF16, else `float32`; `"bfloat16"`, `"float16"`: the mixed policy
    of that dtype; `"off"`: `float32`.
    """
    if mode not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"`mixed_precision` must be one of {list(MIXED_PRECISION_CHOICES)}. "
            f"Received: mixed_precision={mode!r}"
        )
    if mode == "auto":
        if gpu_available():
            return "mixed_float16"
        return "mixed_bfloat16" if cpu_supports_bfloat16() else "float32"
    return {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16", "off": "float32"}[
        mode
    ]
