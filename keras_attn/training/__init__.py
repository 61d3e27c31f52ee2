"""Training: callbacks, `fit` within a time budget, the optimizer,
ensembles, evaluation recipes, distribution, precision and losses.

- Callbacks: `TimeBudget` (a wall-clock budget that survives interruptions),
  `BudgetCosineDecay` (warm-up, hold, cosine decay to the end of the epochs
  or of the budget), `SwapEMAWeights` (validate and end with the moving
  average of the weights), `StopAtStep`, and `standard_callbacks`.
- `fit_within_budget`: `fit` with all of them, resumable, the best
  checkpoint loaded at the end; `fit_ensemble`: several such fits, one per
  member of an ensemble, within one budget.
- `make_optimizer`: AdamW with a moving average of the weights on request.
- Evaluation recipes: `bits_per_character`, `perplexity`,
  `language_model_metrics` (both from `score`), `translation_scores`,
  `choose_length_penalty` (the beam's, on held-out pairs),
  `choose_knn_decoding` (kNN-MT's datastore and setting).
- Distribution: `make_strategy`, `patch_keras_for_multi_worker`, `is_chief`
  (TensorFlow); `make_distribution`, `data_parallel_size`,
  `initialize_processes` (several JAX processes, with bounded timeouts),
  `MultiProcessBackupAndRestore` (JAX).
- Precision: `resolve_mixed_precision`.
- Losses: `SmoothedSparseCrossentropy`.
- Distillation: `LogitsDistillation` (Keras's `keras.distillation`
  loss with the KL divergence from float32 logits), `greedy_agreement`
  (how often a draft's greedy choice is its target's).

Imports no TensorFlow. The named model sizes and training defaults these
take are `keras_attn.models.configs`.
"""

from keras_attn.training.callbacks import (
    BudgetCosineDecay,
    StopAtStep,
    SwapEMAWeights,
    TimeBudget,
    standard_callbacks,
)
from keras_attn.training.distillation import LogitsDistillation, greedy_agreement
from keras_attn.training.distribution import (
    STRATEGY_CHOICES,
    data_parallel_size,
    is_chief,
    make_distribution,
    make_strategy,
    patch_keras_for_multi_worker,
)
from keras_attn.training.ensembles import EnsembleFit, fit_ensemble
from keras_attn.training.evaluation import (
    bits_per_character,
    choose_knn_decoding,
    choose_length_penalty,
    language_model_metrics,
    perplexity,
    translation_scores,
)
from keras_attn.training.fit import FitResult, fit_within_budget
from keras_attn.training.losses import SmoothedSparseCrossentropy
from keras_attn.training.multi_process import (
    MultiProcessBackupAndRestore,
    initialize_processes,
)
from keras_attn.training.optimizers import make_optimizer
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
    "EnsembleFit",
    "FitResult",
    "LogitsDistillation",
    "MultiProcessBackupAndRestore",
    "SmoothedSparseCrossentropy",
    "StopAtStep",
    "SwapEMAWeights",
    "TimeBudget",
    "bits_per_character",
    "choose_knn_decoding",
    "choose_length_penalty",
    "cpu_supports_bfloat16",
    "data_parallel_size",
    "fit_ensemble",
    "fit_within_budget",
    "gpu_available",
    "greedy_agreement",
    "initialize_processes",
    "is_chief",
    "language_model_metrics",
    "make_distribution",
    "make_optimizer",
    "make_strategy",
    "patch_keras_for_multi_worker",
    "perplexity",
    "resolve_mixed_precision",
    "standard_callbacks",
    "translation_scores",
]
