"""What the model classes share as tasks: their tokenizers in the config, and
checks of the text they are given. Imports no TensorFlow."""

from __future__ import annotations

import keras

from keras_attn import _validation as v
from keras_attn.ops.serving import serving_mode

# keras_attn.text's special ids (that module imports TensorFlow).
PAD_ID, START_ID, END_ID = 0, 2, 3


def serialize_tokenizer(tokenizer):
    """A tokenizer layer's config for `get_config` (None stays None). It
    records no vocabulary: Keras' saving writes that as the tokenizer's asset
    file (`save_assets`), found as the task's attribute, and reads it back
    (`load_assets`) into the tokenizer `deserialize_tokenizer` made."""
    if tokenizer is None:
        return None
    config = keras.saving.serialize_keras_object(tokenizer)
    if _sharing_objects():
        # Saving a model, Keras names an object it serializes twice
        # (`shared_object_id`) from the second time on, and in the config it
        # kept of the first; but an enclosing config (an ensemble's members)
        # has copied that one by then. Named from the first, every copy names
        # the one tokenizer, which loads as one object: its vocabulary is an
        # asset, saved once.
        config["shared_object_id"] = id(tokenizer)
    return config


def _sharing_objects() -> bool:
    """Whether Keras is serializing in its object-sharing scope (as
    `model.save` does)."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover - Keras moved it
        return False
    found = global_state.get_global_attribute("shared_objects/id_to_config_map")
    return found is not None


def deserialize_tokenizer(config):
    """A tokenizer layer from `serialize_tokenizer`'s config (importing
    `keras_attn.text`, whose tokenizers register themselves, on TensorFlow):
    without its vocabulary until `load_assets`, unless the config holds it
    inline (as files saved before vocabularies were assets do)."""
    if config is None or isinstance(config, keras.layers.Layer):
        return config
    import keras_attn.text  # noqa: F401  registers the tokenizer classes

    return keras.saving.deserialize_keras_object(config)


def require_tokenizer(model, name: str, method: str):
    """The model's tokenizer `name`, or a `ValueError` saying how to give one."""
    tokenizer = getattr(model, name, None)
    if tokenizer is None:
        raise ValueError(
            f"`{method}` works on text and needs the model's `{name}`. Received: "
            f"{name}=None (pass it to the constructor, or set `model.{name}`; "
            "on token ids, use the `*_ids` methods)"
        )
    return tokenizer


def text_list(name: str, texts) -> list[str]:
    """`texts` as a list of strings (a single string is a list of one)."""
    if isinstance(texts, str):
        return [texts]
    try:
        found = list(texts)
    except TypeError:
        found = None
    if found is None or not all(isinstance(text, str) for text in found):
        raise ValueError(
            f"`{name}` must be a string or a list of strings. Received: "
            f"{name} of type {type(texts).__name__}"
        )
    return found


def is_texts(x) -> bool:
    """Whether `x` is raw text for `predict`: a string, or a non-empty list,
    tuple or NumPy array of strings."""
    import numpy as np

    if isinstance(x, str):
        return True
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "US" or (
            x.dtype.kind == "O" and x.size > 0 and isinstance(x.flat[0], str)
        )
    return (
        isinstance(x, (list, tuple))
        and len(x) > 0
        and all(isinstance(text, str) for text in x)
    )


def refuse_text_predict(model, x, methods: str) -> None:
    """A `ValueError` when `x` is raw text: `model.predict` takes token ids
    (`methods` are the model's text methods)."""
    if is_texts(x):
        raise ValueError(
            f"`{type(model).__name__}.predict` takes token ids; on raw strings "
            f"use {methods}. Received: x of {len(text_list('x', x))} string(s)"
        )


# -- batching raw texts -------------------------------------------------------

DEFAULT_BATCH_SIZE = 64
VERBOSE_CHOICES = ("auto", 0, 1, 2)


def check_batch_size(batch_size) -> int:
    return v.check_positive_int("batch_size", batch_size)


def check_verbose(verbose):
    if isinstance(verbose, bool) or verbose not in VERBOSE_CHOICES:
        raise ValueError(
            f"`verbose` must be one of {VERBOSE_CHOICES}. Received: verbose={verbose!r}"
        )
    return verbose


