"""The language model with rotary positions or ALiBi, grouped-query
attention and a sliding window: cached decoding, the config and a model file
loaded in a fresh process."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from keras import ops

from keras_attn.models import TransformerDecoderBackbone, TransformerLanguageModel
from tests.test_case import REPO_ROOT

VOCABULARY, CONTEXT = 40, 12


def language_model(position, **options):
    return TransformerLanguageModel(
        VOCABULARY,
        CONTEXT,
        embedding_dim=32,
        num_layers=2,
        num_heads=4,
        intermediate_dim=64,
        dropout=0.0,
        position=position,
        **options,
    )


def token_ids(seed=0):
    return (
        np.random.RandomState(seed).randint(1, VOCABULARY, (2, CONTEXT)).astype("int32")
    )


@pytest.mark.parametrize(
    "position, options",
    [
        ("rotary", {"num_key_value_heads": 2}),
        ("alibi", {"num_key_value_heads": 1, "sliding_window": 5}),
        ("rotary", {"sliding_window": 4}),
    ],
)
def test_cached_decoding_equals_the_whole_sequence(position, options):
    model = language_model(position, **options)
    ids = token_ids()
    full = np.asarray(ops.convert_to_numpy(model(ids)))
    cache = model.initial_cache(2, CONTEXT)
    heads = options.get("num_key_value_heads", 4)
    assert all(tuple(part.shape) == (2, CONTEXT, heads, 8) for c in cache for part in c)
    logits, cache = model.call_with_cache(ids[:, :5], cache, 0)  # a prompt
    steps = [np.asarray(ops.convert_to_numpy(logits))]
    for index in range(5, CONTEXT):
        logits, cache = model.call_with_cache(ids[:, index : index + 1], cache, index)
        steps.append(np.asarray(ops.convert_to_numpy(logits)))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=3e-5)


def test_positions_inside_the_attention_replace_the_position_table():
    model = language_model("rotary", num_key_value_heads=2)
    assert model.position == "rotary" and model.num_key_value_heads == 2
    assert model.backbone.embedding.position is None
    assert [w.path for w in model.backbone.embedding.weights] == [
        "decoder_backbone/embedding/token_embedding/embeddings"
    ]
    config = model.backbone.get_config()
    assert config["position"] == "rotary" and config["num_key_value_heads"] == 2
    assert "sliding_window" not in config  # only when set
    learned = language_model("learned").backbone.get_config()
    assert "num_key_value_heads" not in learned and "sliding_window" not in learned
    # Rotary positions shift with the sequence: the same tokens later in the
    # context attend as they did at its start (relative positions only).
    ids = token_ids(1)
    shifted = np.concatenate([ids[:, :1], ids[:, :-1]], axis=1)
    assert not np.allclose(
        ops.convert_to_numpy(model(ids))[:, -1],
        ops.convert_to_numpy(model(shifted))[:, -1],
    )


def test_a_backbone_and_sizes_are_not_both_taken():
    backbone = TransformerDecoderBackbone(
        VOCABULARY, CONTEXT, embedding_dim=32, num_layers=1, position="alibi"
    )
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        TransformerLanguageModel(backbone=backbone, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"`position` must be one of.*'relative'"):
        language_model("relative")


def test_a_saved_model_file_loads_in_a_fresh_process(tmp_path):
    model = language_model("alibi", num_key_value_heads=2, sliding_window=6)
    ids = token_ids(2)
    path = tmp_path / "model.keras"
    model.save(path)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "logits.npy", ops.convert_to_numpy(model(ids)))
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import keras
        import keras_attn  # registers the classes

        directory = sys.argv[1]
        model = keras.saving.load_model(directory + "/model.keras")
        ids = np.load(directory + "/ids.npy")
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(model(ids)),
            np.load(directory + "/logits.npy"), atol=1e-5)
        attention = model.backbone.blocks[0]._self_attention_layer
        assert attention.alibi_bias is not None, attention.get_config()
        assert attention.key_value_heads == 2 and attention.sliding_window == 6
        print(tuple(model.generate_ids(ids[:, :3], max_length=8).shape))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "(2, 8)"
