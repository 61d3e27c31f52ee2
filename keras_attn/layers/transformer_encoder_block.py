"""`TransformerEncoder` (alias `TransformerEncoderBlock`): self-attention and
feed-forward, each with Add & Norm."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers import padding_rows
from keras_attn.layers._transformer_block import (
    TransformerBlockBase,
)
from keras_attn.layers.multi_head_self_attention import MultiHeadSelfAttention
from keras_attn.ops.masks import combine_masks


@keras.saving.register_keras_serializable(package="keras_attn")
class TransformerEncoder(TransformerBlockBase):
    """One encoder layer of the Transformer (Vaswani et al., 2017).

    From "Attention Is All You Need" (https://arxiv.org/abs/1706.03762),
    section 3.1: multi-head self-attention, then a position-wise feed-forward
    network, each wrapped in a residual connection and layer normalization:

        x = LayerNorm(x + Dropout(SelfAttention(x)))
        x = LayerNorm(x + Dropout(W2 · activation(W1 · x + b1) + b2))

    With `normalize_first=True` the blocks are pre-norm (GPT-2 style,
    `x = x + Dropout(Sublayer(LayerNorm(x)))`), which trains more stably in
    deep stacks; the last block's output is then not normalized.

    A drop-in for `keras_hub.layers.TransformerEncoder`: the same class name,
    the same arguments in the same order, with the same defaults, and
    keras-hub's structure: the same variables (seed generator states
    included) in the same order under the same paths, held by sublayers
    under keras-hub's attribute names (`_self_attention_layer`,
    `_self_attention_layer_norm`, `_self_attention_dropout`,
    `_feedforward_layer_norm`, `_feedforward_intermediate_dense`,
    `_feedforward_output_dense`, `_feedforward_dropout`). Weights copy with
    `set_weights(get_weights())`, and a `.weights.h5` file of a model built
    on keras-hub's `TransformerEncoder` loads into the same model built on
    this one, and the other way. `TransformerEncoderBlock` is another name
    of this class. What
    keras-attn adds: `key_dim`, `attention_dropout`, `flash_attention`,
    `seed`; padded positions are ignored as keys and their own rows get a
    zero attention output (never NaN); explicit masks are combined with the
    Keras mask of `inputs` (keras-hub replaces the Keras mask by them);
    inside `keras_attn.layers.serving_mode()` a TensorFlow inference call
    with a padding mask runs its per-token sublayers on the real tokens
    only and returns zeros at padded positions.

    Args:
        intermediate_dim: hidden size of the feed-forward network.
        num_heads: number of attention heads.
        dropout: dropout rate after each sublayer (and on the attention
            weights unless `attention_dropout` is given).
        activation: activation of the feed-forward network.
        layer_norm_epsilon: epsilon of the layer norms.
        kernel_initializer, bias_initializer: of the dense and attention
            projections.
        normalize_first: pre-norm (`True`) or post-norm (`False`, the paper).
        key_dim: size of each head; defaults to `d_model // num_heads`.
        attention_dropout: dropout rate on the attention weights; defaults to
            `dropout` (as keras-hub). `0` keeps a fused attention kernel in
            training (dropout in training takes the memory-efficient path on
            long sequences, else the explicit path).
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
        inputs: `(batch, T, d_model)`.
        padding_mask: boolean `(batch, T)`, `True` for real tokens; combined
            with the Keras mask of `inputs` (e.g. from `Embedding(mask_zero=True)`
            or `TokenAndPositionEmbedding(..., mask_zero=True)`).
        attention_mask: boolean `(batch, T, T)`, `True` where query `i` may
            attend to key `j`; combined with the padding mask.
        training: whether dropout is active.
        return_attention_scores: also return the attention weights.
        mask, inputs_mask: filled by Keras with the Keras mask of `inputs`
            (`mask` when `inputs` is the only tensor argument, `inputs_mask`
            otherwise).

    Returns:
        `outputs` `(batch, T, d_model)`, or `(outputs, weights)` with
        `return_attention_scores=True`, weights `(batch, num_heads, T, T)`.
        The Keras mask of `inputs` is passed on.

    Example:

    ```python
    tokens = keras.Input((None,), dtype="int32")
    x = keras_attn.layers.TokenAndPositionEmbedding(
        8000, 256, 128, mask_zero=True
    )(tokens)
    x = keras_attn.layers.TransformerEncoder(intermediate_dim=512, num_heads=4)(x)
    encoder = keras.Model(tokens, x)  # (batch, T, 128), padding mask passed on
    ```
    """

    def build(self, inputs_shape):
        self._check_model_dim("inputs", inputs_shape)
        # keras-hub's sublayers, attribute names and creation order.
        self._self_attention_layer = MultiHeadSelfAttention(
            key_dim=self.key_dim,
            name="self_attention_layer",
            **self._attention_kwargs(self_attention=True),
        )
        self._self_attention_layer.build(inputs_shape)
        self._self_attention_layer_norm = self._layer_norm(
            "self_attention_layer_norm", inputs_shape
        )
        self._self_attention_dropout = self._dropout("self_attention_dropout")
        self._feedforward_layer_norm = self._layer_norm(
            "feedforward_layer_norm", inputs_shape
        )
        self._build_feed_forward(inputs_shape)
        self._feedforward_dropout = self._dropout("feedforward_dropout")
        self.built = True

    def call(
        self,
        inputs,
        padding_mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores: bool = False,
        mask=None,
        inputs_mask=None,
    ):
        padding = combine_masks(padding_mask, inputs_mask, mask)  # (B, T)
        attended = self._self_attention_layer(
            self._pre(inputs, self._self_attention_layer_norm),
            mask=padding,
            attention_mask=attention_mask,
            return_attention_scores=return_attention_scores,
            training=training,
        )  # (B, T, d) [, (B, N, T, T)]
        if return_attention_scores:
            attended, weights = attended
        if padding_rows.skips_padding(padding, training):
            # In serving mode: the per-token sublayers on the real tokens'
            # rows only, zeros at padded positions (keras_attn/ops/serving.py).
            rows = padding_rows.real_rows(padding)
            if rows.count == 0:  # eager, no real token: nothing to compute
                outputs = ops.zeros_like(inputs)
            else:
                outputs = self._per_token_sublayers(
                    padding_rows.gather_rows(inputs, rows),  # (R, d)
                    padding_rows.gather_rows(attended, rows),
                    training,
                )
                outputs = padding_rows.scatter_rows(outputs, rows)  # (B, T, d)
        else:
            outputs = self._per_token_sublayers(inputs, attended, training)
        return (outputs, weights) if return_attention_scores else outputs

    def _per_token_sublayers(self, inputs, attended, training):
        """The self-attention's Add & Norm and the feed-forward block, which
        read each token alone: `(B, T, d)` or real-token rows `(R, d)`."""
        x = self._post(
            inputs,
            attended,
            self._self_attention_layer_norm,
            self._self_attention_dropout,
            training,
        )
        return self._feed_forward_block(x, training)

    def compute_output_shape(
        self, inputs_shape, padding_mask_shape=None, attention_mask_shape=None
    ):
        return tuple(inputs_shape)

    def compute_output_spec(
        self,
        inputs,
        padding_mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        mask=None,
        inputs_mask=None,
    ):
        v.check_rank("inputs", inputs.shape, 3)
        batch, length = inputs.shape[0], inputs.shape[1]
        v.check_mask_shape("padding_mask", padding_mask, (batch, length))
        v.check_mask_shape("attention_mask", attention_mask, (batch, length, length))
        outputs = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return outputs
        weights = keras.KerasTensor(
            (batch, self.num_heads, length, length), dtype=self.compute_dtype
        )
        return outputs, weights


# The public second name of the class (keras-attn's names of the blocks).
TransformerEncoderBlock = TransformerEncoder
