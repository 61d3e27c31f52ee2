"""`TextClassifier` (a Transformer encoder with pooling and a sigmoid) and
`TextClassifierEnsemble` (several of them, their probabilities averaged)."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from keras_attn import _validation as v
from keras_attn._optimizer import BuildsOptimizerFirst
from keras_attn.layers.attention_pooling import AttentionPooling
from keras_attn.models import _task
from keras_attn.models._saving import ExplicitSignatures
from keras_attn.models._setattr import SetattrBeforeInit
from keras_attn.models.backbones import TransformerEncoderBackbone
from keras_attn.models.quantization import QuantizableTask, float32_head_policy
from keras_attn.models.task import BackboneTask

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


class _ClassifierTask(BuildsOptimizerFirst, QuantizableTask):
    """`classify` and `export` over a network `token_ids -> (B, 1)`
    probabilities with a `tokenizer` and a `sequence_length`; `quantize`
    keeps the one-unit output layers in float32 by default."""

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
        (`keras_attn.models._task.bucket_length`), not to `max_length`, and
        run through the network compiled once per bucket width (kept for
        later calls); the tokenizer is built once and kept. The results do
        not depend on the batching (up to float rounding).

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
            probability = _task.compiled_forward(self, ids.shape[1])(ids)
            return np.asarray(probability, "float32")[:, 0]

        found = _task.map_batches(
            probabilities, texts, batch_size, verbose, title="Classifying"
        )
        probability = np.asarray(found, dtype="float32").reshape(-1)
        return {
            "positive_probability": probability,
            "label": [self.labels[int(p > threshold)] for p in probability],
        }

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """`keras.Model.predict`, and on raw strings (a string, or a list or
        array of them) as keras-hub's classifiers take them: the positive
        probabilities `(N, 1)` float32, batched as `classify` batches them
        (`batch_size` default 64, each batch padded to a length bucket, a
        progress bar as `verbose` asks)."""
        if not _task.is_texts(x):
            return super().predict(
                x,
                batch_size=batch_size,
                verbose=verbose,
                steps=steps,
                callbacks=callbacks,
            )
        if steps is not None or callbacks:
            raise ValueError(
                "`steps` and `callbacks` apply to token ids; raw strings are "
                f"batched by `batch_size`. Received: steps={steps!r}, "
                f"callbacks={callbacks!r}"
            )
        texts = x.tolist() if hasattr(x, "tolist") else x
        found = self.classify(
            texts, batch_size=batch_size or _task.DEFAULT_BATCH_SIZE, verbose=verbose
        )
        return found["positive_probability"][:, None]

    def classify_strings(
        self,
        texts,
        max_length: int | None = None,
        threshold: float = 0.5,
        tokenizer=None,
    ) -> dict:
        """The probabilities and labels of strings (a `tf.string` tensor `[B]`
        or a list) in one pass, as tensors: `positive_probability` float32
        `[B]`, `label` string `[B]`. Texts are truncated to `max_length`
        tokens and the batch is padded to its longest text, not to
        `max_length` (the padding is masked, so the probabilities are those
        of any padding up to float rounding; a short text costs what its
        tokens cost). TensorFlow, eagerly or in a `tf.function` (the
        export's `serving_default` is this). `tokenizer`: one giving dense
        ids of `max_length` tokens (default: the model's, so configured)."""
        import tensorflow as tf

        if tokenizer is None:
            tokenizer = self.dense_tokenizer(max_length)
        token_ids = tokenizer.tokenize(texts)  # (B, max_length), truncated
        token_ids = _task.without_padding_columns(token_ids)  # (B, longest)
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
        max_length = v.check_positive_int(
            "max_length", max_length or self.sequence_length
        )

        def build():
            return tokenizer.copy(sequence_length=max_length)

        # Built once per tokenizer and length (building parses the vocabulary).
        key = ("dense_tokenizer", max_length)
        return _task.cached(self, key, (tokenizer,), build)

    def serving_spec(self, max_length: int = 64, threshold: float = 0.5):
        """What the TF Serving export serves: a `keras_attn.export.ServingSpec`
        (which `keras_attn.export.export_task` writes) of `serving_default`
        (`text` -> `positive_probability`, `label`), with `export`'s options
        (see `keras_attn.export.export_sentiment`): built by
        `keras_attn.export.sentiment.sentiment_serving_spec`."""
        from keras_attn.export.sentiment import sentiment_serving_spec

        return sentiment_serving_spec(self, max_length, threshold)

    def export(
        self,
        base_dir,
        model_name: str = "sentiment",
        version: int | None = None,
        max_length: int = 64,
        threshold: float = 0.5,
        precision: str | None = None,
    ):
        """Export for TF Serving, strings in and probability and label out:
        `keras_attn.export.export_sentiment(self, ...)` (see there), which is
        `export_task` of `serving_spec`. Returns the version directory.
        Replaces `keras.Model.export`."""
        from keras_attn.export.task import export_task

        return export_task(
            self,
            base_dir,
            model_name=model_name,
            version=version,
            max_length=max_length,
            threshold=threshold,
            precision=precision,
        )


@keras.saving.register_keras_serializable(package="keras_attn")
class TextClassifier(BackboneTask, _ClassifierTask, keras.Model):
    """The attention-based sequence encoder of the lectures, with a sigmoid output.

    Token ids `(batch, T)` (0 = padding) -> a `TransformerEncoderBackbone`
    (token + position embedding, `num_layers` encoder blocks, padding masked
    through the Keras mask) -> pooling over the unmasked positions
    (`"mean"`, or `"attention"`: `AttentionPooling`'s learned query) ->
    dropout -> `Dense(1, sigmoid)`: `positive_probability` `(batch, 1)` in
    float32 (also under mixed precision). With a `tokenizer`,
    `classify(texts)`, `predict(texts)` and `export(path)` work on raw
    strings; `attention_maps` gives the weights for plots; `from_bert`
    starts from a pretrained BERT-style encoder.

    Build it from a backbone, as keras-hub's tasks
    (`TextClassifier(backbone=TransformerEncoderBackbone(...))`), or from the
    sizes below, which build `backbone`.

    Args:
        vocabulary_size: token ids are in `[0, vocabulary_size)`.
        sequence_length: the longest input (size of learned positions).
        embedding_dim, num_layers, num_heads, intermediate_dim: encoder sizes.
        dropout: of the encoder (when built here) and of the pooled vector.
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
        backbone: a `TransformerEncoderBackbone` to put the head on (then
            leave the encoder's sizes out).
        dtype: keyword-only, the dtype policy of the backbone built here
            and of the head (the output stays float32); with `backbone`
            given, the backbone's policy is the task's (`dtype` may repeat
            it). Default the global policy. A quantized task's config
            gives a `DTypePolicyMap` of its quantized output layer (its
            path's policy; the output layer is built quantized from it).
        **kwargs: `keras.Model` arguments (`name`, `trainable`).
    """

    def __init__(
        self,
        vocabulary_size: int | None = None,
        sequence_length: int | None = None,
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
        *,
        backbone=None,
        dtype=None,
        **kwargs,
    ):
        kwargs.setdefault("name", "text_classifier")
        sizes = {
            "vocabulary_size": vocabulary_size,
            "sequence_length": sequence_length,
            "embedding_dim": embedding_dim,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "intermediate_dim": intermediate_dim,
            "position": position,
            "normalize_first": normalize_first,
            "activation": activation,
            "layer_norm_epsilon": layer_norm_epsilon,
            "embedding_norm": embedding_norm,
        }
        if backbone is not None:
            self.check_sizes_unset(TextClassifier.__init__, sizes)
            backbone = self.check_backbone(
                "backbone", backbone, TransformerEncoderBackbone
            )
        v.check_choice("pooling", pooling, POOLINGS)
        v.check_rate("dropout", dropout)
        tokenizer = v.check_tokenizer("tokenizer", tokenizer)
        dtype = self.check_dtype(dtype, [backbone])
        head_dtype = float32_head_policy(dtype)  # a quantized head's map, if any
        if backbone is None:
            backbone = TransformerEncoderBackbone(**sizes, dropout=dropout, dtype=dtype)
        self.backbone = backbone
        # The encoder's parts and sizes, as before the backbones (set before
        # the graph: on PyTorch, untracked; the graph tracks the layers).
        self.embedding = backbone.embedding
        self.embedding_norm = backbone.embedding_norm
        self.encoder_blocks = backbone.blocks
        self.final_norm = backbone.final_norm
        self.vocabulary_size = backbone.vocabulary_size
        self.sequence_length = backbone.sequence_length
        self.embedding_dim = backbone.embedding_dim
        self.num_layers = backbone.num_layers
        self.num_heads = backbone.num_heads
        self.intermediate_dim = backbone.intermediate_dim
        self.position = backbone.position
        self.normalize_first = backbone.normalize_first
        self.activation = backbone.activation
        self.layer_norm_epsilon = backbone.layer_norm_epsilon
        dtype = backbone.dtype_policy
        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        x = backbone(token_ids)  # (B, T, d), Keras mask token_ids != 0
        if pooling == "mean":
            self.pooling = MaskedAveragePooling1D(dtype=dtype, name="pooling")
        else:
            self.pooling = AttentionPooling(
                backbone.embedding_dim, dtype=dtype, name="pooling"
            )
        pooled = self.pooling(x)  # masked mean, or attention
        pooled = keras.layers.Dropout(dropout, dtype=dtype, name="pooled_dropout")(
            pooled
        )
        probability = keras.layers.Dense(
            1, activation="sigmoid", dtype=head_dtype, name="positive_probability"
        )(pooled)
        super().__init__(token_ids, probability, **kwargs)
        self._adopt_dtype_policy(backbone)
        self.dropout = dropout
        self.pooling_mode = pooling
        self.tokenizer = tokenizer

    @classmethod
    def from_bert(
        cls, checkpoint, dropout: float = 0.1, pooling: str = "mean", **kwargs
    ) -> TextClassifier:
        """A classifier whose encoder is a pretrained BERT-style checkpoint's.

        The backbone is `TransformerEncoderBackbone.from_bert(checkpoint)`
        (the checkpoint's embeddings, embedding layer norm and blocks); the
        pooling (`"mean"`, as all-MiniLM-L6-v2's sentence embeddings, or
        `"attention"`) and the output layer start fresh. Inputs are the
        checkpoint's WordPiece ids (`checkpoint.tokenizer()`, the natural
        `tokenizer`), at most `checkpoint.max_positions` long.

        Args:
            checkpoint: a `keras_attn.checkpoints.BertCheckpoint`.
            dropout: of the embeddings, blocks and pooled vector (BERT's own
                is 0.1).
            pooling: `"mean"` or `"attention"`.
            **kwargs: other constructor arguments (`tokenizer`, `name`).
        """
        backbone = TransformerEncoderBackbone.from_bert(checkpoint, dropout=dropout)
        return cls(backbone=backbone, dropout=dropout, pooling=pooling, **kwargs)

    @property
    def preprocessor(self):
        """Strings -> this model's inputs, a Keras layer for `tf.data`
        (`keras_attn.text.TextClassifierPreprocessor` of `tokenizer` and
        `sequence_length`; built once per tokenizer)."""
        tokenizer = _task.require_tokenizer(self, "tokenizer", "preprocessor")

        def build():
            from keras_attn.text import TextClassifierPreprocessor

            return TextClassifierPreprocessor(tokenizer, self.sequence_length)

        return _task.cached(self, "preprocessor", [tokenizer], build)

    def attention_maps(self, token_ids) -> dict:
        """Attention weights, float32: `"self_attention"`, one `(B, heads, T,
        T)` per encoder block (row `i`: how token `i` spreads its attention;
        padding gets none, and its own rows are zeros), and with attention
        pooling `"pooling"`, `(B, T)`: the pooling weights of every token
        (which tokens a decision rests on; padding gets 0)."""
        token_ids = ops.convert_to_tensor(token_ids, "int32")
        mask = ops.not_equal(token_ids, 0)
        x, maps = self.backbone.encode(
            token_ids, padding_mask=mask, return_attention_scores=True
        )
        found = {"self_attention": maps}
        if isinstance(self.pooling, AttentionPooling):
            _, weights = self.pooling(x, mask=mask, return_attention_scores=True)
            found["pooling"] = ops.cast(weights, "float32")
        return found

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "dropout": self.dropout,
            "pooling": self.pooling_mode,
            "tokenizer": _task.serialize_tokenizer(self.tokenizer),
            **self.head_policy_config(),
        }

    def float32_layers(self) -> list:
        """`positive_probability`, the one-unit output layer: `quantize()`
        keeps it float32 (in int8 it would save a few hundred bytes and in
        int4 grow the model, and move every probability; docs/TASKS.md)."""
        return [self.get_layer("positive_probability")]


@keras.saving.register_keras_serializable(package="keras_attn")
class TextClassifierEnsemble(
    SetattrBeforeInit, ExplicitSignatures, _ClassifierTask, keras.Model
):
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
        tokenizer = v.check_tokenizer("tokenizer", tokenizer)
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

    def float32_layers(self) -> list:
        """The members' `float32_layers()` (their output layers): what
        `quantize()` keeps in float32."""
        return [
            layer
            for member in self.members
            for layer in getattr(member, "float32_layers", list)()
        ]

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
