"""Training: callbacks, `fit` within a time budget, distribution, precision
and losses.

- Callbacks: `TimeBudget` (a wall-clock budget that survives interruptions),
  `BudgetCosineDecay` (warm-up, hold, cosine decay to the end of the epochs
  or of the budget), `SwapEMAWeights` (validate and end with the moving
  average of the weights), `StopAtStep`, and `standard_callbacks`.
- `fit_within_budget`: `fit` with all of them, resumable, the best
  checkpoint loaded at the end.
- Distribution: `make_strategy`, `patch_keras_for_multi_worker`, `is_chief`.
- Precision: `resolve_mixed_precision`.
- Losses: `SmoothedSparseCrossentropy`.
"""

from keras_attn.training.callbacks import (
    BudgetCosineDecay,
    StopAtStep,
    SwapEMAWeights,
    TimeBudget,
    standard_callbacks,
)
from keras_attn.training.distribution import (
    STRATEGY_CHOICES,
    is_chief,
    make_strategy,
    patch_keras_for_multi_worker,
)
from keras_attn.training.fit import FitResult, fit_within_budget
from keras_attn.training.losses import SmoothedSparseCrossentropy
from keras_attn.training.precision import (
    MIXED_PRECISION_CHOICES,
    cpu_supports_bfloat16,
    gpu_available,
    resolve_mixed_precision,
)

__all__ = [
    "MIXED_PRECISION_CHOICES",
    "STRATEGY_CHOICES",
    "BudgetCosineDecay",
    "FitResult",
    "SmoothedSparseCrossentropy",
    "StopAtStep",
    "SwapEMAWeights",
    "TimeBudget",
    "cpu_supports_bfloat16",
    "fit_within_budget",
    "gpu_available",
    "is_chief",
    "make_strategy",
    "patch_keras_for_multi_worker",
    "resolve_mixed_precision",
    "standard_callbacks",
]
