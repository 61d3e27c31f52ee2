"""Nearest-neighbour machine translation (kNN-MT) for the Transformer translator.

Khandelwal, Fan, Jurafsky, Zettlemoyer and Lewis, "Nearest Neighbor Machine
Translation" (ICLR 2021). A trained translator reads its training pairs once
more, teacher-forced, and a datastore keeps the decoder's last hidden state at
every target position with the token that came next. While decoding, each
step's hidden state looks up its `k` nearest states in the datastore; their
next tokens get `softmax(-squared distance / temperature)`, and the step's
distribution is `(1 - lam) * p_model + lam * p_knn` (the search and the
mixture are `keras_attn.memory.nearest_neighbors`). Nothing is trained: `k`,
`temperature` and `lam` are chosen on held-out pairs by the mixture's
log-likelihood of their references (`choose_knn`).

    store = translation_datastore(translator, train_batches)
    knn, report = choose_knn(translator, store, validation_batches)
    translator.translate(["Where is the station?"], nearest_neighbors=knn)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import keras
import numpy as np
from keras import ops

from keras_attn import _validation as v
from keras_attn.memory.nearest_neighbors import (
    knn_mixture_log_probs,
    knn_probabilities,
    knn_weights,
    nearest_neighbors,
)
from keras_attn.memory.search import grid_search

KEY_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, eq=False)
class TranslationDatastore:
    """The decoder states of a translator over target text, and what followed.

    Attributes:
        keys: `(N, d)` float32, the decoder's last hidden state at each
            target position (what its output projection reads).
        values: `(N,)` int32, the target token at that position (the token
            the state predicts).
        vocabulary_size: the target vocabulary's size (every value is below).
    """

    keys: np.ndarray
    values: np.ndarray
    vocabulary_size: int

    def __post_init__(self):
        keys = np.asarray(self.keys, dtype="float32")
        values = np.asarray(self.values)
        v.check_positive_int("vocabulary_size", self.vocabulary_size)
        if keys.ndim != 2 or len(keys) == 0:
            raise ValueError(
                "`keys` must be a non-empty (entries, dim) array. "
                f"Received: keys.shape={keys.shape}"
            )
        if values.shape != (len(keys),) or not np.issubdtype(values.dtype, np.integer):
            raise ValueError(
                f"`values` must be {len(keys)} integers, one per key. "
                f"Received: values.shape={values.shape}, dtype={values.dtype}"
            )
        if values.min() < 0 or values.max() >= self.vocabulary_size:
            raise ValueError(
                f"`values` must be token ids in [0, {self.vocabulary_size}). "
                f"Received: ids from {values.min()} to {values.max()}"
            )
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "values", values.astype("int32"))

    def __len__(self) -> int:
        return len(self.values)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the datastore to a `.npz` file; returns its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            np.savez(
                handle,
                keys=self.keys,
                values=self.values,
                vocabulary_size=np.int64(self.vocabulary_size),
            )
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TranslationDatastore:
        """A datastore written by `save`."""
        with np.load(path) as data:
            return cls(data["keys"], data["values"], int(data["vocabulary_size"]))


def _batches_with_targets(dataset):
    for batch in dataset:
        if not isinstance(batch, tuple | list) or len(batch) not in (2, 3):
            raise ValueError(
                "`dataset` must yield `(inputs, targets)` or `(inputs, targets, "
                "sample_weight)` batches, as `translation_dataset` does. "
                f"Received: a batch of type {type(batch).__name__}"
            )
        yield batch[0], batch[1]


def translation_states(translator, dataset, *, log_probs: bool = False) -> dict:
    """A Transformer translator's teacher-forced decoder states at every
    non-padding target of `dataset` (id != 0, the end token included).

    Args:
        translator: a `keras_attn.models.TransformerTranslator` (anything
            with `call_with_states(inputs) -> (states, logits)`).
        dataset: batches `({"encoder_inputs", "decoder_inputs"}, targets[,
            sample_weight])`, e.g. `translation_dataset(pairs, ...,
            shuffle=False)`.
        log_probs: also return the model's log-probability of each target.

    Returns:
        `{"states": (N, d) float32, "targets": (N,) int32}` numpy arrays, and
        `"log_probs": (N,) float32` with `log_probs=True`.
    """
    if not hasattr(translator, "call_with_states"):
        raise ValueError(
            "kNN-MT needs a Transformer translator's decoder states. Received: "
            f"{type(translator).__name__} {getattr(translator, 'name', '')!r}"
        )
    columns = {"states": [], "targets": [], "log_probs": []}
    for inputs, targets in _batches_with_targets(dataset):
        states, logits = translator.call_with_states(inputs, training=False)
        targets = np.asarray(targets)
        keep = targets != 0
        columns["states"].append(
            np.asarray(ops.convert_to_numpy(ops.cast(states, "float32")))[keep]
        )
        columns["targets"].append(targets[keep].astype("int32"))
        if log_probs:
            scores = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
            scores = ops.take_along_axis(scores, targets[..., None], axis=-1)
            columns["log_probs"].append(ops.convert_to_numpy(scores)[..., 0][keep])
    if not columns["states"]:
        raise ValueError("`dataset` must yield at least one batch. Received: none")
    return {name: np.concatenate(parts) for name, parts in columns.items() if parts}


def translation_datastore(translator, dataset) -> TranslationDatastore:
    """The datastore of a Transformer translator over `dataset`'s pairs:
    `translation_states` as keys, their targets as values.

    Args:
        translator: a `keras_attn.models.TransformerTranslator`.
        dataset: batches as `translation_states` reads them, e.g.
            `translation_dataset(train_pairs, ..., shuffle=False)`; every
            non-padding target gives one entry.

    Returns:
        A `TranslationDatastore` (about `4 * d` bytes per target token: 300 MB
        for 200k tokens at d = 384).
    """
    found = translation_states(translator, dataset)
    return TranslationDatastore(
        found["states"], found["targets"], int(translator.target_vocabulary_size)
    )


class DatastoreWeights(keras.layers.Layer):
    """A `TranslationDatastore` as non-trainable weights, `datastore_keys`
    `(N, d)` (float32, or `key_dtype`), `datastore_values` `(N,)` int32 and
    the keys' squared norms `datastore_key_norms` `(N,)` float32 (computed
    once here rather than at every decoding step): what decoding reads, and
    what an export (`keras.export.ExportArchive.track`) saves as variables.
    Not callable: it only holds them."""

    def __init__(
        self, datastore: TranslationDatastore, key_dtype: str = "float32", **kwargs
    ):
        super().__init__(trainable=False, **kwargs)
        v.check_choice("key_dtype", key_dtype, KEY_DTYPES)
        self.datastore_keys = self._constant(
            "datastore_keys", datastore.keys, dtype=key_dtype
        )
        self.datastore_values = self._constant("datastore_values", datastore.values)
        # The norms of the keys as stored (rounded to key_dtype), in float32.
        stored = keras.ops.convert_to_numpy(
            keras.ops.cast(self.datastore_keys.value, "float32")
        )
        self.datastore_key_norms = self._constant(
            "datastore_key_norms", np.einsum("nd,nd->n", stored, stored)
        )
        self.built = True

    def _constant(self, name, array, dtype=None):
        weight = self.add_weight(
            shape=array.shape,
            dtype=dtype or str(array.dtype),
            initializer="zeros",
            trainable=False,
            name=name,
        )
        weight.assign(keras.ops.cast(array, weight.dtype))
        return weight


@dataclasses.dataclass(frozen=True, eq=False)
class NearestNeighborDecoding:
    """How decoding draws on a `TranslationDatastore` (kNN-MT).

    Attributes:
        datastore: the `TranslationDatastore`.
        k: neighbours looked up per step (at most the datastore's size).
        temperature: of `softmax(-squared distance / temperature)`; larger
            spreads the weight over more neighbours.
        lam: the neighbours' share of the mixture, in [0, 1).
        key_chunk_size: keys scored at once (memory: decoding rows times it).
        key_dtype: the dtype the keys are held and searched in: "float32"
            (exact), or "bfloat16" / "float16" (half the memory, in the
            datastore's weights and in an export; the products with the
            queries in that dtype, about twice as fast where it has fast
            matrix products: bfloat16 on CPUs with AVX-512 BF16 or AMX,
            either on GPUs). A model trained with mixed_bfloat16 has
            bfloat16 states, so its keys lose nothing in bfloat16; only the
            products are rounded.
    """

    datastore: TranslationDatastore
    k: int = 64
    temperature: float = 30.0
    lam: float = 0.3
    key_chunk_size: int = 65536
    key_dtype: str = "float32"

    def __post_init__(self):
        if not isinstance(self.datastore, TranslationDatastore):
            raise ValueError(
                "`datastore` must be a TranslationDatastore. "
                f"Received: datastore={type(self.datastore).__name__}"
            )
        v.check_positive_int("k", self.k)
        if self.k > len(self.datastore):
            raise ValueError(
                f"`k` must be at most the datastore's size ({len(self.datastore)}). "
                f"Received: k={self.k}"
            )
        v.check_positive_float("temperature", self.temperature)
        v.check_rate("lam", self.lam)
        v.check_positive_int("key_chunk_size", self.key_chunk_size)
        v.check_choice("key_dtype", self.key_dtype, KEY_DTYPES)

    def weights_layer(self) -> DatastoreWeights:
        """The datastore as weights, created on first use and then shared by
        every decoding function of this object (track it to export them)."""
        layer = self.__dict__.get("_weights_layer")
        if layer is None:
            layer = DatastoreWeights(
                self.datastore, key_dtype=self.key_dtype, name="knn_datastore"
            )
            object.__setattr__(self, "_weights_layer", layer)
        return layer

    def mix_fn(self):
        """`mix(states (N, d), logits (N, V)) -> (N, V)` float32 log-probabilities
        of the mixture (reading the datastore from `weights_layer()`): what a
        translator's decoding step returns instead of its logits."""
        # A module-level function: AutoGraph cannot read the source of a
        # function nested in a class body (it logs a warning per trace).
        return functools.partial(_mix, self, self.weights_layer())


def _mix(knn: NearestNeighborDecoding, layer: DatastoreWeights, states, logits):
    model_log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
    if knn.lam == 0:
        return model_log_probs
    distances, indices = nearest_neighbors(
        states,
        layer.datastore_keys.value,
        knn.k,
        key_chunk_size=knn.key_chunk_size,
        key_norms=layer.datastore_key_norms.value,
    )
    probabilities = knn_probabilities(
        ops.take(layer.datastore_values.value, indices, axis=0),
        knn_weights(distances, knn.temperature),
        knn.datastore.vocabulary_size,
    )
    return knn_mixture_log_probs(model_log_probs, probabilities, knn.lam)


def knn_target_log_probs(
    model_target_log_probs,
    distances,
    neighbor_values,
    target_ids,
    *,
    k: int,
    temperature: float,
    lam: float,
):
    """The mixture's log-probability of each reference token (teacher-forced).

    For choosing `k`, `temperature` and `lam` on held-out pairs: search the
    datastore once with the largest `k` tried (`nearest_neighbors`), then
    score each setting from the same neighbours.

    Args:
        model_target_log_probs: `(Q,)` float, the model's log-probability of
            each reference token.
        distances, neighbor_values: `(Q, K)`, the nearest neighbours' squared
            distances (nearest first) and values, `K >= k`.
        target_ids: `(Q,)` int, the reference tokens.
        k, temperature, lam: as in `NearestNeighborDecoding`.

    Returns:
        `(Q,)` float32 numpy log-probabilities.
    """
    v.check_positive_int("k", k)
    distances = np.asarray(distances, "float32")
    if k > distances.shape[1]:
        raise ValueError(
            f"`k` must be at most the neighbours searched ({distances.shape[1]}). "
            f"Received: k={k}"
        )
    weights = ops.convert_to_numpy(knn_weights(distances[:, :k], temperature))
    hits = np.asarray(neighbor_values)[:, :k] == np.asarray(target_ids)[:, None]
    knn_probs = (weights * hits).sum(axis=1)
    mixed = knn_mixture_log_probs(
        np.asarray(model_target_log_probs, "float32")[:, None],
        knn_probs[:, None],
        lam,
    )
    return np.asarray(ops.convert_to_numpy(mixed), "float32")[:, 0]


def choose_knn(
    translator,
    datastore: TranslationDatastore,
    validation_data,
    *,
    k=(32, 64, 128),
    temperature=(10.0, 30.0, 100.0),
    lam=(0.1, 0.2, 0.3, 0.4, 0.5),
    key_dtype: str = "float32",
    query_chunk_size: int = 1024,
):
    """The kNN-MT setting with the lowest loss on held-out references.

    The validation targets' decoder states search the datastore once, for
    the largest `k` tried; every setting is then scored from those
    neighbours by the mixture's log-likelihood of the references
    (`knn_target_log_probs`).

    Args:
        translator: the Transformer translator the datastore was built from.
        datastore: a `TranslationDatastore`.
        validation_data: batches as `translation_states` reads them.
        k, temperature, lam: the values tried (every combination; a `k`
            above the datastore's size counts as its size).
        key_dtype: the chosen decoding's `key_dtype`.
        query_chunk_size: validation states searched at once.

    Returns:
        `(decoding, report)`: the best `NearestNeighborDecoding`, and a dict
        of the choice: its `k`, `temperature`, `lambda`, `key_dtype`,
        `datastore_entries`, `validation_nats_per_token` (the mixture's
        negative log-likelihood per reference token),
        `model_validation_nats_per_token` (the model's alone) and `trials`
        (one dict per setting tried: `k`, `temperature`, `lambda`,
        `validation_nats_per_token`).
    """
    scores = translation_states(translator, validation_data, log_probs=True)
    largest_k = min(max(k), len(datastore))
    distances, indices = [], []
    for start in range(0, len(scores["targets"]), query_chunk_size):
        found_distances, found_indices = nearest_neighbors(
            scores["states"][start : start + query_chunk_size],
            datastore.keys,
            largest_k,
        )
        distances.append(np.asarray(ops.convert_to_numpy(found_distances)))
        indices.append(np.asarray(ops.convert_to_numpy(found_indices)))
    distances = np.concatenate(distances)
    neighbor_values = datastore.values[np.concatenate(indices)]

    def nats_per_token(k, temperature, lam):
        log_probs = knn_target_log_probs(
            scores["log_probs"],
            distances,
            neighbor_values,
            scores["targets"],
            k=k,
            temperature=temperature,
            lam=lam,
        )
        return -float(np.mean(log_probs, dtype="float64"))

    best, trials = grid_search(
        nats_per_token,
        k=sorted({min(value, largest_k) for value in k}),
        temperature=temperature,
        lam=lam,
    )
    decoding = NearestNeighborDecoding(
        datastore,
        k=best["k"],
        temperature=best["temperature"],
        lam=best["lam"],
        key_dtype=key_dtype,
    )
    trials = [
        {
            "k": trial["k"],
            "temperature": trial["temperature"],
            "lambda": trial["lam"],
            "validation_nats_per_token": trial["loss"],
        }
        for trial in trials
    ]
    report = {
        "k": decoding.k,
        "temperature": decoding.temperature,
        "lambda": decoding.lam,
        "key_dtype": key_dtype,
        "datastore_entries": len(datastore),
        "validation_nats_per_token": min(
            trial["validation_nats_per_token"] for trial in trials
        ),
        "model_validation_nats_per_token": -float(
            np.mean(scores["log_probs"], dtype="float64")
        ),
        "trials": trials,
    }
    return decoding, report
