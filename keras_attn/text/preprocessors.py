"""Preprocessors: raw strings -> a task's inputs, as Keras layers.

keras-hub's pattern (https://keras.io/keras_hub/api/base_classes/preprocessor/):
a preprocessor holds the task's tokenizer(s) and lengths, and its call
`preprocessor(x, y=None, sample_weight=None)` turns a batch of strings into
what the task's network takes, packed as Keras packs `(x, y, sample_weight)`,
so it maps a `tf.data.Dataset` of strings for `fit`, `evaluate` and
`predict`:

```
dataset = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(32)
classifier.fit(dataset.map(classifier.preprocessor))
```

Every task has one, built from its tokenizers and lengths
(`task.preprocessor`), so it is saved with the task (in `.keras` files and
presets, through the tokenizers). Dense outputs of fixed length (static
shapes: one compiled graph); the task methods (`classify`, ...) pad each
batch to a length bucket instead. TensorFlow ops only (the `text` extra).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_attn import _validation as v
from keras_attn.text.vocabulary import END_ID, PAD_ID, START_ID


def pack_target(target_ids, target_length: int):
    """`(decoder_inputs, decoder_targets)` of ragged target ids `[B, None]`:
    `[START] target [END]` cut to `target_length + 1` ids, then shifted (a
    target too long loses its end), each ragged `[B, <= target_length]`."""
    rows = target_ids.nrows()
    start = tf.fill([rows, 1], START_ID)
    end = tf.fill([rows, 1], END_ID)
    full = tf.concat([start, target_ids, end], axis=1)[:, : target_length + 1]
    return full[:, :-1], full[:, 1:]


def _dense(ids, length: int):
    return ids[:, :length].to_tensor(default_value=PAD_ID, shape=[None, length])


def detokenized_texts(tokenizer, ids) -> list[str]:
    """`tokenizer.detokenize(ids)` as a list of `str`: what the task methods
    answer (valid UTF-8: bytes that are not decode with U+FFFD)."""
    return decoded(tokenizer.detokenize(ids))


def decoded(texts) -> list[str]:
    """Byte strings (a `tf.string` tensor, an array or a list) as `str`,
    what is not valid UTF-8 replaced by U+FFFD."""
    if not isinstance(texts, (list, tuple)):
        texts = np.asarray(texts, dtype=object).reshape(-1).tolist()
    return [
        text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        for text in texts
    ]


class _Preprocessor(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._convert_input_args = False  # strings stay strings
        self._allow_non_tensor_positional_args = True

    @staticmethod
    def _strings(x):
        texts = tf.convert_to_tensor(x, dtype=tf.string)
        return texts[tf.newaxis] if texts.shape.rank == 0 else texts

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for key, value in config.items():
            if key.endswith("tokenizer") and isinstance(value, dict):
                config[key] = keras.saving.deserialize_keras_object(value)
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_attn")
class TextClassifierPreprocessor(_Preprocessor):
    """Strings -> `TextClassifier` inputs: token ids `[B, sequence_length]`
    int32 (truncated as the tokenizer truncates, 0-padded).

    Args:
        tokenizer: the classifier's tokenizer.
        sequence_length: ids per text.
    """

    def __init__(self, tokenizer, sequence_length: int, **kwargs):
        super().__init__(**kwargs)
        self.tokenizer = v.check_tokenizer("tokenizer", tokenizer, allow_none=False)
        self.sequence_length = v.check_positive_int("sequence_length", sequence_length)
        self._dense_tokenizer = tokenizer.copy(sequence_length=sequence_length)

    def call(self, x, y=None, sample_weight=None):
        token_ids = self._dense_tokenizer.tokenize(self._strings(x))
        return keras.utils.pack_x_y_sample_weight(token_ids, y, sample_weight)

    def get_config(self):
        return {
            **super().get_config(),
            "tokenizer": keras.saving.serialize_keras_object(self.tokenizer),
            "sequence_length": self.sequence_length,
        }


@keras.saving.register_keras_serializable(package="keras_attn")
class LanguageModelPreprocessor(_Preprocessor):
    """Strings -> `TransformerLanguageModel` training examples, as keras-hub's
    `CausalLMPreprocessor`: each text is `[START] tokens [END]`, cut to
    `sequence_length + 1` ids and 0-padded; `x` is all but the last id, `y`
    all but the first (`[B, sequence_length]` int32 each), `sample_weight`
    1.0 where `y` is a token (float32). Each text on its own (the
    `language_model_dataset` pipeline packs a corpus into windows instead).

    Args:
        tokenizer: the language model's tokenizer.
        sequence_length: ids per example (the model's context).
    """

    def __init__(self, tokenizer, sequence_length: int, **kwargs):
        super().__init__(**kwargs)
        self.tokenizer = v.check_tokenizer("tokenizer", tokenizer, allow_none=False)
        self.sequence_length = v.check_positive_int("sequence_length", sequence_length)

    def call(self, x, y=None, sample_weight=None):
        if y is not None or sample_weight is not None:
            raise ValueError(
                "A language model's targets are its next tokens: pass strings "
                f"only. Received: y={y!r}, sample_weight={sample_weight!r}"
            )
        ids = self.tokenizer.tokenize(self._strings(x))
        inputs, targets = pack_target(ids, self.sequence_length)
        inputs = _dense(inputs, self.sequence_length)
        targets = _dense(targets, self.sequence_length)
        weights = tf.cast(targets != PAD_ID, tf.float32)
        return keras.utils.pack_x_y_sample_weight(inputs, targets, weights)

    def score_preprocess(self, x):
        """Strings -> the rows `TransformerLanguageModel.score_ids` scores:
        each text's ids between the start and the end token, int32
        `[B, L]`, 0-padded to the longest (not cut: a long text is scored
        in sliding windows)."""
        ids = self.tokenizer.tokenize(self._strings(x))
        rows = ids.nrows()
        ids = tf.concat(
            [tf.fill([rows, 1], START_ID), ids, tf.fill([rows, 1], END_ID)], axis=1
        )
        return ids.to_tensor(default_value=PAD_ID)

    def generate_preprocess(self, x):
        """Prompt strings -> their ids, ragged `[B, None]` (without the start
        token: `TransformerLanguageModel.continue_ids` adds it)."""
        return self.tokenizer.tokenize(self._strings(x))

    def generate_postprocess(self, ids) -> list[str]:
        """New token ids (ragged or 0-padded) -> their texts, a list of `str`
        (`detokenized_texts`)."""
        return detokenized_texts(self.tokenizer, ids)

    def get_config(self):
        return {
            **super().get_config(),
            "tokenizer": keras.saving.serialize_keras_object(self.tokenizer),
            "sequence_length": self.sequence_length,
        }


@keras.saving.register_keras_serializable(package="keras_attn")
class TranslatorPreprocessor(_Preprocessor):
    """Strings -> translator training examples, as `translation_dataset`
    packs them, as keras-hub's `Seq2SeqLMPreprocessor` takes them:
    `x = {"source": strings, "target": strings}` (or a `(source, target)`
    pair) -> `({"encoder_inputs": [B, source_length], "decoder_inputs":
    [B, target_length]}, decoder_targets [B, target_length],
    sample_weight)`: the source's tokens; `[START] target` and `target
    [END]` (`pack_target`), all int32, 0-padded; `sample_weight` 1.0 where
    the target is a token.

    Args:
        source_tokenizer, target_tokenizer: the translator's tokenizers.
        source_length, target_length: ids per source and per target side.
    """

    def __init__(
        self,
        source_tokenizer,
        target_tokenizer,
        source_length: int,
        target_length: int,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.source_tokenizer = v.check_tokenizer(
            "source_tokenizer", source_tokenizer, allow_none=False
        )
        self.target_tokenizer = v.check_tokenizer(
            "target_tokenizer", target_tokenizer, allow_none=False
        )
        self.source_length = v.check_positive_int("source_length", source_length)
        self.target_length = v.check_positive_int("target_length", target_length)

    def call(self, x, y=None, sample_weight=None):
        if isinstance(x, dict):
            if set(x) != {"source", "target"}:
                raise ValueError(
                    "`x` must be {'source': strings, 'target': strings}. "
                    f"Received: keys {sorted(x)}"
                )
            source, target = x["source"], x["target"]
        else:
            source, target = x
        if y is not None or sample_weight is not None:
            raise ValueError(
                "A translator's targets are the target texts' tokens: pass them "
                f"in `x`. Received: y={y!r}, sample_weight={sample_weight!r}"
            )
        encoder = self.source_tokenizer.tokenize(self._strings(source))
        decoder_in, decoder_out = pack_target(
            self.target_tokenizer.tokenize(self._strings(target)), self.target_length
        )
        inputs = {
            "encoder_inputs": _dense(encoder, self.source_length),
            "decoder_inputs": _dense(decoder_in, self.target_length),
        }
        targets = _dense(decoder_out, self.target_length)
        weights = tf.cast(targets != PAD_ID, tf.float32)
        return keras.utils.pack_x_y_sample_weight(inputs, targets, weights)

    def get_config(self):
        return {
            **super().get_config(),
            "source_tokenizer": keras.saving.serialize_keras_object(
                self.source_tokenizer
            ),
            "target_tokenizer": keras.saving.serialize_keras_object(
                self.target_tokenizer
            ),
            "source_length": self.source_length,
            "target_length": self.target_length,
        }
