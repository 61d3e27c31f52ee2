"""Timing helpers shared by the benchmarks: alternate rounds, medians, peak,
and what the machine runs them on."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np


def alternate(fns: dict, rounds: int = 15, warmup: int = 3, inner: int = 3) -> dict:
    """Median seconds per call of each function, timed alternately.

    Each round calls every function `inner` times in turn, so that slow drifts
    of the machine (another process, thermal state) hit all of them alike.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(values) for name, values in times.items()}


def matmul_peak(dtype: str, size: int = 2048, rounds: int = 10) -> float:
    """FLOP/s of a large square matmul in `dtype` (the practical peak)."""
    import tensorflow as tf  # here: gpu_check.py uses `alternate` without TF

    a = tf.constant(np.random.default_rng(0).normal(size=(size, size)), dtype=dtype)
    b = tf.constant(np.random.default_rng(1).normal(size=(size, size)), dtype=dtype)
    fn = tf.function(lambda: tf.matmul(a, b))

    def call():
        fn().numpy()

    seconds = alternate({"matmul": call}, rounds=rounds, warmup=2, inner=2)["matmul"]
    return 2 * size**3 / seconds


def machine() -> dict:
    """The CPU model, its count, the flags relevant to the kernels and the
    load average when asked (a busy machine's times are less trustworthy)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if ":" in line:
                    key, value = line.split(":", 1)
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = fields.get("flags", "").split()
    info = {"cpu": fields.get("model name", "?"), "cpus": os.cpu_count()}
    for flag in ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"):
        info[flag] = flag in flags
    info["load_average"] = os.getloadavg()[0]
    return info


def onednn_enabled() -> bool:
    """Whether this process's TensorFlow runs its oneDNN kernels (TensorFlow's
    own answer, which reads TF_ENABLE_ONEDNN_OPTS and the build's default);
    False means Eigen's, the kernels of TF Serving's release binaries."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # not in this TensorFlow: the documented variable
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0"
    return bool(_pywrap_util_port.IsMklEnabled())
