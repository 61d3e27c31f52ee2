"""The example scripts' extra-data options, offline on fixtures."""

import json

import pytest

from keras_attn.datasets import (
    assign_split,
    load_training_phrases,
    load_translation_pairs,
    movie_reviews,
    translation_pairs,
)
from tests.datasets.test_loaders import (
    fake_ding_fetch,
    fake_movie_fetch,
    fake_other_domains_fetch,
)
from tests.test_case import load_example

pytestmark = pytest.mark.tf_only


def load_script(name):
    return load_example(name)


@pytest.fixture
def ding_fixture(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_ATTN_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(translation_pairs, "_fetch", fake_ding_fetch)


def test_phrases_join_the_training_split_only(ding_fixture):
    script = load_script("translate")
    sentences = load_translation_pairs("de-en", alternatives="keep", verbose=False)
    splits = script.load_data(script.parse_args(["--phrases", "--pretrained", "none"]))

    assert splits.validation == sentences.validation
    assert splits.test == sentences.test
    assert splits.train[: len(sentences.train)] == sentences.train
    added = splits.train[len(sentences.train) :]
    everything = load_translation_pairs(
        "de-en", alternatives="keep", include_phrases=True, verbose=False
    )
    # The fixture's training bucket holds "to go by train", "to give sb. sth."
    assert set(added) == set(everything.train) - set(sentences.train)
    assert ("to go by train", "mit dem Zug fahren") in added
    assert {assign_split(english) for english, _ in added} == {"train"}
    held_out = {english for english, _ in sentences.validation + sentences.test}
    assert held_out.isdisjoint(english for english, _ in splits.train)


def test_phrases_need_the_default_data(capsys):
    script = load_script("translate")
    with pytest.raises(SystemExit):
        script.parse_args(["--phrases", "--data", "pairs.tsv"])
    assert "--phrases" in capsys.readouterr().err


def test_translate_refuses_a_negative_length_penalty(capsys):
    """Refused before any training, not when the beam search is built."""
    script = load_script("translate")
    with pytest.raises(SystemExit):
        script.parse_args(["--length-penalty", "-1"])
    assert "--length-penalty must be 0 or more. Received: -1" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--knn-k", "0,16"], "each value must be > 0. Received: '0,16'"),
        (["--knn-temperature", "30,0"], "each value must be > 0. Received: '30,0'"),
        (["--knn-lambda", "0.2,1"], "each value must be in [0, 1). Received: '0.2,1'"),
        (["--knn-k", "8.5"], "expected comma-separated ints. Received: '8.5'"),
        (
            ["--knn-length-penalty", "1,-0.5"],
            "each value must be >= 0. Received: '1,-0.5'",
        ),
    ],
)
def test_translate_refuses_bad_knn_settings(flags, message, capsys):
    script = load_script("translate")
    with pytest.raises(SystemExit):
        script.parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, conflict",
    [
        ([], "no --knn"),
        (["--knn", "--no-export"], "--no-export"),
        (["--knn", "--model", "rnn"], "--model rnn"),
    ],
)
def test_translate_refuses_to_export_knn_without_it(flags, conflict, capsys):
    script = load_script("translate")
    with pytest.raises(SystemExit):
        script.parse_args(["--export-knn", *flags])
    assert f"Received: --export-knn with {conflict}" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["translate", "sentiment", "language_model"])
def test_scripts_refuse_a_negative_weight_decay(name, capsys):
    script = load_script(name)
    assert script.parse_args(["--weight-decay", "0"]).weight_decay == 0.0
    with pytest.raises(SystemExit):
        script.parse_args(["--weight-decay", "-0.1"])
    assert "--weight-decay must be 0 or more. Received: -0.1" in (
        capsys.readouterr().err
    )


