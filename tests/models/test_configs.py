"""`keras_attn.models.configs`: the named configurations of the task models
(sizes and training defaults, no weights)."""

import pytest

from keras_attn import models
from keras_attn.models import configs
from tests.test_case import write_bert_checkpoint

RECIPE_KEYS = {"learning_rate", "weight_decay", "clipnorm", "decay_alpha"}
RUN_KEYS = {"batch_size", "epochs", "minutes"}


def all_configs():
    return [
        (task, name)
        for task in configs.config_tasks()
        for name in configs.config_names(task)
    ]


def test_the_tasks_and_their_names():
    assert configs.config_tasks() == (
        "language_model",
        "rnn_translator",
        "text_classifier",
        "translator",
    )
    assert configs.config_names("translator") == ("tiny", "small", "base", "minilm")
    assert configs.config_names("rnn_translator") == ("tiny", "small", "base")
    assert configs.config_names("text_classifier") == ("small", "minilm")
    assert configs.config_names("language_model") == ("small",)
    assert models.configs is configs


@pytest.mark.parametrize("task, name", all_configs())
def test_every_configuration_has_its_parts(task, name):
    config = configs.config(task, name)
    assert set(config) == {"class_name", "pretrained", "model", "data", "training"}
    assert hasattr(models, config["class_name"])
    assert config["pretrained"] in (None, "minilm")
    assert RECIPE_KEYS | RUN_KEYS <= set(config["training"])
    assert config["training"]["learning_rate"] > 0


def test_the_sizes_grow_and_the_recipe_is_shared():
    sizes = [
        configs.config("translator", name)["model"]
        for name in ("tiny", "small", "base")
    ]
    assert [size["embedding_dim"] for size in sizes] == [32, 128, 256]
    assert [size["num_encoder_layers"] for size in sizes] == [1, 2, 3]
    assert [size["num_heads"] for size in sizes] == [2, 4, 8]
    assert [size["intermediate_dim"] for size in sizes] == [64, 512, 1024]
    base = configs.config("translator", "base")
    assert configs.config("translator", "small")["training"] == base["training"]
    rnn = configs.config("rnn_translator", "base")["model"]
    assert (rnn["embedding_dim"], rnn["units"]) == (256, 512)


def test_a_configuration_is_a_copy_to_change_freely():
    config = configs.config("translator", "base")
    config["model"]["embedding_dim"] = 1
    config["training"].clear()
    fresh = configs.config("translator", "base")
    assert fresh["model"]["embedding_dim"] == 256 and fresh["training"]


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: configs.config("summarizer", "base"),
            "`task` must be one of ['language_model', 'rnn_translator', "
            "'text_classifier', 'translator']. Received: task='summarizer'",
        ),
        (
            lambda: configs.config("translator", "large"),
            "`name` must be one of ['tiny', 'small', 'base', 'minilm']. "
            "Received: name='large'",
        ),
        (lambda: configs.config_names("lm"), "Received: task='lm'"),
    ],
)
def test_unknown_names_are_refused_with_the_choices(call, message):
    with pytest.raises(ValueError) as raised:
        call()
    assert message in str(raised.value)


def build(task, name, vocabulary=64, checkpoint=None):
    """The model of a configuration, as its docstring says to build it."""
    config = configs.config(task, name)
    cls = getattr(models, config["class_name"])
    if checkpoint is not None:
        vocabularies = (vocabulary,) if task == "translator" else ()
        return cls.from_bert(checkpoint, *vocabularies, **config["model"])
    if task.endswith("translator"):
        return cls(vocabulary, vocabulary, **config["model"])
    return cls(vocabulary, **config["model"])


@pytest.mark.parametrize(
    "task, name",
    [(task, name) for task, name in all_configs() if name != "minilm"],
)
def test_every_configuration_from_scratch_builds_its_model(task, name):
    model = build(task, name)
    assert type(model).__name__ == configs.config(task, name)["class_name"]
    assert model.count_params() > 0


def test_larger_sizes_have_more_parameters():
    for task in ("translator", "rnn_translator"):
        counts = [
            build(task, name).count_params() for name in ("tiny", "small", "base")
        ]
        assert counts == sorted(set(counts)), task


@pytest.mark.parametrize("task", ["translator", "text_classifier"])
def test_the_pretrained_configurations_build_with_from_bert(task, tmp_path):
    from keras_attn.checkpoints import load_bert_checkpoint

    checkpoint = load_bert_checkpoint(write_bert_checkpoint(tmp_path / "bert"))
    model = build(task, "minilm", checkpoint=checkpoint)
    assert type(model).__name__ == configs.config(task, "minilm")["class_name"]
