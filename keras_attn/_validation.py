"""Argument and shape checks shared by the layers, ops, models and samplers.

Every error names the argument and what was received, in the Keras style
"... Received: name=value".
"""

from __future__ import annotations

import math
import numbers


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def get_keras_object(name: str, value, kind: str):
    """A Keras initializer, regularizer or constraint from any of its forms
    (name, instance, config, `None` where Keras allows it), with the argument
    named in the error instead of Keras's "Could not interpret ..."."""
    import keras

    getter = {
        "initializer": keras.initializers.get,
        "regularizer": keras.regularizers.get,
        "constraint": keras.constraints.get,
    }[kind]
    try:
        return getter(value)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"`{name}` must be a Keras {kind} (a name, an instance or a "
            f"config). Received: {name}={value!r}"
        ) from error


def check_weight_options(**options) -> None:
    """Each `<weight>_initializer`, `_regularizer` and `_constraint` argument
    is one Keras takes, or a `ValueError` names it (`get_keras_object`)."""
    for name, value in options.items():
        get_keras_object(name, value, name.rsplit("_", 1)[-1])


def check_rate(name: str, value) -> float:
    """A rate or mixture weight in [0, 1) (a dropout rate, a cache's share)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0.0 <= value < 1.0
    ):
        raise ValueError(
            f"`{name}` must be a float in [0, 1). Received: {name}={value!r}"
        )
    return float(value)


def check_positive_int(name: str, value, allow_none: bool = False):
    """A positive integer (or `None` where allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer{' or None' if allow_none else ''}. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def check_size(name: str, value, allow_none: bool = False):
    """A head count or size: a positive int (or `None` where allowed), refused
    in Keras's words ("... argument `num_heads` ...") as the attention layers
    that stand in for Keras's refuse it."""
    if value is None and allow_none:
        return None
    if not is_int(value) or value < 1:
        raise ValueError(
            f"Received an invalid value for argument `{name}`, expected a "
            f"positive integer{' or `None`' if allow_none else ''}. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def check_tokenizer(name: str, tokenizer, allow_none: bool = True):
    """`tokenizer` if it is a keras-attn tokenizer (has `tokenize` and
    `get_config`), or `None` where allowed; else a `ValueError`."""
    if (tokenizer is None and allow_none) or (
        hasattr(tokenizer, "tokenize") and hasattr(tokenizer, "get_config")
    ):
        return tokenizer
    raise ValueError(
        f"`{name}` must be a keras_attn tokenizer (SubwordTokenizer, "
        f"WordPieceTokenizer){' or None' if allow_none else ''}. "
        f"Received: {name}={tokenizer!r}"
    )


def check_positive_float(name: str, value) -> float:
    """A finite number > 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0.0 < value < math.inf
    ):
        raise ValueError(
            f"`{name}` must be a positive number. Received: {name}={value!r}"
        )
    return float(value)


def check_choice(name: str, value, choices):
    """One of `choices`."""
    if value not in choices:
        raise ValueError(
            f"`{name}` must be one of {list(choices)}. Received: {name}={value!r}"
        )
    return value


def check_rank(name: str, shape, ranks) -> None:
    """`shape` has one of `ranks` dimensions."""
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if shape is None or len(shape) not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise ValueError(
            f"`{name}` must have rank {expected}. "
            f"Received: {name}.shape={None if shape is None else tuple(shape)}"
        )


def check_mask_shape(name: str, mask, expected_shape) -> None:
    """`mask` has `expected_shape`, ignoring unknown dimensions on either side."""
    if mask is None:
        return
    shape = tuple(mask.shape)
    expected_shape = tuple(expected_shape)
    compatible = len(shape) == len(expected_shape) and all(
        got is None or want is None or got == want
        for got, want in zip(shape, expected_shape, strict=True)
    )
    if not compatible:
        raise ValueError(
            f"`{name}` must have shape {expected_shape} (None: any size). "
            f"Received: {name}.shape={shape}"
        )


def same_dim(a, b) -> bool:
    """Two static dimensions that may be `None` agree."""
    return a is None or b is None or a == b
