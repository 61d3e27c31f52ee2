"""Which path an attention call takes: the paths, the switch-over length,
whether a fused kernel runs the call, and the one decision between them
(`choose_path`, behind `attention_path` and `dot_product_attention`)."""

from __future__ import annotations

import contextlib
import functools
import threading

import keras
from keras import ops

from keras_attn import _validation as v

# The paths `dot_product_attention` can take (see `attention_path`).
FUSED = "fused"
MEMORY_EFFICIENT = "memory_efficient"
EXPLICIT = "explicit"
# Decided when the graph runs: the memory-efficient path when the lengths,
# unknown when traced, reach the switch-over; else the explicit path.
BY_LENGTH = "by_length"

# The key length from which `flash_attention=None` takes the memory-efficient
# path when no fused kernel runs the call, by compute dtype: below it the
# explicit path's two batched matmuls are as fast and the `(Tq, Tk)` weights
# are small (docs/LONG_SEQUENCES.md; benchmarks/long_attention_bench.py).
SWITCH_OVER_KEY_LENGTH = {"float32": 1024, "float16": 2048, "bfloat16": 2048}


def switch_over_length(dtype="float32") -> int:
    """The key length from which the memory-efficient path is the default.

    `SWITCH_OVER_KEY_LENGTH[dtype]`; the float32 value for other dtypes.
    """
    dtype = keras.backend.standardize_dtype(dtype)
    return SWITCH_OVER_KEY_LENGTH.get(dtype, SWITCH_OVER_KEY_LENGTH["float32"])


_BOUND = threading.local()


@contextlib.contextmanager
def sequence_length_bound(max_length: int | None):
    """A scope in which no sequence that attention reads is longer than
    `max_length`: a length that is unknown when a call is traced is taken
    to be at most that.

    Where lengths are unknown until the graph runs (a TensorFlow
    `tf.function` traced with `None` lengths, as Keras's `fit` retraces for
    batches of new lengths and as exports are traced), `flash_attention=None`
    otherwise builds both the explicit and the memory-efficient path and
    chooses between them when the graph runs (`"by_length"`). Under a bound
    below the switch-over length (`switch_over_length(dtype)`) the call
    takes the explicit path alone, which the longer lengths could not
    reach: the answers are the same, and the graph has no blocked path to
    trace, optimise and differentiate (a few times faster to trace on a
    CPU). Bounds at or above the switch-over change nothing.

    keras-attn's backbones enter it with their `sequence_length` where
    their positions bound the input (`position="learned"` or
    `"sinusoidal"`, whose embedding refuses longer static inputs), and
    `TransformerTranslator` with the longer of its two; enter it around
    your own trace when your inputs are bounded. It acts where a layer's
    call is traced or run; nested scopes keep the tightest bound, and
    `None` adds none.

    Args:
        max_length: the longest query and key sequence, a positive int, or
            `None` (no bound of its own).

    Example:

    ```python
    with keras_attn.ops.sequence_length_bound(128):
        path = keras_attn.ops.attention_path(key_length=None, query_length=None)
    assert path == "explicit"
    ```
    """
    v.check_positive_int("max_length", max_length, allow_none=True)
    previous = getattr(_BOUND, "value", None)
    if max_length is not None and (previous is None or max_length < previous):
        _BOUND.value = max_length
    try:
        yield
    finally:
        _BOUND.value = previous


def length_bound() -> int | None:
    """The innermost `sequence_length_bound`'s bound, or `None` outside one."""
    return getattr(_BOUND, "value", None)