def test_translate_defaults_follow_the_model_and_the_encoder():
    script = load_script("translate")
    transformer = script.parse_args([])
    assert transformer.pretrained == "minilm" and transformer.size is None
    assert (transformer.learning_rate, transformer.lr_hold) == (3e-4, 0.5)
    rnn = script.parse_args(["--model", "rnn"])
    assert (rnn.pretrained, rnn.size, rnn.learning_rate) == ("none", "base", 1e-3)
    scratch = script.parse_args(["--pretrained", "none", "--dropout", "0.3"])
    assert (scratch.size, scratch.dropout, scratch.lr_hold) == ("base", 0.3, 0.8)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--pretrained", "minilm", "--model", "rnn"], "--model rnn"),
        (["--size", "small"], "--size"),
        (["--subword-sampling", "0.5"], "--subword-sampling"),
    ],
)
def test_translate_refuses_scratch_options_with_a_pretrained_encoder(
    flags, named, capsys
):
    script = load_script("translate")
    with pytest.raises(SystemExit) as raised:
        script.parse_args(flags)
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert (
        f"{named} apply to translators trained from scratch: add --pretrained none"
    ) in error
    assert f"Received: {named} with --pretrained minilm" in error


def test_translate_refuses_a_pretrained_name_that_is_no_directory(tmp_path, capsys):
    script = load_script("translate")
    with pytest.raises(SystemExit):
        script.parse_args(["--pretrained", str(tmp_path / "nowhere")])
    assert (
        "--pretrained takes minilm, none or a BERT checkpoint directory. "
        f"Received: '{tmp_path / 'nowhere'}' (not a directory)"
    ) in capsys.readouterr().err


def test_subword_sampling_refuses_a_negative_alpha(capsys):
    script = load_script("translate")
    assert script.parse_args([]).subword_sampling == 0.0  # off
    with pytest.raises(SystemExit):
        script.parse_args(["--subword-sampling", "-0.5"])
    assert "--subword-sampling must be 0 (off) or a positive alpha" in (
        capsys.readouterr().err
    )


def test_extra_domains_join_the_training_split_only(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_ATTN_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(movie_reviews, "_fetch", fake_movie_fetch)
    # The movie fixture stands in for every other domain.
    monkeypatch.setattr(movie_reviews, "_fetch_other_domains", fake_other_domains_fetch)
    script = load_script("sentiment")
    movies = script.load_data(script.parse_args([]))
    both = script.load_data(script.parse_args(["--extra-domains", "amazon,tweets"]))
    assert (both.validation, both.test) == (movies.validation, movies.test)
    assert both.train == movies.train * 3  # the fixture stands in for each domain


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--extra-domains", "amazon,imdb"], "Received: ['imdb']"),
        (["--extra-domains", "nyt", "--data", "reviews.tsv"], "--data reviews.tsv"),
    ],
)
def test_extra_domains_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_script("sentiment").parse_args(argv)
    error = capsys.readouterr().err
    assert "--extra-domains" in error and message in error


def test_sentiment_defaults_follow_the_encoder():
    script = load_script("sentiment")
    pretrained = script.parse_args([])
    assert pretrained.pretrained == "minilm"
    assert (pretrained.learning_rate, pretrained.ensemble, pretrained.epochs) == (
        5e-5,
        1,
        3,
    )
    assert (pretrained.pooling, pretrained.dropout) == ("mean", 0.1)
    assert pretrained.embedding_dim is None  # fixed by the encoder
    scratch = script.parse_args(["--pretrained", "none"])
    assert (scratch.learning_rate, scratch.ensemble, scratch.epochs) == (1e-3, 5, 10)
    assert (scratch.pooling, scratch.dropout) == ("attention", 0.3)
    assert (scratch.vocabulary_size, scratch.embedding_dim, scratch.num_layers) == (
        8000,
        128,
        1,
    )
    # What is given wins; --smoke trains one epoch.
    given = script.parse_args(["--learning-rate", "2e-5", "--epochs", "2"])
    assert (given.learning_rate, given.epochs) == (2e-5, 2)
    assert script.parse_args(["--smoke"]).epochs == 1
    assert (
        script.parse_args(["--pretrained", "none", "--num-layers", "2"]).num_layers == 2
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--embedding-dim", "64"],
            "--embedding-dim set the size of a classifier trained from scratch "
            "(--pretrained none); a pretrained encoder fixes it. Received: "
            "--embedding-dim with --pretrained minilm",
        ),
        (
            ["--vocabulary-size", "400", "--num-heads", "2"],
            "--vocabulary-size, --num-heads set the size",
        ),
        (
            ["--pretrained", "no/such/dir"],
            "--pretrained takes minilm, none or a BERT checkpoint directory. "
            "Received: 'no/such/dir' (not a directory)",
        ),
    ],
)
def test_sentiment_refuses_mismatched_encoder_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_script("sentiment").parse_args(argv)
    assert message in capsys.readouterr().err


