"""Training a draft (a student) on its target's logits: Keras's
`keras.distillation.Distiller` with a KL divergence computed from the
logits in float32, and the rate at which the draft's greedy choice is the
target's (what speculative decoding keeps)."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops


@keras.saving.register_keras_serializable(package="keras_attn")
class LogitsDistillation(keras.distillation.LogitsDistillation):
    """`keras.distillation.LogitsDistillation` with its KL divergence taken
    from the logits in float32.

    The loss is `temperature**2 * mean(KL(softmax(t / T) || softmax(s / T)))`
    over every position, the KL summed over the last axis, from
    `log_softmax` of the float32 logits. Keras 3.15's own class, with its
    default `loss="kl_divergence"`, resolves that name to the function
    `keras.losses.kl_divergence`, misses its own branch for a
    `keras.losses.KLDivergence` instance and applies the divergence to the
    logits themselves clipped into `[1e-7, 1]` (not a divergence of the
    distributions: about 32 where the true value is 0.04); given a
    `KLDivergence` instance it takes the softmax in the logits' dtype
    (bfloat16 under `mixed_bfloat16`) and clips the probabilities. The same
    arguments and configuration as Keras's class; only the KL divergence.
    `temperature` defaults to 1 (Keras's to 3): a draft for speculative
    decoding is checked against its target's own distribution.
    """

    def __init__(self, temperature=1.0, loss="kl_divergence"):
        if not (loss == "kl_divergence" or isinstance(loss, keras.losses.KLDivergence)):
            raise ValueError(
                "keras_attn's `LogitsDistillation` computes the KL divergence; "
                "for another loss use `keras.distillation.LogitsDistillation`. "
                f"Received: loss={loss!r}"
            )
        if not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(
                f"`temperature` must be a positive number. Received: "
                f"temperature={temperature!r}"
            )
        super().__init__(temperature=temperature, loss=keras.losses.KLDivergence())

    def compute_loss(self, teacher_outputs, student_outputs, **kwargs):
        temperature = self.temperature

        def divergence(teacher, student):
            teacher = ops.log_softmax(ops.cast(teacher, "float32") / temperature, -1)
            student = ops.log_softmax(ops.cast(student, "float32") / temperature, -1)
            per_position = ops.sum(ops.exp(teacher) * (teacher - student), axis=-1)
            return ops.mean(per_position)

        divergences = keras.tree.flatten(
            keras.tree.map_structure(divergence, teacher_outputs, student_outputs)
        )
        return ops.sum(ops.stack(divergences)) * temperature**2


def greedy_agreement(target, draft, dataset, ignore_class: int | None = 0) -> float:
    """The share of the targets of `dataset` (batches of `(inputs,
    targets)`, as `keras_attn.text.language_model_dataset` gives them) at
    which `draft`'s argmax over its logits is `target`'s: the chance that
    greedy speculative decoding keeps a guess (teacher forcing on real text;
    a decoding's own text may agree more or less). Targets equal to
    `ignore_class` (padding) are not counted."""

    def choice(model, inputs):
        return np.argmax(ops.convert_to_numpy(model(inputs, training=False)), -1)

    agree = total = 0
    for batch in dataset:
        inputs, targets = batch[0], ops.convert_to_numpy(batch[1])
        same = choice(target, inputs) == choice(draft, inputs)
        counted = (
            np.ones_like(same) if ignore_class is None else targets != ignore_class
        )
        agree += int(np.sum(same & counted))
        total += int(np.sum(counted))
    if total == 0:
        raise ValueError("`dataset` holds no target to compare the models on.")
    return agree / total