def attention_path(
    flash_attention: bool | None = None,
    *,
    return_weights: bool = False,
    dropout_active: bool = False,
    same_head_dims: bool = True,
    fused_kernel: bool = False,
    alibi: bool = False,
    query_length: int | None = None,
    key_length: int | None = None,
    dtype="float32",
    backend: str | None = None,
) -> str:
    """The attention path a call takes.

    The one place where keras-attn chooses how attention is computed, from
    what the call needs. The paths:

    - `"fused"`: `keras.ops.dot_product_attention`, where a fused attention
      kernel actually runs the call (`fused_kernel`, from
      `fused_kernel_runs`: cuDNN's flash attention on a recent NVIDIA GPU in
      float16 / bfloat16 on JAX, PyTorch's flash or memory-efficient CUDA
      kernels and its CPU flash kernel, a TPU kernel). Where none runs
      (TensorFlow; JAX on a CPU, or on a GPU in float32),
      `keras.ops.dot_product_attention` is plain matmuls and a softmax over
      the `(Tq, Tk)` logits, so it is not taken.
      Nor is it with ALiBi (`alibi`): `keras.ops.dot_product_attention`
      takes a bias only as a whole `(B|1, N, Tq, Tk)` tensor, the tensor the
      memory-efficient path never builds, so such a call is treated as one
      that no fused kernel runs.
    - `"memory_efficient"`: `keras_attn.ops.memory_efficient_attention`,
      blocks of queries and keys, memory linear in the lengths in both
      passes; dropout included. On JAX with a GPU, float32 self-attention
      from 4,096 keys without an explicit mask, window, ALiBi, dropout or
      causal offset (padding only where the key and query padding masks
      are the same) is computed by Pallas's FlashAttention kernel instead
      (`keras_attn.ops.pallas_attention`), linear in memory too.
    - `"explicit"`: two batched matmuls around a float32 softmax that
      materialise the `(B, N, Tq, Tk)` weights; the only path that can return
      them.
    - `"by_length"`: the lengths are unknown until the graph runs (a
      `tf.function` traced with `None` lengths): `"memory_efficient"` when
      they reach the switch-over below, else `"explicit"`, decided then.
      Inside `sequence_length_bound(n)` with `n` below the switch-over, an
      unknown length is at most `n`: `"explicit"`.

    `flash_attention` is the layers' argument:

    - `None`: the fastest path that can honour the call: the fused kernel
      when one runs the call and no dropout is active; else the
      memory-efficient path when the key length reaches
      `switch_over_length(dtype)` and there is more than one query; else the
      explicit path. Follows `keras.config.is_flash_attention_enabled()`:
      after `keras.config.disable_flash_attention()` as `False`. (Keras
      3.15's `enable_flash_attention()` restores the default, `None`: it
      forces nothing; set `flash_attention=True` on the layers for that.)
    - `True`: the fused kernel when one runs the call, else the
      memory-efficient path, at any length. A call that needs the attention
      weights raises a `ValueError`.
    - `False`: the explicit path.

    Args:
        flash_attention: `None`, `True` or `False`, as above.
        return_weights: the call returns the attention weights.
        dropout_active: dropout on the weights is active (training, rate > 0).
        same_head_dims: key and value heads have the same size (JAX's fused
            kernel needs it).
        fused_kernel: whether a fused kernel runs this call on this device
            (`fused_kernel_runs`); ignored on TensorFlow, which has none.
        query_length, key_length: static lengths, `None` when unknown.
        dtype: the compute dtype, for the switch-over length.
        backend: defaults to `keras.backend.backend()`.

    Returns:
        `"fused"`, `"memory_efficient"`, `"explicit"` or `"by_length"`.
    """
    return choose_path(
        flash_attention,
        return_weights=return_weights,
        dropout_active=dropout_active,
        same_head_dims=same_head_dims,
        alibi=alibi,
        query_length=query_length,
        key_length=key_length,
        dtype=dtype,
        backend=backend,
        fused_kernel=lambda: fused_kernel,
    )


def choose_path(
    flash_attention: bool | None,
    *,
    return_weights: bool,
    dropout_active: bool,
    same_head_dims: bool,
    alibi: bool,
    query_length: int | None,
    key_length: int | None,
    dtype,
    backend: str | None = None,
    symbolic: bool = False,
    fused_kernel=lambda: False,
) -> str:
    """The decision of `attention_path`, with what `dot_product_attention`
    adds to it.

    The arguments are `attention_path`'s, except:

    - `symbolic`: the call is traced with symbolic shapes (JAX inferring an
      output spec): the explicit path, which gives the shapes (the others
      compare and pad symbolic lengths, which JAX cannot always decide),
      once the arguments are known to be consistent.
    - `fused_kernel`: a function of no arguments that says whether a fused
      kernel runs the call (`fused_kernel_runs`, which compiles a program on
      JAX), called only when the answer decides the path.
    """
    if flash_attention is None:
        flash_attention = keras.config.is_flash_attention_enabled()
    if flash_attention is not None and not flash_attention:
        return EXPLICIT
    backend = backend or keras.backend.backend()
    if return_weights:
        if flash_attention:
            raise ValueError(
                "Returning attention scores is not supported when flash "
                "attention is enabled. Please disable flash attention to access"
                " attention scores. (`flash_attention=True` needs a fused or "
                "memory-efficient attention path, and the attention weights "
                "are requested, which only the explicit path returns.) Pass "
                "`flash_attention=None` (the fastest path that can honour the "
                "call) or `False` (the explicit path). Received: "
                "flash_attention=True, return_attention_scores=True"
            )
        return EXPLICIT
    if symbolic:
        return EXPLICIT
    fused = (
        not alibi
        and backend != "tensorflow"
        and not dropout_active
        and same_head_dims
        and fused_kernel()
    )
    if fused:
        return FUSED
    if flash_attention:
        return MEMORY_EFFICIENT
    # An unknown key length is at most the scope's bound, where one is set.
    longest_key = length_bound() if key_length is None else key_length
    if (query_length is not None and query_length <= 1) or (
        longest_key is not None and longest_key < switch_over_length(dtype)
    ):
        return EXPLICIT
    if query_length is None or key_length is None:
        return BY_LENGTH
    return MEMORY_EFFICIENT


