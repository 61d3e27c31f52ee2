"""Transformer translator and decoder-only language model (Vaswani et al. 2017)."""

from __future__ import annotations

import functools

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_decoder_block import TransformerDecoderBlock
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock
from keras_attn.models._structure import (
    language_model_config,
    stack_blocks,
    translator_config,
)


def _output_layer(hidden, embedding, vocabulary_size, tie_embeddings, name):
    """float32 logits: `embedding` reversed (tied weights) or a new Dense."""
    if tie_embeddings:
        logits = embedding(hidden, reverse=True)  # (B, T, V) = h Eᵀ
        return keras.layers.Activation("linear", dtype="float32", name=name)(logits)
    return keras.layers.Dense(vocabulary_size, dtype="float32", name=name)(hidden)


def transformer_translator(
    source_vocabulary_size: int,
    target_vocabulary_size: int,
    sequence_length: int = 128,
    embedding_dim: int = 256,
    num_encoder_layers: int = 3,
    num_decoder_layers: int = 3,
    num_heads: int = 8,
    intermediate_dim: int = 1024,
    dropout: float = 0.1,
    shared_vocabulary: bool = False,
    tie_embeddings: bool = True,
    normalize_first: bool = False,
    position: str = "sinusoidal",
    name: str = "transformer_translator",
) -> keras.Model:
    """Vaswani et al.'s encoder-decoder Transformer for translation.

    Inputs `{"encoder_inputs": (batch, S), "decoder_inputs": (batch, T)}` int
    ids, 0 = padding; output float32 logits `(batch, T, target_vocab)`.
    Source and target tokens get `TokenAndPositionEmbedding`s (sinusoidal
    positions, embeddings scaled by `sqrt(d)` as in the paper), shared when
    `shared_vocabulary=True` (one vocabulary for both languages). With
    `tie_embeddings=True` the output projection is the transposed target
    embedding (section 3.4 of the paper). `normalize_first=True` gives pre-norm
    blocks (and a final layer norm), which train more stably without warm-up.
    Decode with `transformer_translator_decoding(model)`.
    """
    for arg, value in (
        ("num_encoder_layers", num_encoder_layers),
        ("num_decoder_layers", num_decoder_layers),
    ):
        v.check_positive_int(arg, value)
    v.check_rate("dropout", dropout)
    if shared_vocabulary and source_vocabulary_size != target_vocabulary_size:
        raise ValueError(
            "A shared vocabulary needs equal vocabulary sizes. Received: "
            f"source_vocabulary_size={source_vocabulary_size}, "
            f"target_vocabulary_size={target_vocabulary_size}"
        )
    encoder_inputs = keras.Input((None,), dtype="int32", name="encoder_inputs")
    decoder_inputs = keras.Input((None,), dtype="int32", name="decoder_inputs")

    block_kwargs = {
        "num_heads": num_heads,
        "intermediate_dim": intermediate_dim,
        "dropout": dropout,
        "normalize_first": normalize_first,
    }

    def embedding(vocabulary_size, layer_name):
        return translator_embedding(
            vocabulary_size, sequence_length, embedding_dim, layer_name, position
        )

    if shared_vocabulary:
        source_embedding = target_embedding = embedding(
            source_vocabulary_size, "shared_embedding"
        )
    else:
        source_embedding = embedding(source_vocabulary_size, "source_embedding")
        target_embedding = embedding(target_vocabulary_size, "target_embedding")

    x = source_embedding(encoder_inputs)  # (B, S, d), masked
    x = keras.layers.Dropout(dropout, name="source_dropout")(x)
    x = stack_blocks(
        x,
        TransformerEncoderBlock,
        num_encoder_layers,
        "encoder",
        final_norm_name="encoder_norm",
        **block_kwargs,
    )
    encoder_outputs = x

    return translator_model(
        encoder_inputs,
        encoder_outputs,
        decoder_inputs,
        target_embedding,
        num_decoder_layers,
        tie_embeddings=tie_embeddings,
        name=name,
        **block_kwargs,
    )


