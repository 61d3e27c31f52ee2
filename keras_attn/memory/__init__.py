"""Memories a trained model reads at inference: kNN-MT and the continuous cache.

- Nearest neighbours (kNN-LM, kNN-MT: Khandelwal et al. 2020, 2021):
  `nearest_neighbors` (exact, chunked search), `knn_weights`,
  `knn_probabilities`, `knn_mixture_log_probs`.
- kNN-MT for the Transformer translator: `translation_datastore`,
  `TranslationDatastore`, `NearestNeighborDecoding` (pass it to
  `translate(..., nearest_neighbors=)` or `export`), `choose_knn` (the
  setting chosen on validation references), `translation_states`,
  `knn_target_log_probs`.
- The continuous cache of a language model (Grave et al. 2017):
  `continuous_cache_stream_probabilities` (one chunked implementation,
  eager and in a traced graph), `continuous_cache_mixture`,
  `continuous_cache_log_probs`, `ContinuousCache`, `choose_continuous_cache`.
- `grid_search`: the validation search both choices use.

Everything here runs in `keras.ops` (no TensorFlow).
"""

from keras_attn.memory.continuous_cache import (
    ContinuousCache,
    choose_continuous_cache,
    continuous_cache_log_probs,
    continuous_cache_mixture,
    continuous_cache_probabilities,
    continuous_cache_stream_probabilities,
)
from keras_attn.memory.knn_mt import (
    NearestNeighborDecoding,
    TranslationDatastore,
    choose_knn,
    knn_target_log_probs,
    translation_datastore,
    translation_states,
)
from keras_attn.memory.nearest_neighbors import (
    knn_mixture_log_probs,
    knn_probabilities,
    knn_weights,
    nearest_neighbors,
)
from keras_attn.memory.search import grid_search

__all__ = [
    "ContinuousCache",
    "NearestNeighborDecoding",
    "TranslationDatastore",
    "choose_continuous_cache",
    "choose_knn",
    "continuous_cache_log_probs",
    "continuous_cache_mixture",
    "continuous_cache_probabilities",
    "continuous_cache_stream_probabilities",
    "grid_search",
    "knn_mixture_log_probs",
    "knn_probabilities",
    "knn_target_log_probs",
    "knn_weights",
    "nearest_neighbors",
    "translation_datastore",
    "translation_states",
]
