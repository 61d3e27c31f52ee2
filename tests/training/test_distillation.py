"""keras_attn.training's distillation pieces: `LogitsDistillation` (Keras's
loss with the KL divergence from float32 logits), checked against a float64
reference and Keras's own class, inside `keras.distillation.Distiller`, and
`greedy_agreement`."""

import keras
import numpy as np
import pytest

from keras_attn.models import TransformerLanguageModel
from keras_attn.training import LogitsDistillation, greedy_agreement
from tests.test_case import to_numpy

RNG = np.random.default_rng(0)
TEACHER = (RNG.normal(size=(3, 5, 40)) * 2).astype("float32")
STUDENT = (TEACHER + RNG.normal(size=TEACHER.shape) * 0.5).astype("float32")


def reference_kl(teacher, student, temperature):
    """float64: T**2 * mean over positions of KL(p_t || p_s) at T."""

    def log_softmax(x):
        x = np.asarray(x, "float64") / temperature
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    t, s = log_softmax(teacher), log_softmax(student)
    return temperature**2 * np.mean(np.sum(np.exp(t) * (t - s), -1))


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_the_loss_is_the_kl_divergence_of_the_distributions(temperature):
    loss = LogitsDistillation(temperature=temperature)
    got = float(to_numpy(loss.compute_loss(TEACHER, STUDENT)))
    np.testing.assert_allclose(
        got, reference_kl(TEACHER, STUDENT, temperature), rtol=1e-5
    )
    # Keras's own class gives the same only with a `KLDivergence` instance.
    peer = keras.distillation.LogitsDistillation(
        temperature=temperature, loss=keras.losses.KLDivergence()
    )
    np.testing.assert_allclose(
        got, float(to_numpy(peer.compute_loss(TEACHER, STUDENT))), rtol=1e-4
    )
    assert float(to_numpy(loss.compute_loss(TEACHER, TEACHER))) == pytest.approx(
        0.0, abs=1e-6
    )


def test_half_precision_logits_are_divided_in_float32():
    """bfloat16 logits (a model under mixed_bfloat16): the divergence of
    those logits, taken in float32, so never negative."""
    teacher = keras.ops.cast(TEACHER, "bfloat16")
    student = keras.ops.cast(STUDENT, "bfloat16")
    got = float(to_numpy(LogitsDistillation().compute_loss(teacher, student)))
    want = reference_kl(
        to_numpy(keras.ops.cast(teacher, "float32")),
        to_numpy(keras.ops.cast(student, "float32")),
        1.0,
    )
    assert got > 0
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_configuration_round_trips():
    loss = LogitsDistillation(temperature=2.0)
    copy = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(loss)
    )
    assert type(copy) is LogitsDistillation and copy.temperature == 2.0
    np.testing.assert_allclose(
        to_numpy(copy.compute_loss(TEACHER, STUDENT)),
        to_numpy(loss.compute_loss(TEACHER, STUDENT)),
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss": "mse"}, "Received: loss='mse'"),
        ({"temperature": 0}, "Received: temperature=0"),
        ({"temperature": "2"}, "Received: temperature='2'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LogitsDistillation(**kwargs)


def language_model(num_layers, width, seed):
    keras.utils.set_random_seed(seed)
    return TransformerLanguageModel(
        30, sequence_length=12, embedding_dim=width, num_layers=num_layers,
        num_heads=2, intermediate_dim=2 * width,
    )  # fmt: skip


def test_a_distiller_brings_the_draft_to_its_target():
    """Keras's `Distiller` with this loss: the draft's divergence from the
    target and their disagreement fall, the target's weights do not move."""
    target, draft = language_model(2, 16, seed=1), language_model(1, 8, seed=2)
    ids = np.random.default_rng(3).integers(1, 30, size=(64, 12)).astype("int32")
    data = (ids, ids)
    before = target.get_weights()
    loss = LogitsDistillation()

    def divergence():
        return float(to_numpy(loss.compute_loss(target(ids), draft(ids))))

    start, start_agreement = divergence(), greedy_agreement(target, draft, [data])
    distiller = keras.distillation.Distiller(
        target, draft, loss, student_loss_weight=0.0
    )
    distiller.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    distiller.fit(ids, ids, batch_size=16, epochs=30, verbose=0)
    assert divergence() < 0.5 * start
    assert greedy_agreement(target, draft, [data]) > start_agreement
    for was, now in zip(before, target.get_weights(), strict=True):
        np.testing.assert_array_equal(was, now)


def test_greedy_agreement_counts_the_targets_that_are_not_padding():
    target, draft = language_model(2, 16, seed=1), language_model(1, 8, seed=2)
    ids = np.random.default_rng(4).integers(1, 30, size=(4, 12)).astype("int32")
    targets = ids.copy()
    targets[:, 9:] = 0  # padding
    same = np.argmax(to_numpy(target(ids)), -1) == np.argmax(to_numpy(draft(ids)), -1)
    want = same[:, :9].mean()
    assert greedy_agreement(target, draft, [(ids, targets)]) == pytest.approx(want)
    assert greedy_agreement(target, draft, [(ids, targets)], ignore_class=None) == (
        pytest.approx(same.mean())
    )
    assert greedy_agreement(target, target, [(ids, targets)]) == 1.0
    with pytest.raises(ValueError, match="no target"):
        greedy_agreement(target, draft, [(ids, np.zeros_like(ids))])