def translator_embedding(
    vocabulary_size, sequence_length, embedding_dim, name, position="sinusoidal"
):
    """A translator's `TokenAndPositionEmbedding`: scaled by `sqrt(d)` as in
    the paper, initialised with standard deviation `d ** -0.5` (so tied
    output logits start near unit scale), padding (id 0) masked."""
    return TokenAndPositionEmbedding(
        vocabulary_size,
        sequence_length,
        embedding_dim,
        position=position,
        mask_zero=True,
        scale_embeddings=True,
        embeddings_initializer=keras.initializers.RandomNormal(
            stddev=embedding_dim**-0.5
        ),
        name=name,
    )


def translator_model(
    encoder_inputs,
    encoder_outputs,
    decoder_inputs,
    target_embedding,
    num_decoder_layers,
    *,
    num_heads,
    intermediate_dim,
    dropout,
    normalize_first,
    tie_embeddings,
    name,
):
    """The decoder half of a Transformer translator and the model: target
    embedding, dropout, `num_decoder_layers` blocks named `decoder_{i}`
    attending to `encoder_outputs` (and `decoder_norm` when pre-norm), float32
    `logits`. Shared by the translator builders, so that
    `transformer_translator_decoding` finds the same layers in both."""
    y = target_embedding(decoder_inputs)  # (B, T, d), masked
    y = keras.layers.Dropout(dropout, name="target_dropout")(y)
    y = stack_blocks(
        y,
        TransformerDecoderBlock,
        num_decoder_layers,
        "decoder",
        num_heads=num_heads,
        intermediate_dim=intermediate_dim,
        dropout=dropout,
        normalize_first=normalize_first,
        final_norm_name="decoder_norm",
        context=encoder_outputs,
    )
    logits = _output_layer(
        y,
        target_embedding,
        target_embedding.vocabulary_size,
        tie_embeddings,
        "logits",
    )
    return keras.Model(
        {"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs},
        logits,
        name=name,
    )


def transformer_language_model(
    vocabulary_size: int,
    sequence_length: int = 256,
    embedding_dim: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_dim: int = 1024,
    dropout: float = 0.1,
    tie_embeddings: bool = True,
    normalize_first: bool = True,
    position: str = "learned",
    name: str = "transformer_language_model",
) -> keras.Model:
    """Decoder-only next-token model (GPT-style) of causal decoder blocks.

    Input `token_ids` `(batch, T)` (0 = padding); output float32 logits
    `(batch, T, vocabulary_size)` predicting token `t + 1` at position `t`.
    Pre-norm blocks and a final layer norm by default (as GPT-2), learned
    positions, output projection tied to the token embedding. Decode with
    `transformer_language_model_decoding(model)`.
    """
    v.check_positive_int("num_layers", num_layers)
    v.check_rate("dropout", dropout)
    token_ids = keras.Input((None,), dtype="int32", name="token_ids")
    embedding = TokenAndPositionEmbedding(
        vocabulary_size,
        sequence_length,
        embedding_dim,
        position=position,
        mask_zero=True,
        embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
        name="embedding",
    )
    x = embedding(token_ids)
    x = keras.layers.Dropout(dropout, name="embedding_dropout")(x)
    x = stack_blocks(
        x,
        TransformerDecoderBlock,
        num_layers,
        "decoder",
        num_heads=num_heads,
        intermediate_dim=intermediate_dim,
        dropout=dropout,
        normalize_first=normalize_first,
        final_norm_name="final_norm",
    )
    logits = _output_layer(x, embedding, vocabulary_size, tie_embeddings, "logits")
    model = keras.Model(token_ids, logits, name=name)
    return model


def transformer_language_model_states(model: keras.Model) -> keras.Model:
    """`token_ids -> (states, logits)` of a `transformer_language_model`.

    `states` `(batch, T, d)` are the last hidden states, those the output
    projection turns into `logits` (after the final norm of a pre-norm
    model): what `keras_attn.ops.continuous_cache_stream_probabilities`
    remembers. The weights are the model's own; one call gives both outputs.
    """
    config = language_model_config(model)
    last = "final_norm" if config["normalize_first"] else None
    return _with_states(model, last or f"decoder_{config['num_layers'] - 1}")


def transformer_translator_states(model: keras.Model) -> keras.Model:
    """`{"encoder_inputs", "decoder_inputs"} -> (states, logits)` of a
    Transformer translator (either builder), teacher-forced.

    `states` `(batch, T, d)` are the decoder's last hidden states, those the
    output projection turns into `logits` (after the final decoder norm of a
    pre-norm decoder): the keys of a `keras_attn.models.TranslationDatastore`.
    The weights are the model's own; one call gives both outputs.
    """
    config = translator_config(model)
    if config["kind"] != "transformer":
        raise ValueError(
            "Expected a model built by transformer_translator or "
            f"bert_transformer_translator. Received: an RNN translator {model.name!r}"
        )
    last = "decoder_norm" if config["decoder_norm"] else None
    return _with_states(model, last or f"decoder_{config['num_decoder_layers'] - 1}")


def _with_states(model: keras.Model, states_layer: str) -> keras.Model:
    """The model with a second output: the output of its layer `states_layer`."""
    states = model.get_layer(states_layer).output
    return keras.Model(
        model.inputs, [states, model.output], name=f"{model.name}_states"
    )


def _blocks(model, prefix, count):
    return [model.get_layer(f"{prefix}_{index}") for index in range(count)]


def _logits_fn(model, embedding):
    logits_layer = model.get_layer("logits")
    if isinstance(logits_layer, keras.layers.Dense):
        return logits_layer
    # Not a lambda: AutoGraph cannot find a lambda's source here and logs a
    # warning each time a decoding function is traced.
    return functools.partial(_tied_logits, logits_layer, embedding)


def _tied_logits(logits_layer, embedding, hidden):
    return logits_layer(embedding(hidden, reverse=True))


def transformer_language_model_decoding(model: keras.Model):
    """`(initial_cache, next_fn)` for `keras_attn.generation` over the KV cache.

    - `initial_cache(batch_size, max_length)`: a tuple, one
      `(key_cache, value_cache)` per block, each
      `(batch, max_length, heads, head_dim)` zeros.
    - `next_fn(token_ids, cache, index) -> (logits, cache)`: token ids
      `(batch, T)` at positions `index .. index + T - 1` (a prompt chunk or one
      token); float32 logits `(batch, T, vocab)`.
    """
    config = language_model_config(model)
    embedding = model.get_layer("embedding")
    blocks = _blocks(model, "decoder", config["num_layers"])
    final_norm = model.get_layer("final_norm") if config["normalize_first"] else None
    to_logits = _logits_fn(model, embedding)

    def initial_cache(batch_size, max_length):
        return tuple(block.initial_cache(batch_size, max_length) for block in blocks)

    def next_fn(token_ids, cache, index):
        x = embedding(token_ids, start_index=index)  # (B, T, d)
        new_cache = []
        for block, block_cache in zip(blocks, cache, strict=True):
            x, block_cache = block(
                x, self_attention_cache=block_cache, cache_update_index=index
            )
            new_cache.append(block_cache)
        if final_norm is not None:
            x = final_norm(x)
        return to_logits(x), tuple(new_cache)

    return initial_cache, next_fn


def _translator_parts(model: keras.Model):
    """`(encode_source, target_embedding, decoders, decoder_norm)` of a
    Transformer translator (either builder): `encode_source(ids) -> (x, mask)`
    runs the source embedding (and its layer norm, for a pretrained BERT
    encoder), the encoder blocks and the final encoder norm (pre-norm)."""
    config = translator_config(model)
    shared = config["shared_vocabulary"]
    source_embedding = model.get_layer(
        "shared_embedding" if shared else "source_embedding"
    )
    target_embedding = model.get_layer(
        "shared_embedding" if shared else "target_embedding"
    )
    encoders = _blocks(model, "encoder", config["num_encoder_layers"])
    decoders = _blocks(model, "decoder", config["num_decoder_layers"])

    def optional(layer_name):
        return model.get_layer(layer_name) if config[layer_name] else None

    source_embedding_norm = optional("source_embedding_norm")
    encoder_norm = optional("encoder_norm")

    def encode_source(encoder_inputs):
        encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
        mask = ops.not_equal(encoder_inputs, 0)  # (B, S)
        x = source_embedding(encoder_inputs)
        if source_embedding_norm is not None:
            x = source_embedding_norm(x)
        for block in encoders:
            x = block(x, padding_mask=mask)
        if encoder_norm is not None:
            x = encoder_norm(x)
        return x, mask

    return encode_source, target_embedding, decoders, optional("decoder_norm")


def transformer_translator_decoding(model: keras.Model, nearest_neighbors=None):
    """`(encode, next_fn)` for decoding a `transformer_translator`.

    - `encode(encoder_inputs, max_length) -> cache`: runs the encoder once and
      computes every decoder block's cross-attention keys and values; the cache
      is a dict with batch on axis 0: `memory_mask` `(B, S)`, `cross` (one
      `(key, value)` per block), `self` (one zero `(key_cache, value_cache)`
      of `max_length` positions per block).
    - `next_fn(token_ids, cache, index) -> (logits, cache)`: decoder tokens
      `(B, T)` at positions `index..index+T-1`; float32 logits `(B, T, vocab)`.

    With `nearest_neighbors` (a `keras_attn.models.NearestNeighborDecoding`),
    `next_fn` returns instead the log-probabilities of the kNN-MT mixture
    (which the samplers' log-softmax leaves as they are).
    """
    encode_source, target_embedding, decoders, decoder_norm = _translator_parts(model)
    to_logits = _logits_fn(model, target_embedding)
    mix = None if nearest_neighbors is None else nearest_neighbors.mix_fn()

    def encode(encoder_inputs, max_length):
        x, mask = encode_source(encoder_inputs)
        batch = ops.shape(mask)[0]
        return {
            "memory_mask": mask,
            "cross": tuple(
                block.compute_cross_attention_cache(x) for block in decoders
            ),
            "self": tuple(block.initial_cache(batch, max_length) for block in decoders),
        }

    def next_fn(token_ids, cache, index):
        y = target_embedding(token_ids, start_index=index)  # (B, T, d)
        new_self = []
        for block, self_cache, cross_cache in zip(
            decoders, cache["self"], cache["cross"], strict=True
        ):
            y, self_cache = block(
                y,
                encoder_padding_mask=cache["memory_mask"],
                self_attention_cache=self_cache,
                cross_attention_cache=cross_cache,
                cache_update_index=index,
            )
            new_self.append(self_cache)
        if decoder_norm is not None:
            y = decoder_norm(y)
        logits = to_logits(y)
        if mix is not None:
            batch, steps = ops.shape(y)[0], ops.shape(y)[1]
            logits = ops.reshape(
                mix(
                    ops.reshape(y, (batch * steps, y.shape[-1])),
                    ops.reshape(logits, (batch * steps, logits.shape[-1])),
                ),
                (batch, steps, logits.shape[-1]),
            )
        return logits, dict(cache, self=tuple(new_self))

    return encode, next_fn


def transformer_translator_alignment(model: keras.Model):
    """`align(encoder_inputs, decoder_inputs) -> (batch, T, S)` float32 weights.

    The cross-attention weights of the last decoder block, averaged over its
    heads, in a teacher-forced pass: the alignment drawn in the lectures'
    heatmaps (and served by the `translate_with_alignment` signature).
    """
    encode_source, target_embedding, decoders, _ = _translator_parts(model)

    def align(encoder_inputs, decoder_inputs):
        decoder_inputs = ops.convert_to_tensor(decoder_inputs, "int32")
        target_mask = ops.not_equal(decoder_inputs, 0)
        x, source_mask = encode_source(encoder_inputs)
        y = target_embedding(decoder_inputs)
        for block in decoders:
            y, scores = block(
                y,
                x,
                decoder_padding_mask=target_mask,
                encoder_padding_mask=source_mask,
                return_attention_scores=True,
            )
        cross = ops.cast(scores["cross_attention"], "float32")  # (B, N, T, S)
        return ops.mean(cross, axis=1)  # (B, T, S)

    return align
