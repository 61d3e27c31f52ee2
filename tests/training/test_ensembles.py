"""`fit_ensemble`: members trained one after another, each with its own
seed, directory, early stop and share of the time budget."""

import contextlib
import random

import keras
import numpy as np
import pytest

from keras_attn import training
from keras_attn.training import fit as fit_module


def data():
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


class Builder:
    """Builds small classifiers and records what each build saw."""

    def __init__(self):
        self.draws = []

    def __call__(self, index):
        self.draws.append(random.random())  # seeded per member
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid")],
            name=f"member_{index}",
        )
        model.compile(
            training.make_optimizer(1e-2), "binary_crossentropy", metrics=["accuracy"]
        )
        return model


def seed_draw(seed):
    keras.utils.set_random_seed(seed)
    return random.random()


@pytest.mark.tf_only
def test_each_member_gets_its_seed_directory_and_budget_share(tmp_path):
    build = Builder()
    train = data()
    result = training.fit_ensemble(
        build,
        train,
        train,
        tmp_path / "members",
        num_members=3,
        seed=7,
        minutes=30.0,
        epochs=2,
        tensorboard=False,
        verbose=0,
    )
    assert isinstance(result, training.EnsembleFit)
    assert [member.name for member in result.members] == [
        "member_0",
        "member_1",
        "member_2",
    ]
    # Member i is built right after set_random_seed(seed + i).
    assert build.draws == [seed_draw(7), seed_draw(8), seed_draw(9)]
    kernels = [member.layers[0].kernel.numpy() for member in result.members]
    assert not np.allclose(kernels[0], kernels[1])
    for index, fit in enumerate(result.fits):
        assert (tmp_path / "members" / str(index) / "done.json").exists()
        assert fit.budget.budget == pytest.approx(10.0 * 60)  # 30 minutes / 3
        assert fit.steps == 4 and not fit.skipped
    assert result.seconds == pytest.approx(sum(fit.seconds for fit in result.fits))
    assert result.stopped_by_time_budget is False
    assert result.final_train_losses == [fit.final_train_loss for fit in result.fits]

    # A rerun skips the finished members and loads their best weights.
    again = training.fit_ensemble(
        Builder(), train, train, tmp_path / "members", num_members=3, seed=7, epochs=2
    )
    assert all(fit.skipped for fit in again.fits) and again.seconds == 0.0
    for before, after in zip(result.members, again.members, strict=True):
        np.testing.assert_array_equal(
            before.layers[0].kernel.numpy(), after.layers[0].kernel.numpy()
        )


@pytest.mark.tf_only
def test_patience_adds_an_early_stop_on_the_monitor(tmp_path, monkeypatch):
    made = []
    standard_callbacks = fit_module.standard_callbacks

    def recording(*args, **kwargs):
        made.append(kwargs)
        return standard_callbacks(*args, **kwargs)

    monkeypatch.setattr(fit_module, "standard_callbacks", recording)
    train = data()
    options = {"epochs": 1, "tensorboard": False, "verbose": 0}
    training.fit_ensemble(
        Builder(), train, train, tmp_path / "a", num_members=2, patience=3, **options
    )
    training.fit_ensemble(
        Builder(), train, train, tmp_path / "b", num_members=1, **options
    )
    stops = [call["stoppers"] for call in made]
    assert [len(stop) for stop in stops] == [1, 1, 0]
    assert stops[0][0] is not stops[1][0]  # one early stop per member
    stop = stops[0][0]
    assert isinstance(stop, keras.callbacks.EarlyStopping)
    assert (stop.monitor, stop.patience) == ("val_accuracy", 3)
    assert all(call["mode"] == "max" for call in made)


@pytest.mark.tf_only
def test_members_are_built_under_the_strategys_scope(tmp_path):
    class Strategy:
        entered = 0

        @contextlib.contextmanager
        def scope(self):
            self.entered += 1
            yield

    strategy, train = Strategy(), data()
    training.fit_ensemble(
        Builder(),
        train,
        train,
        tmp_path,
        num_members=2,
        strategy=strategy,
        epochs=1,
        tensorboard=False,
        verbose=0,
    )
    assert strategy.entered == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_members": 0}, "`num_members` must be a positive integer"),
        ({"num_members": 2.0}, "`num_members` must be a positive integer"),
        ({"patience": -1}, "`patience` must be an int >= 0 or None"),
        ({"stoppers": ()}, "makes each member's early stop from `patience`"),
    ],
)
def test_bad_arguments_are_named_before_any_training(kwargs, message):
    built = []
    arguments = {"num_members": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        training.fit_ensemble(built.append, None, None, "unused", epochs=1, **arguments)
    assert built == []
