"""A tiny decoder-only language model for the decoding tests.

Token + position embeddings, pre-LayerNorm blocks of causal
`MultiHeadSelfAttention` and a feed-forward network, a final LayerNorm and a
Dense head. `call` is the full pass; `next_fn` is the cached step of the
`keras_attn.generation` contract, with one `(key_cache, value_cache)` pair per
layer written at `cache_update_index=index`.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_attn.layers import MultiHeadAttention, MultiHeadSelfAttention


class TinyLM(keras.Model):
    def __init__(
        self,
        vocab_size: int = 48,
        max_positions: int = 32,
        d_model: int = 32,
        num_heads: int = 4,
        num_layers: int = 2,
        ffn_dim: int = 64,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.token_embedding = keras.layers.Embedding(vocab_size, d_model)
        self.position_embedding = keras.layers.Embedding(max_positions, d_model)
        self.blocks = [
            (
                keras.layers.LayerNormalization(epsilon=1e-5),
                MultiHeadSelfAttention(num_heads, causal=True),
                keras.layers.LayerNormalization(epsilon=1e-5),
                keras.layers.Dense(ffn_dim, activation="gelu"),
                keras.layers.Dense(d_model),
            )
            for _ in range(num_layers)
        ]
        self.final_norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.head = keras.layers.Dense(vocab_size)

    def _embed(self, token_ids, start):
        length = ops.shape(token_ids)[1]
        positions = ops.arange(length, dtype="int32") + ops.cast(start, "int32")
        return (
            self.token_embedding(token_ids) + self.position_embedding(positions)[None]
        )  # (B, T, d)

    def call(self, token_ids):
        """Full pass: logits `(B, T, V)`, row t scoring the token at t + 1."""
        x = self._embed(token_ids, 0)
        for norm1, attention, norm2, ffn_in, ffn_out in self.blocks:
            x = x + attention(norm1(x))
            x = x + ffn_out(ffn_in(norm2(x)))
        return self.head(self.final_norm(x))

    def next_fn(self, token_ids, cache, index):
        """Cached step: `(B, T)` tokens at `index..` -> `(B, T, V)`, new cache."""
        x = self._embed(token_ids, index)
        new_cache = []
        for (norm1, attention, norm2, ffn_in, ffn_out), layer_cache in zip(
            self.blocks, cache, strict=True
        ):
            attended, layer_cache = attention(
                norm1(x), cache=layer_cache, cache_update_index=index
            )
            x = x + attended
            x = x + ffn_out(ffn_in(norm2(x)))
            new_cache.append(layer_cache)
        return self.head(self.final_norm(x)), tuple(new_cache)

    def initial_cache(self, batch_size, length: int):
        shape = (batch_size, length, self.num_heads, self.head_dim)
        return tuple(
            (ops.zeros(shape), ops.zeros(shape)) for _ in range(len(self.blocks))
        )


def build_lm(seed: int = 0, **kwargs) -> TinyLM:
    """A built `TinyLM` with random weights (scaled up so that the next-token
    distributions are peaked and argmax ties are out of reach)."""
    keras.utils.set_random_seed(seed)
    model = TinyLM(**kwargs)
    model(ops.zeros((1, 2), dtype="int32"))
    model.head.kernel.assign(model.head.kernel * 4.0)
    return model


class TinyTranslator(keras.Model):
    """A tiny encoder-decoder's decoder side, for decoding with a start token.

    The source is given as encoded vectors `(B, S, d)` with a padding mask.
    The decoding cache holds, per row, the self-attention cache (written at
    each step) and the cross-attention keys/values and source mask (computed
    once): everything a row needs travels in the cache, so beam search can
    repeat and reorder it.
    """

    def __init__(self, vocab_size=40, max_positions=16, d_model=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.token_embedding = keras.layers.Embedding(vocab_size, d_model)
        self.position_embedding = keras.layers.Embedding(max_positions, d_model)
        self.self_attention = MultiHeadSelfAttention(num_heads, causal=True)
        self.cross_attention = MultiHeadAttention(num_heads, d_model // num_heads)
        self.norm = keras.layers.LayerNormalization(epsilon=1e-5)
        self.head = keras.layers.Dense(vocab_size)

    def _embed(self, token_ids, start):
        positions = ops.arange(ops.shape(token_ids)[1], dtype="int32") + start
        return (
            self.token_embedding(token_ids) + self.position_embedding(positions)[None]
        )

    def call(self, token_ids, source, source_mask):
        """Full pass: logits `(B, T, V)`."""
        x = self._embed(token_ids, 0)
        x = x + self.self_attention(x)
        x = x + self.cross_attention(x, source, value_mask=source_mask)
        return self.head(self.norm(x))

    def initial_cache(self, source, source_mask, length: int):
        batch = ops.shape(source)[0]
        shape = (batch, length, self.num_heads, self.head_dim)
        return {
            "self": (ops.zeros(shape), ops.zeros(shape)),
            "cross": self.cross_attention.compute_key_value(source),
            "source_mask": ops.convert_to_tensor(source_mask),
        }

    def next_fn(self, token_ids, cache, index):
        x = self._embed(token_ids, index)
        attended, self_cache = self.self_attention(
            x, cache=cache["self"], cache_update_index=index
        )
        x = x + attended
        attended, _ = self.cross_attention(
            x, None, cache=cache["cross"], value_mask=cache["source_mask"]
        )
        x = x + attended
        logits = self.head(self.norm(x))
        return logits, {**cache, "self": self_cache}


def build_translator(seed: int = 0) -> TinyTranslator:
    keras.utils.set_random_seed(seed)
    model = TinyTranslator()
    source = ops.zeros((1, 3, 32))
    model(ops.zeros((1, 2), dtype="int32"), source, ops.ones((1, 3), dtype="bool"))
    model.head.kernel.assign(model.head.kernel * 4.0)
    return model
