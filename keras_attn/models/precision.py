"""`with_precision`: a copy of a task with its weights in a cheaper serving
precision (bfloat16, int8 or int4), for `export(..., precision=...)` and for
measuring what the cheaper model answers. Imports no TensorFlow."""

from __future__ import annotations

import keras

# What `with_precision` and the exports' `precision` option take.
PRECISIONS = ("float32", "bfloat16", "int8", "int4")
QUANTIZED = ("int8", "int4")

# The float policies a task's config may record (the task's own and its
# backbones'); tokenizers record "int32" or "string", which stay.
_FLOAT_POLICIES = ("float32", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16")

# The config entries holding tokenizers: the copy shares the task's (their
# vocabularies are assets, not part of the config).
_TOKENIZERS = ("tokenizer", "source_tokenizer", "target_tokenizer")


def check_precision(precision) -> str | None:
    """`precision` (None: the task as it is), or a `ValueError` naming it."""
    if precision is None or (isinstance(precision, str) and precision in PRECISIONS):
        return precision
    raise ValueError(
        f"`precision` must be one of {PRECISIONS} or None. Received: "
        f"precision={precision!r}"
    )


def with_precision(task, precision: str):
    """A copy of `task` with its weights in `precision`; `task` is unchanged.

    - `"float32"`: every layer in float32 (a task trained under
      `mixed_bfloat16` keeps float32 weights but computes in bfloat16; this
      copy computes in float32).
    - `"bfloat16"`: weights and compute in bfloat16 (half the bytes). Layer
      norms and the attention softmax still compute in float32 (Keras's
      `layer_normalization` and keras-attn's masked softmax upcast), and the
      task's output layer (the classifier's probability, a translator's
      logits) stays float32 as in every policy. Fast on CPUs with
      AVX-512 BF16 or AMX; elsewhere oneDNN converts.
    - `"int8"` / `"int4"`: the float32 copy quantized by the task's
      `quantize(mode)`: Keras's weight quantization of the layers the task
      quantizes (per-channel int8, or int4 packed two per byte), activations
      quantized per call; everything else stays float32.

    The copy shares the task's tokenizers. It is built from the task's
    config (so it is the same architecture), its weights copied from the
    task's (cast to `precision`).

    Args:
        task: a `keras_attn.models` task (`TextClassifier`,
            `TextClassifierEnsemble`, `TransformerTranslator`,
            `RNNTranslator`, `TransformerLanguageModel`), not quantized.
        precision: one of `PRECISIONS`.

    Returns:
        The new task.
    """
    precision = check_precision(precision)
    if precision is None:
        raise ValueError(
            f"`precision` must be one of {PRECISIONS}. Received: precision=None"
        )
    if not isinstance(task, keras.Model) or not hasattr(task, "serving_spec"):
        raise ValueError(
            "`task` must be a keras_attn task model. Received: task of type "
            f"{type(task).__name__}"
        )
    quantized = sorted(
        layer.path for layer in task._flatten_layers() if layer.quantization_mode
    )
    if quantized:
        raise ValueError(
            "`task` must not be quantized already (its float weights are "
            f"needed). Received: a task with {len(quantized)} quantized layers, "
            f"such as {quantized[0]!r}"
        )
    policy = "float32" if precision in QUANTIZED else precision
    config = _with_policy(task.get_config(), policy)
    for name in _TOKENIZERS:
        if name in config:
            config[name] = getattr(task, name, None)
    # A language model's own draft (not among its weights) is converted too.
    draft = getattr(task, "assistant_model", None)
    if isinstance(draft, keras.Model):
        config["assistant_model"] = None
    copy = type(task).from_config(config)
    copy.set_weights(task.get_weights())
    if precision in QUANTIZED:
        copy.quantize(precision)
    if isinstance(draft, keras.Model):
        copy.assistant_model = with_precision(draft, precision)
    return copy


def _with_policy(config, policy: str):
    """`config` (nested dicts and lists) with every float dtype policy
    replaced by `policy`, and the tokenizers of nested tasks (an ensemble's
    members, whose own tokenizers are not used) left out."""
    if isinstance(config, list):
        return [_with_policy(item, policy) for item in config]
    if not isinstance(config, dict):
        return config
    found = {}
    for key, value in config.items():
        if key == "dtype" and _is_float_policy(value):
            found[key] = policy
        elif key in _TOKENIZERS:
            found[key] = None
        else:
            found[key] = _with_policy(value, policy)
    return found


def _is_float_policy(value) -> bool:
    if isinstance(value, str):
        return value in _FLOAT_POLICIES
    if isinstance(value, dict) and value.get("class_name") == "DTypePolicy":
        return value.get("config", {}).get("name") in _FLOAT_POLICIES
    return False