# Custom-call targets of fused attention kernels in a compiled XLA program:
# cuDNN's fused attention ("__cudnn$fmhaSoftmax", ...) and Pallas kernels on
# TPUs (Keras uses the splash attention kernel there).
_FUSED_KERNEL_TARGETS = ("cudnn$fmha", "tpu_custom_call")


def fused_kernel_runs(query, key, value, mask_shape=None, is_causal=False) -> bool:
    """Whether `keras.ops.dot_product_attention` runs a fused kernel here.

    Read from what runs rather than from the API's promise:

    - JAX: the program that `jax.jit` compiles for these shapes and dtypes
      (with a boolean mask of `mask_shape`, or `is_causal`) is searched for a
      fused attention custom call (`_FUSED_KERNEL_TARGETS`). On a CPU, and
      on a GPU in float32, XLA builds the attention from matmuls and a
      softmax over the `(Tq, Tk)` logits: no fused kernel. A program that
      does not compile here (float16 on a CPU, whose `dot_general` cannot
      accumulate float16 into float32) has none either. The answer is
      cached per platform, shapes, dtypes and mask.
    - PyTorch: CUDA tensors that PyTorch's flash or memory-efficient kernel
      accepts (`torch.backends.cuda.can_use_flash_attention` /
      `can_use_efficient_attention`, the checks its dispatcher makes); CPU
      tensors for which its dispatcher picks its CPU flash kernel
      (`torch._fused_sdp_choice`), with no mask or a mask of one query row
      (`mask_shape[2] == 1`, such as key padding alone): Keras turns a
      boolean mask into an additive one of the same shape, so a mask with
      both sequence axes whole would be a `(Tq, Tk)` tensor of floats.
    - TensorFlow and the other backends: no fused kernel.

    Args:
        query, key, value: `(B, T, N, H)` tensors.
        mask_shape: the shape of the boolean mask the call passes, or `None`.
        is_causal: whether the call uses the backend's causal masking.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        specs = [(tuple(x.shape), _dtype(x)) for x in (query, key, value)]
        if mask_shape is not None:
            specs.append((tuple(mask_shape), "bool"))
        if any(dim is None for shape, _ in specs for dim in shape):
            return False
        import jax

        return _jax_program_has_fused_kernel(
            jax.default_backend(), tuple(specs), bool(is_causal)
        )
    if backend == "torch":
        return _torch_fused_kernel_runs(query, key, value, mask_shape, is_causal)
    return False


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


@functools.lru_cache(maxsize=256)
def _jax_program_has_fused_kernel(platform, specs, is_causal) -> bool:
    import jax

    def attend(query, key, value, mask=None):
        return ops.dot_product_attention(
            query, key, value, mask=mask, is_causal=is_causal
        )

    arguments = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]
    return _compiled_program_has_fused_kernel(attend, arguments)


def _compiled_program_has_fused_kernel(attend, arguments) -> bool:
    """Whether the program `jax.jit(attend)` compiles for `arguments` (shape
    and dtype structs) holds a fused attention kernel (`_FUSED_KERNEL_TARGETS`);
    `False` when it does not compile here."""
    import jax

    try:
        program = jax.jit(attend).lower(*arguments).compile().as_text()
    except Exception:  # any failure to compile here: no kernel runs it
        return False
    return any(target in program for target in _FUSED_KERNEL_TARGETS)


def _torch_fused_kernel_runs(query, key, value, mask_shape, is_causal) -> bool:
    """PyTorch's own kernel checks on the inputs Keras gives
    `scaled_dot_product_attention` (heads before time, an additive mask):
    for CUDA tensors its flash and memory-efficient kernels' checks, for CPU
    tensors its dispatcher's choice (`_torch_cpu_flash_runs`)."""
    try:
        import torch
        from torch.backends.cuda import (
            SDPAParams,
            can_use_efficient_attention,
            can_use_flash_attention,
        )
    except ImportError:
        return False
    cpu = query.device.type == "cpu"
    if not (cpu or query.is_cuda):
        return False
    if cpu and mask_shape is not None and mask_shape[2] != 1:
        return False  # a (Tq, Tk) float mask: see `fused_kernel_runs`
    query, key, value = (torch.transpose(x, 1, 2) for x in (query, key, value))
    mask = None
    if mask_shape is not None:
        # A stand-in of the mask's shape and dtype, allocated once.
        mask = torch.zeros((), dtype=query.dtype, device=query.device).expand(
            tuple(mask_shape)
        )
    if cpu:
        return _torch_cpu_flash_runs(query, key, value, mask, is_causal)
    try:
        params = SDPAParams(query, key, value, mask, 0.0, bool(is_causal), False)
    except TypeError:  # PyTorch before enable_gqa
        params = SDPAParams(query, key, value, mask, 0.0, bool(is_causal))
    return bool(
        can_use_flash_attention(params, False)
        or can_use_efficient_attention(params, False)
    )


