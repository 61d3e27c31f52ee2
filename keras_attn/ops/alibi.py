"""ALiBi's bias (Press et al. 2022) as the attention ops add it to the logits.

`keras_attn.layers.alibi_bias` holds the layer, the slopes and the checked
public form of the bias; this is the bias alone, for the attention ops, which
compute it for whole `(Tq, Tk)` logits (the explicit path) or block by block
(the memory-efficient path).
"""

from __future__ import annotations

from keras import ops


def alibi_bias(slopes, key_positions, query_positions):
    """ALiBi's bias `slope * (key - query)`: `(N, Tq, Tk)` float32.

    What `keras_attn.layers.alibi_bias.alibi_bias(slopes, key_positions,
    query_positions)` computes for float32 slopes, without its argument
    checks (it runs once per block pair) and without importing the layers
    (which import these ops).

    Args:
        slopes: float32 `(N,)`.
        key_positions: int32 `(Tk,)`.
        query_positions: int32 `(Tq,)`.
    """
    distance = key_positions[None, :] - query_positions[:, None]  # (Tq, Tk)
    return slopes[:, None, None] * ops.cast(distance, "float32")[None]