def bucket_length(longest: int, cap: int | None = None) -> int:
    """The padded width of a batch whose longest row has `longest` ids: the
    next power of two from 8 to 128, then the next multiple of 128, at most
    `cap`. A few widths (one compiled shape each under `tf.function` or
    `jax.jit`), none far wider than the batch needs."""
    width = 8
    while width < longest and width < 128:
        width *= 2
    if longest > width:
        width = -(-longest // 128) * 128
    return width if cap is None else max(1, min(width, cap))


def padded_ids(ids, cap: int | None = None, extra: int = 0):
    """Token ids of a batch (a ragged or dense tensor, or an array; 0 =
    padding at the end) as an int32 NumPy array `(B, width)`: each row cut to
    `cap` ids, the batch padded with 0 to `bucket_length` of its longest row
    plus `extra` (room for ids the caller adds)."""
    import numpy as np

    if hasattr(ids, "to_tensor"):  # a tf.RaggedTensor
        ids = ids.to_tensor(default_value=PAD_ID)
    ids = np.asarray(ids, dtype="int32")
    if ids.ndim != 2:
        raise ValueError(f"Expected token ids (batch, length). Received: {ids.shape}")
    if cap is not None:
        ids = ids[:, :cap]
    columns = np.flatnonzero((ids != PAD_ID).any(axis=0))  # the non-empty ones
    longest = (int(columns[-1]) + 1 if columns.size else 0) + extra
    width = bucket_length(longest, cap)
    if width <= ids.shape[1]:
        return ids[:, :width]
    return np.pad(ids, [(0, 0), (0, width - ids.shape[1])])


def without_padding_columns(token_ids):
    """Dense ids `(B, W)` (a TensorFlow tensor, padding 0 at the end of each
    row) cut to the width of the longest row, at least 1 column: what a
    served batch of short texts needs instead of a fixed width. TensorFlow
    ops, eagerly or in a `tf.function`."""
    import tensorflow as tf

    token_ids = tf.convert_to_tensor(token_ids)
    columns = tf.range(1, tf.shape(token_ids)[1] + 1)
    used = tf.reduce_any(tf.not_equal(token_ids, PAD_ID), axis=0)  # (W,)
    width = tf.maximum(tf.reduce_max(tf.where(used, columns, 0)), 1)
    return token_ids[:, :width]


def map_batches(fn, texts, batch_size, verbose="auto", title="Predicting", length=len):
    """`fn(batch)` over `texts` in batches of `batch_size`, texts of similar
    `length` batched together (less padding), and the results back in the
    order of `texts`: a list, one item per text (`fn` returns a sequence of
    one result per text of its batch). A `keras.utils.Progbar` over the
    batches as `keras.Model.predict` shows it: `verbose` 1 a bar, 2 one line
    at the end, 0 nothing, `"auto"` a bar when there is more than one batch.
    Each batch's results are converted and kept, nothing else, so memory
    stays flat as `texts` grow."""
    from keras_attn._progress import progress_bar

    check_batch_size(batch_size)
    check_verbose(verbose)
    batches = -(-len(texts) // batch_size)  # rounded up
    if verbose == "auto":
        verbose = 1 if batches > 1 else 0
    # Longest first: a too-large batch fails at once, not at the end.
    order = sorted(range(len(texts)), key=lambda i: -length(texts[i]))
    results = [None] * len(texts)
    progress = progress_bar(title, batches, verbose) if batches else None
    for step, start in enumerate(range(0, len(texts), batch_size), start=1):
        indices = order[start : start + batch_size]
        found = list(fn([texts[i] for i in indices]))
        if len(found) != len(indices):
            raise RuntimeError(f"{len(found)} results for {len(indices)} texts")
        for index, result in zip(indices, found, strict=True):
            results[index] = result
        progress.update(step)
    return results


def cached(model, key, depends, build):
    """`build()`, kept on `model` under `key` (out of Keras' tracking) and
    rebuilt when any object of `depends` (say `model.tokenizer`) is no longer
    the one it was built from: so a tokenizer is built once, not per call,
    and setting `model.tokenizer` invalidates it."""
    store = model.__dict__.setdefault("_task_cache", {})
    found = store.get(key)
    if (
        found is None
        or len(found[0]) != len(depends)
        or any(a is not b for a, b in zip(found[0], depends, strict=True))
    ):
        found = store[key] = (tuple(depends), build())
    return found[1]


class WithoutPadding:
    """A `keras_attn.generation` next function whose logits never pick the
    padding id: a decoded 0 would be a token to the KV cache but padding to
    the model's own mask in a full pass (and to detokenizing), so the tasks'
    decodings choose among the other ids. (A class, not a closure: AutoGraph
    reads a function's source when it converts it.)"""

    def __init__(self, next_fn):
        self.next_fn = next_fn

    def __call__(self, token_ids, cache, index):
        logits, cache = self.next_fn(token_ids, cache, index)
        logits = keras.ops.cast(logits, "float32")  # the samplers read float32
        padding = keras.ops.one_hot(PAD_ID, logits.shape[-1], dtype="bool")
        return keras.ops.where(padding, -1e9, logits), cache


def compiled(model, key, build, *, depends=(), signature=None, others=()):
    """`build()` (a function of tensors) compiled for the backend and kept on
    `model` under `key`: `tf.function` on TensorFlow (with `signature`, the
    `(shape, dtype)` of each argument, one trace for every batch size),
    `jax.jit` reading the
    weights at each call on JAX, the function itself elsewhere; on
    TensorFlow with XLA when `model.jit_compile` is True (Keras's default
    for a model: True with a GPU, False without, as keras-hub's `generate`
    takes it; set `model.jit_compile = True` for XLA on a CPU); on
    TensorFlow and PyTorch it runs in a `generation.WeightsReadOnce` scope
    of the models (their weights read and cast once per call, not at every
    step of its loop). Rebuilt when
    the model's variables are no longer the ones it was compiled with
    (`quantize` replaces kernels; a trace would keep the old ones) or an
    object of `depends` (a sampler, a datastore) is no longer the same."""

    backend = keras.backend.backend()
    # keras-hub's `generate` takes the model's `jit_compile` on TensorFlow
    # (Keras resolves it to False on a machine without a GPU).
    jit_compile = backend == "tensorflow" and bool(model.jit_compile)

    def make():
        fn = build()
        if backend == "jax":
            return jit_reading_weights(model, fn, others)
        fn = ReadingWeightsOnce((model, *others), fn)
        if backend == "tensorflow":
            import tensorflow as tf

            # No AutoGraph, as Keras traces its own step and export functions:
            # the decodings loop with `keras.ops.while_loop`, and converting
            # their source took about a sixth of each trace.
            return tf.function(
                fn,
                input_signature=None
                if signature is None
                else [tf.TensorSpec(shape, dtype) for shape, dtype in signature],
                jit_compile=jit_compile,
                autograph=False,
            )
        return fn

    variables = [v for m in (model, *others) for v in m.variables]
    return cached(model, key, (*depends, jit_compile, *variables), make)


class ReadingWeightsOnce:
    """`fn(*args)` inside a `keras_attn.generation.WeightsReadOnce` scope of
    `models`: a decoding's weights read and cast once per call (a class, not
    a closure: AutoGraph reads a function's source when it converts it)."""

    def __init__(self, models, fn):
        self.models = tuple(models)
        self.fn = fn

    def __call__(self, *args, **kwargs):
        from keras_attn.generation.weights import WeightsReadOnce

        with WeightsReadOnce(self.models):
            return self.fn(*args, **kwargs)


def jit_reading_weights(model, fn, others=()):
    """`jax.jit(fn)` that reads `model`'s weights at each call: they are
    arguments of the compiled function (mapped onto the variables by a
    `keras.StatelessScope`), not constants of its trace, so weights trained or
    loaded after the first call are the ones used."""
    import jax

    variables = [v for m in (model, *others) for v in m.variables]

    def stateless(values, *args):
        with keras.StatelessScope(
            state_mapping=list(zip(variables, values, strict=True))
        ):
            return fn(*args)

    jitted = jax.jit(stateless)
    return lambda *args: jitted([variable.value for variable in variables], *args)


def bucket_rows(rows: int) -> int:
    """The rows a batch of `rows` is padded to for a compiled call whose
    shape is fixed (JAX): the next power of two, so a few batch sizes."""
    padded = 1
    while padded < rows:
        padded *= 2
    return padded


def compiled_forward(model, width: int):
    """`model(ids, training=False)` on int32 ids `(B, width)` as NumPy,
    compiled once per `width` and kept on `model`: `tf.function` on
    TensorFlow (one trace for every batch size), Keras' `predict_on_batch`
    on JAX (jitted; the rows are padded to `bucket_rows`, so a few shapes),
    an eager call elsewhere. On TensorFlow it is traced in
    `keras_attn.ops.serving_mode()`, as the exports are. With
    `bucket_length` widths a task method compiles a few shapes in all; the
    weights are read at each call, so training or loading weights later is
    seen."""
    import numpy as np

    def build():
        backend = keras.backend.backend()
        if backend == "tensorflow":
            import tensorflow as tf

            def serve(ids):
                with serving_mode():  # traced for inference: its layouts
                    return model(ids, training=False)

            forward = tf.function(
                serve,
                input_signature=[tf.TensorSpec([None, width], tf.int32)],
                autograph=False,
            )
            return lambda ids: keras.ops.convert_to_numpy(forward(ids))
        if backend == "jax":

            def forward(ids):
                rows = ids.shape[0]
                padding = [(0, bucket_rows(rows) - rows), (0, 0)]
                return model.predict_on_batch(np.pad(ids, padding))[:rows]

            return forward
        return lambda ids: keras.ops.convert_to_numpy(model(ids, training=False))

    # Rebuilt when the variables change (`quantize`): a trace keeps the old.
    return cached(model, ("compiled_forward", width), tuple(model.variables), build)


def serialize_assistant(assistant_model, tokenizer_keys):
    """The config of a task's own draft (`assistant_model`) without its
    tokenizers (`tokenizer_keys`: it decodes ids, the task's tokenizers are
    the text's), or the value itself when it is not a model (None,
    `"prompt_lookup"`)."""
    if not isinstance(assistant_model, keras.Model):
        return assistant_model
    config = keras.saving.serialize_keras_object(assistant_model)
    for key in tokenizer_keys:
        config["config"][key] = None
    return config


def deserialize_assistant(config):
    """`config` with its `assistant_model` deserialized where it is a
    model's config."""
    config = dict(config)
    assistant = config.get("assistant_model")
    if isinstance(assistant, dict):
        config["assistant_model"] = keras.saving.deserialize_keras_object(assistant)
    return config
