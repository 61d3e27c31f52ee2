"""`serving_mode`: a scope for inference graphs that no gradient flows
through, in which keras-attn's layers take the layouts that serve fastest on
TensorFlow's CPU kernels.

Inside it, TensorFlow calls of keras-attn's layers and ops:

- **skip padding in the encoder blocks**: a `TransformerEncoder` block called
  in inference with a padding mask runs its per-token sublayers (the
  residual adds, the layer norms, the feed-forward network: two thirds of a
  BERT block's products) on the real tokens' rows only, gathered into one
  `(R, d)` matrix, and scatters them back. A batch of texts of mixed lengths
  pays for its tokens, not for `batch * longest`, and the 2-D feed-forward
  products are fused with their bias, GELU and residual add by TensorFlow's
  oneDNN graph rewrite. The real tokens' outputs are those of the call
  outside the scope up to float rounding; the padded positions' outputs are
  zeros (outside the scope, whatever the network computes there: masked,
  and read by nothing that honours the mask).
- **move the attention heads as integers**: the explicit attention path's
  head transposes (`(B, T, N, H)` to `(B, N, T, H)` and back: four per layer
  call) run on the bits of the values (`tf.bitcast` to an integer type of the
  same width), which TensorFlow transposes with Eigen's kernel rather than
  oneDNN's, whose per-call set-up costs more than the copy on a served
  sentence's small tensors. The values are identical; `Bitcast` has no
  gradient, hence the scope.

Training calls (`training=True`) skip no padding, and other backends are
unchanged. `export_task` (every task's `export`) traces its signatures
inside it, and `TextClassifier.classify` its compiled forward.
"""

from __future__ import annotations

import contextlib
import threading

import keras
from keras import ops

_STATE = threading.local()

# The integer type of each float width, for `transpose`.
_BITS = {2: "int16", 4: "int32", 8: "int64"}


@contextlib.contextmanager
def serving_mode():
    """A scope for inference graphs that no gradient flows through: on
    TensorFlow, keras-attn's encoder blocks skip padded tokens in their
    per-token sublayers (their padded positions' outputs are zeros) and the
    attention heads move as integers (module docstring).

    It acts where a layer's call is traced or run: enter it around the
    `tf.function` trace of a serving function, or around an eager call.
    Nested scopes are allowed.

    Example:

    ```python
    tokens = keras.Input((None,), dtype="int32")
    x = keras_attn.layers.TokenAndPositionEmbedding(
        100, 16, 32, mask_zero=True
    )(tokens)
    x = keras_attn.layers.TransformerEncoder(intermediate_dim=64, num_heads=2)(x)
    encoder = keras.Model(tokens, x)
    ids = np.array([[5, 6, 7, 0], [8, 9, 0, 0]])
    with keras_attn.layers.serving_mode():
        outputs = encoder(ids)  # padded positions: 0
    ```
    """
    previous = getattr(_STATE, "active", False)
    _STATE.active = True
    try:
        yield
    finally:
        _STATE.active = previous


def in_serving_mode() -> bool:
    """Whether TensorFlow calls now take the serving layouts: inside
    `serving_mode()` on the TensorFlow backend."""
    return getattr(_STATE, "active", False) and keras.backend.backend() == "tensorflow"


def transpose(x, axes):
    """`ops.transpose(x, axes)`; in serving mode, a float tensor's bits
    transposed as integers of its width (the same values, no gradient)."""
    if in_serving_mode() and not isinstance(x, keras.KerasTensor):
        import tensorflow as tf

        x = tf.convert_to_tensor(x)
        bits = _BITS.get(x.dtype.size)
        if x.dtype.is_floating and bits is not None:
            return tf.bitcast(tf.transpose(tf.bitcast(x, bits), axes), x.dtype)
    return ops.transpose(x, axes)