def broadcast_mask_kernel(query) -> bool:
    """Whether the fused kernel of this backend and device takes a mask
    broadcast along its query axis (`(B|1, N|1, 1, Tk)`) as it is: PyTorch's
    CPU flash kernel does (`_torch_fused_kernel_runs`); cuDNN wants both
    sequence axes whole."""
    return keras.backend.backend() == "torch" and query.device.type == "cpu"


def _torch_cpu_flash_runs(query, key, value, mask, is_causal) -> bool:
    """Whether PyTorch's dispatcher computes a call on these heads-first CPU
    tensors (and stand-in additive mask) with its CPU flash kernel (linear
    memory, blocked in C++)."""
    import torch
    from torch.nn.attention import SDPBackend

    try:
        # The dispatcher's own choice (a private function, stable since
        # PyTorch 2.0; `enable_gqa` since 2.5). Keras repeats grouped
        # key/value heads before its call; asking with `enable_gqa` about
        # the heads as given gets the same answer without the copy.
        choice = torch._fused_sdp_choice(
            query,
            key,
            value,
            mask,
            0.0,
            bool(is_causal),
            enable_gqa=query.shape[1] != key.shape[1],
        )
    except Exception:  # an older or newer PyTorch without it: no claim
        return False
    return choice == SDPBackend.FLASH_ATTENTION.value


def lengths_kernel_implementation(
    query, key, value, *, lengths: bool, is_causal: bool, window: int | None
) -> str | None:
    """The `implementation` of `jax.nn.dot_product_attention` that runs a
    fused kernel for a call with the masks as sequence lengths and a window
    (`keras_attn.ops.sequence_lengths`): `"cudnn"`, or `None` where none does.

    Read from the program that `jax.jit` compiles for these shapes and dtypes
    with `implementation="cudnn"` (with int32 `(B,)` lengths when `lengths`,
    `is_causal`, and `local_window_size=(window - 1, 0)` with a `window`):
    it holds cuDNN's fused attention where cuDNN runs the call (float16 /
    bfloat16 on a recent NVIDIA GPU); anywhere else the call does not
    compile. JAX only (`None` on the other backends); cached per platform,
    shapes, dtypes and masks.
    """
    if keras.backend.backend() != "jax":
        return None
    specs = tuple((tuple(x.shape), _dtype(x)) for x in (query, key, value))
    if any(dim is None for shape, _ in specs for dim in shape):
        return None
    import jax

    runs = _jax_lengths_program_has_fused_kernel(
        jax.default_backend(), specs, bool(lengths), bool(is_causal), window
    )
    return "cudnn" if runs else None


@functools.lru_cache(maxsize=256)
def _jax_lengths_program_has_fused_kernel(
    platform, specs, lengths, is_causal, window
) -> bool:
    import jax

    def attend(query, key, value, query_lengths=None, key_lengths=None):
        return jax.nn.dot_product_attention(
            query,
            key,
            value,
            is_causal=is_causal,
            query_seq_lengths=query_lengths,
            key_value_seq_lengths=key_lengths,
            local_window_size=None if window is None else (window - 1, 0),
            implementation="cudnn",
        )

    arguments = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]
    if lengths:
        batch = specs[0][0][0]
        arguments += [jax.ShapeDtypeStruct((batch,), "int32")] * 2
    return _compiled_program_has_fused_kernel(attend, arguments)
