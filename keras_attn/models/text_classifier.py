"""`TextClassifier` (a Transformer encoder with pooling and a sigmoid) and
`TextClassifierEnsemble` (several of them, their probabilities averaged)."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers._transformer_block import (
    block_class,
    block_structure_config,
    blocks_of_config,
)
from keras_attn.layers.attention_pooling import AttentionPooling
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock
from keras_attn.models import _task

POOLINGS = ("mean", "attention")


@keras.saving.register_keras_serializable(package="keras_attn")
class MaskedAveragePooling1D(keras.layers.GlobalAveragePooling1D):
    """`keras.layers.GlobalAveragePooling1D` whose fully masked rows pool to
    zeros, as `AttentionPooling`'s do, instead of 0 / 0 = NaN (a text that
    tokenizes to no token at all, such as an empty string)."""

    def call(self, inputs, mask=None):
        if mask is None or self.data_format != "channels_last":
            return super().call(inputs, mask=mask)
        weights = ops.expand_dims(ops.cast(mask, inputs.dtype), -1)
        total = ops.sum(inputs * weights, axis=1, keepdims=self.keepdims)
        count = ops.sum(weights, axis=1, keepdims=self.keepdims)
        return total / ops.maximum(count, ops.ones_like(count))


LABELS = ("negative", "positive")


class _ClassifierTask:
    """`classify` and `export` over a network `token_ids -> (B, 1)`
    probabilities with a `tokenizer` and a `sequence_length`."""

    labels = LABELS  # the label of a probability at most, and above, the threshold

    def classify(
        self,
        texts,
        max_length: int | None = None,
        threshold: float = 0.5,
        batch_size: int = _task.DEFAULT_BATCH_SIZE,
        verbose="auto",
    ):
        """The positive class's probability and the label of raw strings.

        Any number of texts, in batches of `batch_size` (memory stays flat),
        each batch padded to a bucket of its longest text
        (`keras_attn.models._task.bucket_length`), not to `max_length`; the
        tokenizer is built once and kept. The results do not depend on the
        batching (up to float rounding).

        Args:
            texts: a string or a list of strings.
            max_length: tokens kept per text (default `sequence_length`),
                truncated as the tokenizer truncates (a WordPiece tokenizer
                keeps `[SEP]` last).
            threshold: the label is `"positive"` above it.
            batch_size: texts classified at once.
            verbose: `"auto"` (a progress bar when there is more than one
                batch), 0 (none), 1 (a bar) or 2 (one line at the end), as
                in `keras.Model.predict`.

        Returns:
            `{"positive_probability": (N,) float32 array, "label": [str]}`,
            what the TF Serving export answers.
        """
        texts = _task.text_list("texts", texts)
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
            raise ValueError(
                f"`threshold` must be a float. Received: threshold={threshold!r}"
            )
        tokenizer = self.dense_tokenizer(max_length)
        cap = tokenizer.sequence_length

        def probabilities(batch):
            ids = _task.padded_ids(tokenizer.tokenize(batch), cap)  # (B, bucket)
            probability = self(ids, training=False)
            return np.asarray(ops.convert_to_numpy(probability), "float32")[:, 0]

        found = _task.map_batches(
            probabilities, texts, batch_size, verbose, title="Classifying"
        )
        probability = np.asarray(found, dtype="float32").reshape(-1)
        return {
            "positive_probability": probability,
            "label": [self.labels[int(p > threshold)] for p in probability],
        }

    def classify_strings(
        self,
        texts,
        max_length: int | None = None,
        threshold: float = 0.5,
        tokenizer=None,
    ) -> dict:
        """The probabilities and labels of strings (a `tf.string` tensor `[B]`
        or a list) in one pass, padded to `max_length`, as tensors:
        `positive_probability` float32 `[B]`, `label` string `[B]`.
        TensorFlow, eagerly or in a `tf.function` (the export's
        `serving_default` is this). `tokenizer`: one giving dense ids of
        `max_length` tokens (default: the model's, so configured)."""
        import tensorflow as tf

        if tokenizer is None:
            tokenizer = self.dense_tokenizer(max_length)
        token_ids = tokenizer.tokenize(texts)  # (B, max_length), truncated
        if tf.executing_eagerly():  # any backend's model reads NumPy
            token_ids = np.asarray(token_ids)
        probability = self(token_ids, training=False)
        if tf.executing_eagerly():
            probability = ops.convert_to_numpy(probability)
        probability = tf.reshape(tf.cast(probability, tf.float32), [-1])  # (B,)
        label = tf.gather(
            tf.constant(self.labels), tf.cast(probability > threshold, tf.int32)
        )
        return {"positive_probability": probability, "label": label}

    def dense_tokenizer(self, max_length: int | None = None):
        """A copy of the model's tokenizer giving dense ids of `max_length`
        tokens (default `sequence_length`), built once and kept until
        `tokenizer` is set to another one."""
        tokenizer = _task.require_tokenizer(self, "tokenizer", "classify")
        max_length = _task.check_length(
            "max_length", max_length or self.sequence_length
        )

        def build():
            config = {**tokenizer.get_config(), "sequence_length": max_length}
            return type(tokenizer).from_config(config)

        # Built once per tokenizer and length (building parses the vocabulary).
        key = ("dense_tokenizer", max_length)
        return _task.cached(self, key, (tokenizer,), build)

    def export(
        self,
        base_dir,
        model_name: str = "sentiment",
        version: int | None = None,
        max_length: int = 64,
        threshold: float = 0.5,
    ):
        """Export for TF Serving, strings in and probability and label out:
        `keras_attn.export.export_sentiment(self, ...)` (see there). Returns
        the version directory. Replaces `keras.Model.export`."""
        from keras_attn.export.sentiment import export_sentiment

        return export_sentiment(
            self,
            base_dir,
            model_name=model_name,
            version=version,
            max_length=max_length,
            threshold=threshold,
        )


@keras.saving.register_keras_serializable(package="keras_attn")
class TextClassifier(_ClassifierTask, keras.Model):
    """The attention-based sequence encoder of the lectures, with a sigmoid output.

    Token ids `(batch, T)` (0 = padding) -> token + position embedding ->
    `num_layers` `TransformerEncoderBlock`s (padding masked through the Keras
    mask) -> pooling over the unmasked positions (`"mean"`, or `"attention"`:
    `AttentionPooling`'s learned query) -> dropout -> `Dense(1, sigmoid)`:
    `positive_probability` `(batch, 1)` in float32 (also under mixed
    precision). With a `tokenizer`, `classify(texts)` and `export(path)`
    work on raw strings; `attention_maps` gives the weights for plots;
    `from_bert` starts from a pretrained BERT-style encoder.

    Args:
        vocabulary_size: token ids are in `[0, vocabulary_size)`.
        sequence_length: the longest input (size of learned positions).
        embedding_dim, num_layers, num_heads, intermediate_dim, dropout:
            encoder sizes.
        pooling: `"mean"` or `"attention"`.
        position: `"sinusoidal"` or `"learned"`.
        normalize_first: pre-norm encoder blocks.
        activation: activation of the blocks' feed-forward networks.
        layer_norm_epsilon: epsilon of the layer norms.
        embedding_norm: normalize the embeddings before the embedding
            dropout, as BERT does. With `position="learned"`,
            `activation="gelu"` and `layer_norm_epsilon=1e-12` the model has
            BERT's layout (what `from_bert` builds).
        tokenizer: the tokenizer of `classify` and `export` (optional).
        **kwargs: `keras.Model` arguments (`name`, `dtype`, `trainable`).
    """

    def __init__(
        self,
        vocabulary_size: int,
        sequence_length: int,
        embedding_dim: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        intermediate_dim: int = 256,
        dropout: float = 0.1,
        pooling: str = "mean",
        position: str = "sinusoidal",
        normalize_first: bool = False,
        activation="relu",
        layer_norm_epsilon: float = 1e-5,
        embedding_norm: bool = False,
        tokenizer=None,
        **kwargs,
    ):
        kwargs.setdefault("name", "text_classifier")
        v.check_positive_int("vocabulary_size", vocabulary_size)
        v.check_positive_int("sequence_length", sequence_length)
        v.check_choice("pooling", pooling, POOLINGS)
        v.check_positive_int("num_layers", num_layers)
        v.check_rate("dropout", dropout)
        tokenizer = _task.check_tokenizer("tokenizer", tokenizer)
        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        self.embedding = TokenAndPositionEmbedding(
            vocabulary_size,
            sequence_length,
            embedding_dim,
            position=position,
            mask_zero=True,
            position_initializer="glorot_uniform",
            name="embedding",
        )
        x = self.embedding(token_ids)  # (B, T, d), Keras mask token_ids != 0
        self.embedding_norm = None
        if embedding_norm:
            self.embedding_norm = keras.layers.LayerNormalization(
                epsilon=layer_norm_epsilon, name="embedding_norm"
            )
            x = self.embedding_norm(x)
        x = keras.layers.Dropout(dropout, name="embedding_dropout")(x)
        self.encoder_blocks = []
        for index in range(num_layers):
            block = block_class(TransformerEncoderBlock)(
                num_heads=num_heads,
                intermediate_dim=intermediate_dim,
                dropout=dropout,
                normalize_first=normalize_first,
                activation=activation,
                layer_norm_epsilon=layer_norm_epsilon,
                name=f"encoder_{index}",
            )
            x = block(x)
            self.encoder_blocks.append(block)
        self.final_norm = None
        if normalize_first:
            self.final_norm = keras.layers.LayerNormalization(
                epsilon=layer_norm_epsilon, name="final_norm"
            )
            x = self.final_norm(x)
        if pooling == "mean":
            self.pooling = MaskedAveragePooling1D(name="pooling")
        else:
            self.pooling = AttentionPooling(embedding_dim, name="pooling")
        pooled = self.pooling(x)  # masked mean, or attention
        pooled = keras.layers.Dropout(dropout, name="pooled_dropout")(pooled)
        probability = keras.layers.Dense(
            1, activation="sigmoid", dtype="float32", name="positive_probability"
        )(pooled)
        super().__init__(token_ids, probability, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.sequence_length = sequence_length
        self.embedding_dim = embedding_dim
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.pooling_mode = pooling
        self.position = position
        self.normalize_first = normalize_first
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon
        self.tokenizer = tokenizer

    @classmethod
    def from_bert(
        cls, checkpoint, dropout: float = 0.1, pooling: str = "mean", **kwargs
    ) -> TextClassifier:
        """A classifier whose encoder is a pretrained BERT-style checkpoint's.

        The token and position embeddings (BERT's token-type embedding of
        type 0 added to the position table: every input is one segment), the
        embedding layer norm and every encoder block get the checkpoint's
        weights; the pooling (`"mean"`, as all-MiniLM-L6-v2's sentence
        embeddings, or `"attention"`) and the output layer start fresh.
        Inputs are the checkpoint's WordPiece ids (`checkpoint.tokenizer()`,
        the natural `tokenizer`), at most `checkpoint.max_positions` long.

        Args:
            checkpoint: a `keras_attn.checkpoints.BertCheckpoint`.
            dropout: of the embeddings, blocks and pooled vector (BERT's own
                is 0.1).
            pooling: `"mean"` or `"attention"`.
            **kwargs: other constructor arguments (`tokenizer`, `name`).
        """
        from keras_attn.checkpoints import load_bert_encoder

        model = cls(
            len(checkpoint.vocabulary),
            checkpoint.max_positions,
            embedding_dim=checkpoint.hidden_size,
            num_layers=checkpoint.num_layers,
            num_heads=checkpoint.num_heads,
            intermediate_dim=checkpoint.intermediate_size,
            dropout=dropout,
            pooling=pooling,
            position="learned",
            activation="gelu",
            layer_norm_epsilon=checkpoint.layer_norm_epsilon,
            embedding_norm=True,
            **kwargs,
        )
        load_bert_encoder(
            checkpoint, model.embedding, model.embedding_norm, model.encoder_blocks
        )
        return model

    def attention_maps(self, token_ids) -> dict:
        """Attention weights, float32: `"self_attention"`, one `(B, heads, T,
        T)` per encoder block (row `i`: how token `i` spreads its attention;
        padding gets none, and its own rows are zeros), and with attention
        pooling `"pooling"`, `(B, T)`: the pooling weights of every token
        (which tokens a decision rests on; padding gets 0)."""
        token_ids = ops.convert_to_tensor(token_ids, "int32")
        mask = ops.not_equal(token_ids, 0)
        x = self.embedding(token_ids)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        maps = {"self_attention": []}
        for block in self.encoder_blocks:
            x, weights = block(x, padding_mask=mask, return_attention_scores=True)
            maps["self_attention"].append(ops.cast(weights, "float32"))
        if isinstance(self.pooling, AttentionPooling):
            if self.final_norm is not None:
                x = self.final_norm(x)
            _, weights = self.pooling(x, mask=mask, return_attention_scores=True)
            maps["pooling"] = ops.cast(weights, "float32")
        return maps

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "vocabulary_size": self.vocabulary_size,
            "sequence_length": self.sequence_length,
            "embedding_dim": self.embedding_dim,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "intermediate_dim": self.intermediate_dim,
            "dropout": self.dropout,
            "pooling": self.pooling_mode,
            "position": self.position,
            "normalize_first": self.normalize_first,
            "activation": self.activation,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "embedding_norm": self.embedding_norm is not None,
            "tokenizer": _task.serialize_tokenizer(self.tokenizer),
            **block_structure_config(self.encoder_blocks),
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["tokenizer"] = _task.deserialize_tokenizer(config.get("tokenizer"))
        with blocks_of_config(config):  # old configs: blocks of their structure
            return cls(**config)


@keras.saving.register_keras_serializable(package="keras_attn")
class TextClassifierEnsemble(_ClassifierTask, keras.Model):
    """Several `TextClassifier`s whose probabilities are averaged.

    One model, `token_ids (B, T) -> positive_probability (B, 1)` float32, the
    mean of the members' probabilities, so it trains nothing itself (each
    member is trained on its own), evaluates, saves and exports as one graph.
    `classify` and `export` as for a `TextClassifier`.

    Args:
        members: the `TextClassifier`s (at least one); their own tokenizers
            are not used.
        tokenizer: the tokenizer of `classify` and `export` (optional).
        **kwargs: `keras.Model` arguments (`name`, ...).
    """

    def __init__(self, members, tokenizer=None, **kwargs):
        kwargs.setdefault("name", "sentiment_ensemble")
        members = list(members)
        if not members or not all(isinstance(m, keras.Model) for m in members):
            raise ValueError(
                "`members` must be a non-empty list of classifiers. Received: "
                f"members={members!r}"
            )
        tokenizer = _task.check_tokenizer("tokenizer", tokenizer)
        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        probabilities = [member(token_ids) for member in members]
        if len(members) == 1:
            average = probabilities[0]
        else:
            average = keras.layers.Average(
                dtype="float32", name="positive_probability"
            )(probabilities)
        super().__init__(token_ids, average, **kwargs)
        self.members = members
        self.tokenizer = tokenizer

    @property
    def sequence_length(self) -> int:
        return min(member.sequence_length for member in self.members)

    def attention_maps(self, token_ids) -> dict:
        """The first member's `attention_maps`."""
        return self.members[0].attention_maps(token_ids)

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "members": [keras.saving.serialize_keras_object(m) for m in self.members],
            "tokenizer": _task.serialize_tokenizer(self.tokenizer),
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["members"] = [
            keras.saving.deserialize_keras_object(m) for m in config["members"]
        ]
        config["tokenizer"] = _task.deserialize_tokenizer(config.get("tokenizer"))
        return cls(**config)
