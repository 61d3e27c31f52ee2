"""`TransformerDecoderBlock`: causal self-attention, cross-attention and
feed-forward, each with Add & Norm, with a KV cache for decoding."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers._transformer_block import TransformerBlockBase, first_given
from keras_attn.layers.multi_head_attention import MultiHeadAttention
from keras_attn.layers.multi_head_self_attention import MultiHeadSelfAttention
from keras_attn.ops.masks import padding_mask as as_padding_mask


@keras.saving.register_keras_serializable(package="keras_attn")
class TransformerDecoderBlock(TransformerBlockBase):
    """One decoder layer of the Transformer (Vaswani et al., 2017).

    From "Attention Is All You Need" (https://arxiv.org/abs/1706.03762),
    section 3.1: masked (causal) multi-head self-attention, multi-head
    attention over the encoder output, and a position-wise feed-forward
    network, each wrapped in a residual connection and layer normalization
    (post-norm; pre-norm with `normalize_first=True`). Called without an
    encoder sequence the block has no cross-attention: a decoder-only
    (GPT-style) language-model block. Whether the block has cross-attention is
    fixed by its first call (its build).

    The weights have the shapes, names and order of
    `keras_hub.layers.TransformerDecoder`, so they copy with
    `set_weights(get_weights())`.

    Decoding with a cache: each block keeps its own self-attention cache, a
    tuple `(key_cache, value_cache)` of `(batch, max_length, num_heads,
    head_dim)` tensors (start from `initial_cache`). A call with
    `self_attention_cache` and `cache_update_index=i` writes the keys and
    values of its `T` new tokens at positions `i..i+T-1` (`ops.slice_update`)
    and lets them attend to positions `<= their own` in the cache; it returns
    the new cache, which has the same shapes (fit for `ops.while_loop`). The
    cross-attention keys and values are computed once per source with
    `compute_cross_attention_cache(encoder_sequence)` and passed as
    `cross_attention_cache` at every step.

    Args:
        num_heads: number of attention heads (self and cross).
        intermediate_dim: hidden size of the feed-forward network.
        dropout: dropout rate after each sublayer (and on the attention
            weights unless `attention_dropout` is given).
        activation: activation of the feed-forward network.
        normalize_first: pre-norm (`True`) or post-norm (`False`, the paper).
        layer_norm_epsilon: epsilon of the layer norms.
        key_dim: size of each head; defaults to `d_model // num_heads`.
        attention_dropout: dropout rate on the attention weights; defaults to
            `dropout`.
        kernel_initializer, bias_initializer: of the dense and attention
            projections.
        seed: seed of the dropouts.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        decoder_sequence: `(batch, T, d_model)`.
        encoder_sequence: `(batch, S, d_encoder)`, or `None` for a block
            without cross-attention, or when `cross_attention_cache` is given.
        decoder_padding_mask: boolean `(batch, T)` for the tokens of
            `decoder_sequence`; defaults to its Keras mask. Padded tokens are
            ignored as keys and get zero attention rows. With a cache it masks
            the new tokens as queries only: mask cached keys with
            `decoder_attention_mask`.
        decoder_attention_mask: boolean `(batch, T, T)` (with a cache
            `(batch, T, max_length)`), combined with the causal mask.
        encoder_padding_mask: boolean `(batch, S)`; defaults to the Keras mask
            of `encoder_sequence`. Pass it at every decoding step too.
        encoder_attention_mask: boolean `(batch, T, S)`.
        return_attention_scores: also return the attention weights.
        self_attention_cache: `(key_cache, value_cache)`, each
            `(batch, max_length, num_heads, head_dim)`; needs
            `cache_update_index`.
        cross_attention_cache: `(key, value)`, each
            `(batch, S, num_heads, head_dim)`, from
            `compute_cross_attention_cache`; replaces `encoder_sequence`.
        cache_update_index: int or scalar int tensor, the position of the first
            new token in the cache.
        training: whether dropout is active.
        mask, decoder_sequence_mask, encoder_sequence_mask: filled by Keras
            with the Keras masks of the inputs (`mask` when `decoder_sequence`
            is the only tensor argument); pass the padding masks instead.

    Returns:
        One structure per set of arguments:
        `outputs` `(batch, T, d_model)`;
        `(outputs, attention_scores)` with `return_attention_scores=True`;
        `(outputs, self_attention_cache)` with a `self_attention_cache`;
        `(outputs, attention_scores, self_attention_cache)` with both.
        `attention_scores` is a dict: `"self_attention"`
        `(batch, num_heads, T, T or max_length)` and, in blocks with
        cross-attention, `"cross_attention"` `(batch, num_heads, T, S)`.
        The Keras mask of `decoder_sequence` is passed on.

    Example:

    ```python
    block = keras_attn.layers.TransformerDecoderBlock(4, 512)
    target = keras.Input((None, 128))
    source = keras.Input((None, 128))
    outputs = block(target, source)  # (batch, T, 128)

    # Decoding one token at a time, cache of 32 positions:
    cross = block.compute_cross_attention_cache(source_values)
    cache = block.initial_cache(batch_size, 32)
    for i in range(32):
        step, cache = block(
            target_values[:, i : i + 1],
            self_attention_cache=cache,
            cross_attention_cache=cross,
            cache_update_index=i,
        )
    ```
    """

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        self._check_model_dim("decoder_sequence", decoder_sequence_shape)
        self.self_attention = MultiHeadSelfAttention(
            key_dim=self.key_dim,
            causal=True,
            name="self_attention",
            **self._attention_kwargs(),
        )
        self.self_attention.build(decoder_sequence_shape)
        self.self_attention_layer_norm = self._layer_norm(
            "self_attention_layer_norm", decoder_sequence_shape
        )
        self.self_attention_dropout = self._dropout("self_attention_dropout")
        self.cross_attention = None
        if encoder_sequence_shape is not None:
            v.check_rank("encoder_sequence", encoder_sequence_shape, 3)
            self.cross_attention = MultiHeadAttention(
                key_dim=self._head_dim(decoder_sequence_shape[-1]),
                name="cross_attention",
                **self._attention_kwargs(),
            )
            self.cross_attention.build(decoder_sequence_shape, encoder_sequence_shape)
            self.cross_attention_layer_norm = self._layer_norm(
                "cross_attention_layer_norm", decoder_sequence_shape
            )
            self.cross_attention_dropout = self._dropout("cross_attention_dropout")
        self._build_feed_forward(decoder_sequence_shape)
        self.feedforward_layer_norm = self._layer_norm(
            "feedforward_layer_norm", decoder_sequence_shape
        )
        self.built = True

    @property
    def has_cross_attention(self) -> bool:
        """Whether the block was built with an encoder sequence."""
        self._check_built("has_cross_attention")
        return self.cross_attention is not None

    def _check_built(self, what):
        if not self.built:
            raise ValueError(
                f"`{what}` needs a built block: call it once (or `build` it) "
                f"first. Received: block {self.name!r} not built"
            )

    # -- decoding helpers -------------------------------------------------------

    def initial_cache(self, batch_size, max_length: int, dtype=None):
        """An all-zero self-attention cache `(key_cache, value_cache)`.

        Args:
            batch_size: int or scalar int tensor.
            max_length: number of positions the cache holds.
            dtype: defaults to the block's compute dtype.

        Returns:
            Two zero tensors `(batch_size, max_length, num_heads, head_dim)`.
        """
        self._check_built("initial_cache")
        dtype = dtype or self.compute_dtype
        attention = self.self_attention
        key_shape = (batch_size, max_length, self.num_heads, attention.key_dim)
        value_shape = (batch_size, max_length, self.num_heads, attention.head_value_dim)
        return ops.zeros(key_shape, dtype=dtype), ops.zeros(value_shape, dtype=dtype)

    def compute_cross_attention_cache(self, encoder_sequence):
        """The cross-attention `(key, value)`, each `(batch, S, heads, head_dim)`.

        Compute it once per source and pass it as `cross_attention_cache` at
        every decoding step.
        """
        self._check_built("compute_cross_attention_cache")
        if self.cross_attention is None:
            raise ValueError(
                "This block has no cross-attention (it was built without an "
                f"encoder sequence). Received: block {self.name!r}"
            )
        v.check_rank("encoder_sequence", encoder_sequence.shape, 3)
        return self.cross_attention.compute_key_value(encoder_sequence)

    # -- the forward pass ---------------------------------------------------------

    def _check_call(
        self,
        encoder_sequence,
        self_attention_cache,
        cross_attention_cache,
        cache_update_index,
    ):
        if self.cross_attention is None:
            if encoder_sequence is not None or cross_attention_cache is not None:
                raise ValueError(
                    "This block was built without cross-attention (its first "
                    "call had no `encoder_sequence`); it takes neither "
                    "`encoder_sequence` nor `cross_attention_cache`. Received: "
                    f"encoder_sequence={encoder_sequence!r}, "
                    f"cross_attention_cache={cross_attention_cache!r}"
                )
        elif (encoder_sequence is None) == (cross_attention_cache is None):
            raise ValueError(
                "This block has cross-attention: pass exactly one of "
                "`encoder_sequence` and `cross_attention_cache`. Received: "
                f"encoder_sequence={encoder_sequence!r}, "
                f"cross_attention_cache={cross_attention_cache!r}"
            )
        if (self_attention_cache is None) != (cache_update_index is None):
            raise ValueError(
                "`self_attention_cache` and `cache_update_index` go together. "
                f"Received: self_attention_cache={self_attention_cache!r}, "
                f"cache_update_index={cache_update_index!r}"
            )

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_padding_mask=None,
        encoder_attention_mask=None,
        return_attention_scores: bool = False,
        self_attention_cache=None,
        cross_attention_cache=None,
        cache_update_index=None,
        training=None,
        mask=None,
        decoder_sequence_mask=None,
        encoder_sequence_mask=None,
    ):
        self._check_call(
            encoder_sequence,
            self_attention_cache,
            cross_attention_cache,
            cache_update_index,
        )
        decoder_padding = as_padding_mask(
            first_given(decoder_padding_mask, decoder_sequence_mask, mask)
        )  # (B, T)
        scores = {}

        # Masked (causal) self-attention.
        attended = self.self_attention(
            self._pre(decoder_sequence, self.self_attention_layer_norm),
            mask=decoder_padding,
            attention_mask=decoder_attention_mask,
            return_attention_scores=return_attention_scores,
            training=training,
            cache=self_attention_cache,
            cache_update_index=cache_update_index,
        )  # (B, T, d) [, (B, N, T, Tk)] [, cache]
        if self_attention_cache is not None:
            *attended, self_attention_cache = attended
            attended = attended[0] if len(attended) == 1 else tuple(attended)
        if return_attention_scores:
            attended, scores["self_attention"] = attended
        x = self._post(
            decoder_sequence,
            attended,
            self.self_attention_layer_norm,
            self.self_attention_dropout,
            training,
        )

        # Cross-attention to the encoder sequence (or its cached keys/values).
        if self.cross_attention is not None:
            encoder_padding = as_padding_mask(
                first_given(encoder_padding_mask, encoder_sequence_mask)
            )  # (B, S)
            attended = self.cross_attention(
                self._pre(x, self.cross_attention_layer_norm),
                encoder_sequence,
                query_mask=decoder_padding,
                value_mask=encoder_padding,
                attention_mask=encoder_attention_mask,
                return_attention_scores=return_attention_scores,
                training=training,
                cache=cross_attention_cache,
            )  # (B, T, d) [, (B, N, T, S)] [, cache]
            if cross_attention_cache is not None:
                attended = attended[:-1]
                attended = attended[0] if len(attended) == 1 else tuple(attended)
            if return_attention_scores:
                attended, scores["cross_attention"] = attended
            x = self._post(
                x,
                attended,
                self.cross_attention_layer_norm,
                self.cross_attention_dropout,
                training,
            )

        outputs = self._feed_forward_block(x, training)
        result = (outputs,)
        if return_attention_scores:
            result += (scores,)
        if self_attention_cache is not None:
            result += (tuple(self_attention_cache),)
        return result[0] if len(result) == 1 else result

    # -- Keras anatomy ---------------------------------------------------------

    def compute_output_shape(self, decoder_sequence_shape, encoder_sequence_shape=None):
        return tuple(decoder_sequence_shape)

    def compute_output_spec(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_padding_mask=None,
        encoder_attention_mask=None,
        return_attention_scores=False,
        self_attention_cache=None,
        cross_attention_cache=None,
        cache_update_index=None,
        training=None,
        mask=None,
        decoder_sequence_mask=None,
        encoder_sequence_mask=None,
    ):
        self._check_call(
            encoder_sequence,
            self_attention_cache,
            cross_attention_cache,
            cache_update_index,
        )
        v.check_rank("decoder_sequence", decoder_sequence.shape, 3)
        batch, length = decoder_sequence.shape[0], decoder_sequence.shape[1]
        key_length = (
            length if self_attention_cache is None else self_attention_cache[0].shape[1]
        )
        source_length = None
        if self.cross_attention is not None:
            source = (
                encoder_sequence
                if cross_attention_cache is None
                else cross_attention_cache[0]
            )
            source_length = source.shape[1]
        for name, tensor, shape in (
            ("decoder_padding_mask", decoder_padding_mask, (batch, length)),
            (
                "decoder_attention_mask",
                decoder_attention_mask,
                (batch, length, key_length),
            ),
            ("encoder_padding_mask", encoder_padding_mask, (batch, source_length)),
            (
                "encoder_attention_mask",
                encoder_attention_mask,
                (batch, length, source_length),
            ),
        ):
            v.check_mask_shape(name, tensor, shape)
        dtype = self.compute_dtype
        result = (keras.KerasTensor(decoder_sequence.shape, dtype=dtype),)
        if return_attention_scores:
            scores = {
                "self_attention": keras.KerasTensor(
                    (batch, self.num_heads, length, key_length), dtype=dtype
                )
            }
            if self.cross_attention is not None:
                scores["cross_attention"] = keras.KerasTensor(
                    (batch, self.num_heads, length, source_length), dtype=dtype
                )
            result += (scores,)
        if self_attention_cache is not None:
            result += (
                tuple(
                    keras.KerasTensor(t.shape, dtype=t.dtype)
                    for t in self_attention_cache
                ),
            )
        return result[0] if len(result) == 1 else result
