"""The optional dependencies of keras-attn, and the error that names the extra
to install when one is missing.

The core (`pip install keras-attn`) needs Keras and NumPy only: `layers`,
`ops`, `generation`, `models`, `memory`, `datasets`, `checkpoints` and
`training` import without TensorFlow. The modules that need more check it at
their own import with `require`, so that a missing package shows at the
import, never after training:

- `keras_attn.text` needs TensorFlow and TensorFlow Text: the `text` extra;
- `keras_attn.export` also TF Serving's API protos: the `export` extra;
- `keras_attn.visualize` needs matplotlib: the `visualize` extra;
- the example scripts (which train, evaluate, plot and export) need all of
  that and sacrebleu: the `examples` extra.
"""

from __future__ import annotations

import importlib

# The extras of setup.cfg, and the modules each one provides (import names).
EXTRAS = {
    "text": ("tensorflow", "tensorflow_text", "sentencepiece"),
    "export": ("tensorflow", "tensorflow_text", "tensorflow_serving"),
    "visualize": ("matplotlib",),
    "examples": (
        "tensorflow",
        "tensorflow_text",
        "sentencepiece",
        "tensorflow_serving",
        "sacrebleu",
        "matplotlib",
    ),
}

# How a module's absence is described (its distribution's name on PyPI).
_DISTRIBUTIONS = {
    "tensorflow": "TensorFlow",
    "tensorflow_text": "TensorFlow Text",
    "tensorflow_serving": "tensorflow-serving-api",
    "sentencepiece": "sentencepiece",
    "sacrebleu": "sacrebleu",
    "matplotlib": "matplotlib",
}


def missing_extra_error(
    user: str, extra: str, module: str, error: BaseException
) -> ImportError:
    """The `ImportError` for `user` (what needs it), missing `module` of `extra`.

    The message names what is missing, the command that installs it, and the
    original error: "keras_attn.export needs TensorFlow: pip install
    'keras-attn[export]'. Received: ModuleNotFoundError(...)".
    """
    if extra not in EXTRAS:
        raise ValueError(
            f"`extra` must be one of {sorted(EXTRAS)}. Received: extra={extra!r}"
        )
    what = _DISTRIBUTIONS.get(module.split(".")[0], module)
    return ImportError(
        f"{user} needs {what}: pip install 'keras-attn[{extra}]' "
        f"(from a checkout: pip install -e '.[{extra}]'). Received: {error!r}"
    )


def require(user: str, extra: str, modules: tuple[str, ...] | None = None) -> None:
    """Import each of `modules` (default: those of `extra`), raising
    `missing_extra_error` for the first that cannot be imported.

    Args:
        user: what needs the modules, for the message (`"keras_attn.export"`).
        extra: the extra of setup.cfg that installs them.
        modules: import names; default `EXTRAS[extra]`.

    Raises:
        ImportError: a module is missing; the message names `extra`.
    """
    if extra not in EXTRAS:
        raise ValueError(
            f"`extra` must be one of {sorted(EXTRAS)}. Received: extra={extra!r}"
        )
    for module in EXTRAS[extra] if modules is None else modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise missing_extra_error(user, extra, module, error) from error
