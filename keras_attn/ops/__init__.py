"""Pure attention functions: scores, masks, masked softmax, attention."""

from keras_attn.ops.attention import dot_product_attention, weighted_sum
from keras_attn.ops.cache import update_cache
from keras_attn.ops.masks import (
    attention_mask_from_padding,
    causal_mask,
    combine_masks,
    padding_mask,
    padding_mask_from_lengths,
)
from keras_attn.ops.scores import (
    additive_score,
    additive_score_from_projections,
    concat_score,
    dot_score,
    general_score,
    scaled_dot_score,
)
from keras_attn.ops.softmax import MASK_VALUE, masked_softmax

__all__ = [
    "MASK_VALUE",
    "additive_score",
    "additive_score_from_projections",
    "attention_mask_from_padding",
    "causal_mask",
    "combine_masks",
    "concat_score",
    "dot_product_attention",
    "dot_score",
    "general_score",
    "masked_softmax",
    "padding_mask",
    "padding_mask_from_lengths",
    "scaled_dot_score",
    "update_cache",
    "weighted_sum",
]