# 45 s: the datastore's count is tested in tests/memory, the flag's wiring here.
@pytest.mark.large
def test_knn_phrases_put_the_phrase_pairs_in_the_datastore(
    ding_fixture, tmp_path, capsys
):
    """--knn-phrases: one datastore entry per target token of the training
    sentences and of the training split's phrase pairs."""
    from keras_attn.text import SubwordTokenizer

    script = load_script("translate")
    out = tmp_path / "run"
    script.main(
        [
            *("--smoke", "--pretrained", "none", "--knn", "--knn-phrases"),
            "--no-export",
            *("--knn-k", "1", "--knn-temperature", "10", "--knn-lambda", "0.1"),
            *("--knn-length-penalty", "1", "--out", str(out), "--verbose", "2"),
        ]
    )
    run = json.loads((out / "metrics.json").read_text())
    sentences = load_translation_pairs("de-en", alternatives="keep", verbose=False)
    phrases = load_training_phrases(sentences, "keep")
    assert (
        phrases and f"{len(phrases):,} phrase pairs as well" in capsys.readouterr().out
    )
    german = SubwordTokenizer(out / "vocab" / "en_de.model")
    max_length = run["config"]["max_length"]
    expected = sum(
        min(len(german.tokenize(target).numpy()) + 1, max_length)
        for _, target in sentences.train + phrases
    )
    assert run["metrics"]["knn"]["datastore_entries"] == expected


def test_knn_phrases_need_the_default_data(capsys):
    script = load_script("translate")
    with pytest.raises(SystemExit):
        script.parse_args(["--knn-phrases", "--data", "pairs.tsv"])
    assert (
        "--knn-phrases adds the Ding phrase pairs and needs the default data. "
        "Received: --data pairs.tsv"
    ) in capsys.readouterr().err


def test_the_scripts_defaults_are_the_named_configurations():
    """The sizes and recipes of keras_attn.models.configs, not copies."""
    from keras_attn.models import configs

    scratch = configs.config("translator", "base")
    args = load_script("translate").parse_args(["--pretrained", "none"])
    assert (args.learning_rate, args.lr_hold, args.dropout) == (
        scratch["training"]["learning_rate"],
        scratch["training"]["lr_hold"],
        scratch["model"]["dropout"],
    )
    assert (args.vocabulary_size, args.max_length, args.batch_size) == (
        scratch["data"]["vocabulary_size"],
        scratch["data"]["max_length"],
        scratch["training"]["batch_size"],
    )
    classifier = configs.config("text_classifier", "small")
    args = load_script("sentiment").parse_args(["--pretrained", "none"])
    assert (args.embedding_dim, args.ensemble, args.weight_decay) == (
        classifier["model"]["embedding_dim"],
        classifier["training"]["ensemble"],
        classifier["training"]["weight_decay"],
    )
    model = configs.config("language_model", "small")
    args = load_script("language_model").parse_args([])
    assert (args.num_layers, args.sequence_length, args.learning_rate) == (
        model["model"]["num_layers"],
        model["model"]["sequence_length"],
        model["training"]["learning_rate"],
    )


def test_the_translator_is_built_from_its_configuration(small_tokenizer):
    from keras_attn.models import RNNTranslator, TransformerTranslator, configs

    script = load_script("translate")
    tokenizers = {
        "source_tokenizer": small_tokenizer,
        "target_tokenizer": small_tokenizer,
    }
    size = small_tokenizer.vocabulary_size
    for argv, task, cls in [
        (
            ["--pretrained", "none", "--size", "small"],
            "translator",
            TransformerTranslator,
        ),
        (["--model", "rnn", "--size", "small"], "rnn_translator", RNNTranslator),
    ]:
        model = script.build(script.parse_args(argv), tokenizers)
        config = configs.config(task, argv[-1])["model"]
        reference = cls(size, size, **config)
        assert type(model) is cls and model.count_params() == reference.count_params()
