"""`TransformerDecoder` (alias `TransformerDecoderBlock`): causal
self-attention, cross-attention and feed-forward, each with Add & Norm, with a
KV cache for decoding."""

from __future__ import annotations

import keras

from keras_attn import _validation as v
from keras_attn.layers import kv_cache
from keras_attn.layers._transformer_block import (
    TransformerBlockBase,
)
from keras_attn.layers.multi_head_attention import MultiHeadAttention
from keras_attn.layers.multi_head_self_attention import MultiHeadSelfAttention
from keras_attn.ops.masks import combine_masks

# The two cache forms a call can use (see the class docstring).
TUPLE_CACHE = "tuple"  # keras-attn: (key_cache, value_cache), `cache_update_index`
STACKED_CACHE = "stacked"  # keras-hub: (B, 2, L, N, H), `*_cache_update_index`


def _describe(value):
    """A short description of an argument for error messages."""
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(item) for item in value) + ")"
    if hasattr(value, "shape"):
        return f"<tensor of shape {tuple(value.shape)}>"
    return repr(value)


@keras.saving.register_keras_serializable(package="keras_attn")
class TransformerDecoder(TransformerBlockBase):
    """One decoder layer of the Transformer (Vaswani et al., 2017).

    From "Attention Is All You Need" (https://arxiv.org/abs/1706.03762),
    section 3.1: masked (causal) multi-head self-attention, multi-head
    attention over the encoder output, and a position-wise feed-forward
    network, each wrapped in a residual connection and layer normalization
    (post-norm; pre-norm with `normalize_first=True`). Called without an
    encoder sequence the block has no cross-attention: a decoder-only
    (GPT-style) language-model block. Whether the block has cross-attention is
    fixed by its first call (its build).

    A drop-in for `keras_hub.layers.TransformerDecoder`: the same class name,
    the same arguments in the same order, with the same defaults, the same
    call arguments (the stacked caches included), and keras-hub's structure:
    the same variables (seed generator states included) in the same order
    under the same paths, held by sublayers under keras-hub's attribute
    names (`_self_attention_layer`, `_self_attention_layer_norm`,
    `_self_attention_dropout`, `_cross_attention_layer`,
    `_cross_attention_layer_norm`, `_cross_attention_dropout`,
    `_feedforward_intermediate_dense`, `_feedforward_output_dense`,
    `_feedforward_layer_norm`, `_feedforward_dropout`). Weights copy with
    `set_weights(get_weights())`, and a `.weights.h5` file of a model built
    on keras-hub's `TransformerDecoder` loads into the same model built on
    this one, and the other way. `TransformerDecoderBlock` is another name
    of this class. What keras-attn adds: `key_dim`, `attention_dropout`,
    `flash_attention`, `seed`, `return_attention_scores`, a tuple cache
    that `keras_attn.generation` decodes with, and zero attention rows for
    padded tokens (never NaN).
    Explicit padding masks are combined with the Keras masks of the inputs
    (keras-hub replaces the Keras mask by them).

    Decoding with a cache. The block takes two forms, told apart by the
    structure of `self_attention_cache`:

    - keras-attn's: `self_attention_cache` is a tuple `(key_cache,
      value_cache)` of `(batch, max_length, num_heads, head_dim)` tensors
      (start from `initial_cache`) and `cache_update_index=i`; the
      cross-attention keys and values are computed once per source with
      `compute_cross_attention_cache(encoder_sequence)` and passed as
      `cross_attention_cache`, a tuple that replaces `encoder_sequence`. The
      call returns `(outputs, self_attention_cache)`; the cross-attention cache
      never changes and is not returned.
    - keras-hub's: `self_attention_cache` is one stacked `(batch, 2,
      max_length, num_heads, head_dim)` tensor (keys at `[:, 0]`, values at
      `[:, 1]`) with `self_attention_cache_update_index=i`; a block with
      cross-attention also takes `encoder_sequence` and a stacked
      `cross_attention_cache` `(batch, 2, S, num_heads, head_dim)`, filled
      from `encoder_sequence` when `cross_attention_cache_update_index=0` and
      reused as it is when it is `None`. The call returns what keras-hub's
      returns: `(outputs, self_attention_cache)` without cross-attention,
      `(outputs, self_attention_cache, cross_attention_cache)` with it.

    In both forms a call with `T` new tokens writes their keys and values at
    positions `i..i+T-1` (`keras_attn.ops.update_cache`: core ops only, so the
    exported graph runs in a stock TF Serving) and lets them attend to
    positions `<= their own` in the cache; the returned caches have the same
    shapes (fit for `ops.while_loop`).

    Args:
        intermediate_dim: hidden size of the feed-forward network.
        num_heads: number of attention heads (self and cross).
        dropout: dropout rate after each sublayer (and on the attention
            weights unless `attention_dropout` is given).
        activation: activation of the feed-forward network.
        layer_norm_epsilon: epsilon of the layer norms.
        kernel_initializer, bias_initializer: of the dense and attention
            projections.
        normalize_first: pre-norm (`True`) or post-norm (`False`, the paper).
        key_dim: size of each head; defaults to `d_model // num_heads`.
        attention_dropout: dropout rate on the attention weights; defaults to
            `dropout`.
        flash_attention: the attention path, as in `MultiHeadAttention`.
        seed: seed of the dropouts.
        num_key_value_heads: grouped-query attention: the key/value heads of
            the attention layers, dividing `num_heads` (`None`: `num_heads`;
            see `keras_attn.layers.MultiHeadAttention`). In `get_config`
            only when set.
        position: where the block places the tokens: `"rotary"` (a
            `RotaryEmbedding` rotating the self-attention's queries and keys)
            or `"alibi"` (an `AlibiBias` on its logits), at the cache offset
            when decoding; `None`, `"sinusoidal"` or `"learned"`: absolute
            positions added to the embeddings before the first block, the
            block adding nothing (the default). In `get_config` only when set.
        sliding_window: optional positive int, the self-attention's window
            (Keras 3.15's meaning: query `i` sees key `j` when
            `|i - j| < sliding_window`, the causal mask also applying in a
            decoder block). In `get_config` only when set.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        decoder_sequence: `(batch, T, d_model)`.
        encoder_sequence: `(batch, S, d_encoder)`, or `None` for a block
            without cross-attention, or when a tuple `cross_attention_cache`
            is given.
        decoder_padding_mask: boolean `(batch, T)` for the tokens of
            `decoder_sequence`, combined with its Keras mask. Padded tokens
            are ignored as keys and get zero attention rows. With a cache it
            masks the new tokens as queries only: mask cached keys with
            `decoder_attention_mask`.
        decoder_attention_mask: boolean `(batch, T, T)` (with a cache
            `(batch, T, max_length)`), combined with the causal mask.
        encoder_padding_mask: boolean `(batch, S)`, combined with the Keras
            mask of `encoder_sequence`. Pass it at every decoding step too.
        encoder_attention_mask: boolean `(batch, T, S)`.
        self_attention_cache: the self-attention cache, a tuple or a stacked
            tensor (see above).
        self_attention_cache_update_index: with a stacked cache, the position
            of the first new token (int or scalar int tensor); `None` uses the
            cache without writing it.
        cross_attention_cache: a tuple `(key, value)`, each
            `(batch, S, num_heads, head_dim)`, from
            `compute_cross_attention_cache`, replacing `encoder_sequence`; or
            keras-hub's stacked tensor.
        cross_attention_cache_update_index: with a stacked cross-attention
            cache: `0` fills it from `encoder_sequence`, `None` reuses it.
        use_causal_mask: mask future tokens in the self-attention (default
            `True`, as keras-hub).
        training: whether dropout is active.
        return_attention_scores: also return the attention weights.
        cache_update_index: with a tuple cache, the position of the first new
            token (int or scalar int tensor).
        mask, decoder_sequence_mask, encoder_sequence_mask: filled by Keras
            with the Keras masks of the inputs (`mask` when `decoder_sequence`
            is the only tensor argument).

    Returns:
        One structure per set of arguments: `outputs` `(batch, T, d_model)`;
        `(outputs, attention_scores)` with `return_attention_scores=True`;
        with a cache, `outputs` (and the scores) followed by the caches of its
        form, as listed above. `attention_scores` is a dict:
        `"self_attention"` `(batch, num_heads, T, T or max_length)` and, in
        blocks with cross-attention, `"cross_attention"`
        `(batch, num_heads, T, S)`. The Keras mask of `decoder_sequence` is
        passed on.

    Example:

    ```python
    block = keras_attn.layers.TransformerDecoder(intermediate_dim=512, num_heads=4)
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
        # keras-hub's sublayers, attribute names and creation order.
        self._self_attention_layer = MultiHeadSelfAttention(
            key_dim=self.key_dim,
            causal=True,
            name="self_attention",
            **self._attention_kwargs(self_attention=True),
        )
        self._self_attention_layer.build(decoder_sequence_shape)
        self._self_attention_layer_norm = self._layer_norm(
            "self_attention_layer_norm", decoder_sequence_shape
        )
        self._self_attention_dropout = self._dropout("self_attention_dropout")
        self._cross_attention_layer = None
        if encoder_sequence_shape is not None:
            v.check_rank("encoder_sequence", encoder_sequence_shape, 3)
            self._cross_attention_layer = MultiHeadAttention(
                key_dim=self._head_dim(decoder_sequence_shape[-1]),
                name="cross_attention",
                **self._attention_kwargs(),
            )
            self._cross_attention_layer.build(
                decoder_sequence_shape, encoder_sequence_shape
            )
            self._cross_attention_layer_norm = self._layer_norm(
                "cross_attention_layer_norm", decoder_sequence_shape
            )
            self._cross_attention_dropout = self._dropout("cross_attention_dropout")
        self._build_feed_forward(decoder_sequence_shape)
        self._feedforward_layer_norm = self._layer_norm(
            "feedforward_layer_norm", decoder_sequence_shape
        )
        self._feedforward_dropout = self._dropout("feedforward_dropout")
        self.built = True

    @property
    def has_cross_attention(self) -> bool:
        """Whether the block was built with an encoder sequence."""
        self._check_built("has_cross_attention")
        return self._cross_attention_layer is not None

    def _check_built(self, what):
        if not self.built:
            raise ValueError(
                f"`{what}` needs a built block: call it once (or `build` it) "
                f"first. Received: block {self.name!r} not built"
            )

    # -- decoding helpers -------------------------------------------------------

    def initial_cache(
        self, batch_size, max_length: int, dtype=None, stacked: bool = False
    ):
        """An all-zero self-attention cache.

        Args:
            batch_size: int or scalar int tensor.
            max_length: number of positions the cache holds.
            dtype: defaults to the block's compute dtype.
            stacked: keras-hub's form, one `(batch_size, 2, max_length,
                heads, head_dim)` tensor, instead of keras-attn's tuple
                (`heads`: `num_key_value_heads` when set).

        Returns:
            `(key_cache, value_cache)`, two zero tensors `(batch_size,
            max_length, num_heads, head_dim)`; or the stacked tensor.
        """
        self._check_built("initial_cache")
        dtype = dtype or self.compute_dtype
        attention = self._self_attention_layer
        return kv_cache.initial_cache(
            batch_size,
            max_length,
            attention.key_value_heads,
            attention.key_dim,
            attention.value_dim,
            dtype,
            stacked,
        )

    def compute_cross_attention_cache(self, encoder_sequence):
        """The cross-attention `(key, value)`, each `(batch, S, heads, head_dim)`.

        Compute it once per source and pass it as `cross_attention_cache` at
        every decoding step.
        """
        self._check_built("compute_cross_attention_cache")
        if self._cross_attention_layer is None:
            raise ValueError(
                "This block has no cross-attention (it was built without an "
                f"encoder sequence). Received: block {self.name!r}"
            )
        v.check_rank("encoder_sequence", encoder_sequence.shape, 3)
        return self._cross_attention_layer.compute_key_value(encoder_sequence)

    # -- the forward pass ---------------------------------------------------------

    def _cache_form(
        self,
        encoder_sequence,
        self_attention_cache,
        self_attention_cache_update_index,
        cross_attention_cache,
        cross_attention_cache_update_index,
        cache_update_index,
    ):
        """Check the call's arguments; `None` (no self-attention cache),
        `TUPLE_CACHE` (keras-attn's form) or `STACKED_CACHE` (keras-hub's)."""
        has_cross = self._cross_attention_layer is not None
        if not has_cross:
            for name, value in (
                ("encoder_sequence", encoder_sequence),
                ("cross_attention_cache", cross_attention_cache),
                (
                    "cross_attention_cache_update_index",
                    cross_attention_cache_update_index,
                ),
            ):
                if value is not None:
                    raise ValueError(
                        "This block was built without cross-attention (its "
                        "first call had no `encoder_sequence`); call it without "
                        f"`{name}`. Received: {name}={_describe(value)}"
                    )
        hub_form = (
            kv_cache.is_stacked(self_attention_cache)
            or kv_cache.is_stacked(cross_attention_cache)
            or self_attention_cache_update_index is not None
            or cross_attention_cache_update_index is not None
        )
        if hub_form:
            for name, cache in (
                ("self_attention_cache", self_attention_cache),
                ("cross_attention_cache", cross_attention_cache),
            ):
                if cache is not None and not kv_cache.is_stacked(cache):
                    raise ValueError(
                        "Use one cache form per call: keras-hub's stacked "
                        "tensors with `self_attention_cache_update_index` / "
                        "`cross_attention_cache_update_index`, or keras-attn's "
                        "tuples with `cache_update_index`. Received: "
                        f"{name}={_describe(cache)} with the stacked form"
                    )
            if cache_update_index is not None:
                raise ValueError(
                    "With keras-hub's stacked caches the index is "
                    "`self_attention_cache_update_index`; `cache_update_index` "
                    "goes with keras-attn's tuple caches. Received: "
                    f"cache_update_index={_describe(cache_update_index)}"
                )
            for cache_name, cache, index_name, index in (
                (
                    "self_attention_cache",
                    self_attention_cache,
                    "self_attention_cache_update_index",
                    self_attention_cache_update_index,
                ),
                (
                    "cross_attention_cache",
                    cross_attention_cache,
                    "cross_attention_cache_update_index",
                    cross_attention_cache_update_index,
                ),
            ):
                if cache is None and index is not None:
                    raise ValueError(
                        f"`{index_name}` needs a `{cache_name}`. Received: "
                        f"{cache_name}=None, {index_name}={_describe(index)}"
                    )
            if has_cross:
                if encoder_sequence is None:
                    raise ValueError(
                        "This block has cross-attention: with stacked caches "
                        "it takes `encoder_sequence` too (as keras-hub's "
                        "TransformerDecoder). Received: encoder_sequence=None"
                    )
                if (self_attention_cache is None) != (cross_attention_cache is None):
                    raise ValueError(
                        "With cross-attention, the stacked "
                        "`self_attention_cache` and `cross_attention_cache` are "
                        "both set or both None. Received: self_attention_cache="
                        f"{_describe(self_attention_cache)}, cross_attention_cache="
                        f"{_describe(cross_attention_cache)}"
                    )
            return None if self_attention_cache is None else STACKED_CACHE
        if has_cross and (encoder_sequence is None) == (cross_attention_cache is None):
            raise ValueError(
                "This block has cross-attention: pass exactly one of "
                "`encoder_sequence` and `cross_attention_cache`. Received: "
                f"encoder_sequence={_describe(encoder_sequence)}, "
                f"cross_attention_cache={_describe(cross_attention_cache)}"
            )
        if (self_attention_cache is None) != (cache_update_index is None):
            raise ValueError(
                "`self_attention_cache` and `cache_update_index` go together. "
                f"Received: self_attention_cache={_describe(self_attention_cache)}, "
                f"cache_update_index={_describe(cache_update_index)}"
            )
        return None if self_attention_cache is None else TUPLE_CACHE

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_padding_mask=None,
        encoder_attention_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        cross_attention_cache_update_index=None,
        use_causal_mask: bool = True,
        training=None,
        return_attention_scores: bool = False,
        cache_update_index=None,
        mask=None,
        decoder_sequence_mask=None,
        encoder_sequence_mask=None,
    ):
        form = self._cache_form(
            encoder_sequence,
            self_attention_cache,
            self_attention_cache_update_index,
            cross_attention_cache,
            cross_attention_cache_update_index,
            cache_update_index,
        )
        decoder_padding = combine_masks(
            decoder_padding_mask, decoder_sequence_mask, mask
        )  # (B, T)
        scores = {}

        # Masked (causal) self-attention.
        attended = self._self_attention_layer(
            self._pre(decoder_sequence, self._self_attention_layer_norm),
            mask=decoder_padding,
            attention_mask=decoder_attention_mask,
            return_attention_scores=return_attention_scores,
            training=training,
            cache=self_attention_cache,
            cache_update_index=(
                cache_update_index
                if form == TUPLE_CACHE
                else self_attention_cache_update_index
            ),
            use_causal_mask=use_causal_mask,
        )  # (B, T, d) [, (B, N, T, Tk)] [, cache]
        if self_attention_cache is not None:
            *attended, self_attention_cache = attended
            attended = attended[0] if len(attended) == 1 else tuple(attended)
        if return_attention_scores:
            attended, scores["self_attention"] = attended
        x = self._post(
            decoder_sequence,
            attended,
            self._self_attention_layer_norm,
            self._self_attention_dropout,
            training,
        )

        # Cross-attention to the encoder sequence (or its cached keys/values).
        if self._cross_attention_layer is not None:
            encoder_padding = combine_masks(
                encoder_padding_mask, encoder_sequence_mask
            )  # (B, S)
            attended = self._cross_attention_layer(
                self._pre(x, self._cross_attention_layer_norm),
                encoder_sequence,
                query_mask=decoder_padding,
                value_mask=encoder_padding,
                attention_mask=encoder_attention_mask,
                return_attention_scores=return_attention_scores,
                training=training,
                cache=cross_attention_cache,
                cache_update_index=cross_attention_cache_update_index,
            )  # (B, T, d) [, (B, N, T, S)] [, cache]
            if cross_attention_cache is not None:
                *attended, cross_attention_cache = attended
                attended = attended[0] if len(attended) == 1 else tuple(attended)
            if return_attention_scores:
                attended, scores["cross_attention"] = attended
            x = self._post(
                x,
                attended,
                self._cross_attention_layer_norm,
                self._cross_attention_dropout,
                training,
            )

        outputs = self._feed_forward_block(x, training)
        result = (outputs,)
        if return_attention_scores:
            result += (scores,)
        if form == TUPLE_CACHE:
            result += (tuple(self_attention_cache),)
        elif form == STACKED_CACHE:
            result += (self_attention_cache,)
            if self._cross_attention_layer is not None:
                result += (cross_attention_cache,)
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
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        cross_attention_cache_update_index=None,
        use_causal_mask=True,
        training=None,
        return_attention_scores=False,
        cache_update_index=None,
        mask=None,
        decoder_sequence_mask=None,
        encoder_sequence_mask=None,
    ):
        form = self._cache_form(
            encoder_sequence,
            self_attention_cache,
            self_attention_cache_update_index,
            cross_attention_cache,
            cross_attention_cache_update_index,
            cache_update_index,
        )
        v.check_rank("decoder_sequence", decoder_sequence.shape, 3)
        batch, length = decoder_sequence.shape[0], decoder_sequence.shape[1]
        if form is None:
            key_length = length
        else:
            key_length = kv_cache.cache_length(self_attention_cache)
        source_length = None
        if self._cross_attention_layer is not None:
            if cross_attention_cache is None:
                source_length = encoder_sequence.shape[1]
            else:
                source_length = kv_cache.cache_length(cross_attention_cache)
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
            if self._cross_attention_layer is not None:
                scores["cross_attention"] = keras.KerasTensor(
                    (batch, self.num_heads, length, source_length), dtype=dtype
                )
            result += (scores,)
        if form == TUPLE_CACHE:
            result += (kv_cache.cache_spec(tuple(self_attention_cache)),)
        elif form == STACKED_CACHE:
            result += (kv_cache.cache_spec(self_attention_cache),)
            if self._cross_attention_layer is not None:
                result += (kv_cache.cache_spec(cross_attention_cache),)
        return result[0] if len(result) == 1 else result


# The public second name of the class (keras-attn's names of the blocks).
TransformerDecoderBlock = TransformerDecoder
