"""Losses of the sequence tasks."""

from __future__ import annotations

import keras


@keras.saving.register_keras_serializable(package="keras_attn")
class SmoothedSparseCrossentropy(keras.losses.Loss):
    """Per-token cross-entropy with label smoothing on sparse targets.

    `(1 - label_smoothing) * nll + label_smoothing * mean(-log p)` over the
    vocabulary, from float32 logits. Padding is excluded by the sample
    weights of the dataset (0.0 on padded targets), which Keras also applies
    to the weighted metrics.
    """

    def __init__(self, label_smoothing=0.0, name="smoothed_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = label_smoothing

    def call(self, y_true, y_pred):
        ops = keras.ops
        y_true = ops.cast(y_true, "int32")
        log_probs = ops.log_softmax(ops.cast(y_pred, "float32"), axis=-1)
        nll = -ops.take_along_axis(log_probs, y_true[..., None], axis=-1)[..., 0]
        smooth = -ops.mean(log_probs, axis=-1)
        return (1 - self.label_smoothing) * nll + self.label_smoothing * smooth

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}
