"""`keras_attn.generation.get`, `serialize` and `deserialize`: keras-hub's
`keras_hub.samplers` functions for keras-attn's samplers."""

import json

import keras
import pytest

from keras_attn import generation
from keras_attn.generation.serialization import compile_key

SAMPLERS = {
    "beam": generation.BeamSampler,
    "greedy": generation.GreedySampler,
    "random": generation.RandomSampler,
    "top_k": generation.TopKSampler,
    "top_p": generation.TopPSampler,
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_get_by_name_gives_the_class_with_its_defaults(name):
    sampler = generation.get(name)
    assert type(sampler) is SAMPLERS[name]
    assert sampler.get_config() == SAMPLERS[name]().get_config()


def test_keras_hub_names_match():
    keras_hub = pytest.importorskip("keras_hub")
    for name, cls in SAMPLERS.items():
        assert type(keras_hub.samplers.get(name)).__name__ == cls.__name__


@pytest.mark.parametrize(
    "sampler",
    [
        generation.TopKSampler(k=12, temperature=0.7, seed=3),
        generation.TopPSampler(p=0.8, k=20),
        generation.RandomSampler(temperature=2.0),
        generation.GreedySampler(),
        generation.BeamSampler(beam_width=3, length_penalty=0.6, return_all_beams=True),
    ],
    ids=lambda sampler: type(sampler).__name__,
)
def test_serialize_and_deserialize_round_trip(sampler):
    config = generation.serialize(sampler)
    config = json.loads(json.dumps(config))  # JSON, as a preset or metadata holds it
    again = generation.deserialize(config)
    assert type(again) is type(sampler)
    assert again.get_config() == sampler.get_config()
    assert generation.get(config).get_config() == sampler.get_config()


def test_get_takes_configs_classes_and_samplers():
    sampler = generation.get({"class_name": "top_p", "config": {"p": 0.5}})
    assert isinstance(sampler, generation.TopPSampler) and sampler.p == 0.5
    sampler = generation.get({"class_name": "TopKSampler", "config": {"k": 2}})
    assert isinstance(sampler, generation.TopKSampler) and sampler.k == 2
    assert isinstance(
        generation.get(generation.RandomSampler), generation.RandomSampler
    )
    made = generation.TopKSampler()
    assert generation.get(made) is made
    assert generation.get(None) is None


@pytest.mark.parametrize(
    ("identifier", "message"),
    [
        ("Top_K", r"one of \['beam', 'greedy', 'random', 'top_k', 'top_p'\].*'Top_K'"),
        ("contrastive", r"Received: sampler='contrastive'"),
        (3, r"sampler, its name or its config. Received: sampler=3"),
        (int, r"Received: sampler=<class 'int'>"),
    ],
)
def test_get_refuses_what_is_not_a_sampler(identifier, message):
    with pytest.raises(ValueError, match=message):
        generation.get(identifier)


def test_deserialize_refuses_a_config_of_another_kind():
    with pytest.raises(ValueError, match="`config` must describe a keras_attn"):
        generation.deserialize(
            keras.saving.serialize_keras_object(keras.layers.Dense(2))
        )
    with pytest.raises(ValueError, match="`sampler` must be a keras_attn"):
        generation.serialize("top_k")
    with pytest.raises(ValueError, match=r"Received: config=\{'class_name': 'top_kk'"):
        generation.get({"class_name": "top_kk", "config": {}})
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'q'"):
        generation.get({"class_name": "top_p", "config": {"q": 0.5}})
    with pytest.raises(ValueError, match=r"`k` must be a positive int"):
        generation.get({"class_name": "top_k", "config": {"k": 0}})


def test_compile_key_is_the_config_without_the_seed():
    key, depends = compile_key(generation.TopKSampler(k=4, seed=1))
    assert depends == ()
    assert key == compile_key(generation.TopKSampler(k=4, seed=2))[0]
    assert key == compile_key(generation.TopKSampler(k=4))[0]
    assert key != compile_key(generation.TopKSampler(k=5))[0]
    assert key != compile_key(generation.TopPSampler(k=4, p=1.0))[0]

    class Mine(generation.TopKSampler):
        pass

    mine = Mine(k=4)
    key, depends = compile_key(mine)
    assert depends == (mine,)
    assert key != compile_key(Mine(k=4))[0]
