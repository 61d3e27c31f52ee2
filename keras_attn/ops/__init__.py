"""Pure attention functions: scores, masks, masked softmax, attention."""

from keras_attn.ops.attention import dot_product_attention, weighted_sum
from keras_attn.ops.attention_paths import (
    attention_path,
    fused_kernel_runs,
    sequence_length_bound,
    switch_over_length,
)
from keras_attn.ops.cache import update_cache
from keras_attn.ops.masks import (
    attention_mask_from_padding,
    band_mask,
    causal_mask,
    combine_masks,
    padding_mask,
    padding_mask_from_lengths,
    rows_with_keys,
    sliding_window_mask,
)
from keras_attn.ops.memory_efficient_attention import memory_efficient_attention
from keras_attn.ops.scores import (
    additive_score,
    additive_score_from_projections,
    concat_score,
    dot_score,
    general_score,
    scaled_dot_score,
)
from keras_attn.ops.serving import serving_mode
from keras_attn.ops.softmax import MASK_VALUE, masked_softmax

__all__ = [
    "MASK_VALUE",
    "additive_score",
    "additive_score_from_projections",
    "attention_mask_from_padding",
    "attention_path",
    "band_mask",
    "causal_mask",
    "combine_masks",
    "concat_score",
    "dot_product_attention",
    "dot_score",
    "fused_kernel_runs",
    "general_score",
    "masked_softmax",
    "memory_efficient_attention",
    "padding_mask",
    "padding_mask_from_lengths",
    "rows_with_keys",
    "scaled_dot_score",
    "sequence_length_bound",
    "serving_mode",
    "sliding_window_mask",
    "switch_over_length",
    "update_cache",
    "weighted_sum",
]
