"""Named configurations of the task models: sizes and training defaults.

A configuration is a plain dict, not a preset: it carries no weights. Each
holds what `examples/` trains with by default, chosen on the validation
splits (docs/experiments/ keeps the trials):

- `"class_name"`: the `keras_attn.models` class it configures.
- `"pretrained"`: `None` (trained from scratch: pass `"model"` to the
  class's constructor) or the checkpoint the encoder starts from
  (`"minilm"`: `keras_attn.checkpoints.load_minilm()`; pass `"model"` to
  the class's `from_bert`).
- `"model"`: constructor keyword arguments (all but the vocabulary sizes
  and the tokenizers, which come from the data).
- `"data"`: the tokenizer and input sizes (`vocabulary_size`, and
  `max_length`, tokens per text, where the inputs are truncated).
- `"training"`: the recipe: `learning_rate` (the peak),
  `weight_decay` and `clipnorm` of AdamW
  (`keras_attn.training.make_optimizer`); `warmup_steps` (or
  `warmup_share`, a share of the run's steps), `lr_hold` and `decay_alpha`
  of `keras_attn.training.BudgetCosineDecay` (`decay_alpha=None`: the
  learning rate stays constant); `batch_size`, `epochs` and `minutes` (the
  time budget) of `keras_attn.training.fit_within_budget`; and per task
  `label_smoothing`, `ensemble` (classifiers averaged) and `patience`
  (early stopping).

```python
from keras_attn.models import TransformerTranslator, configs

base = configs.config("translator", "base")
translator = TransformerTranslator(8000, 8000, **base["model"])
```

Imports no TensorFlow (nor Keras).
"""

from __future__ import annotations

import copy

from keras_attn import _validation as v

# The from-scratch Transformer translator's sizes: embedding_dim, layers per
# side, heads, intermediate_dim.
_TRANSLATOR_SIZES = {
    "tiny": (32, 1, 2, 64),  # seconds-long checks (benchmarks, GPU check)
    "small": (128, 2, 4, 512),
    "base": (256, 3, 8, 1024),
}
_TRANSLATOR_DATA = {"vocabulary_size": 8000, "max_length": 40}
_TRANSLATOR_TRAINING = {
    "learning_rate": 1e-3,
    "warmup_steps": 400,
    "lr_hold": 0.8,
    "decay_alpha": 0.05,
    "weight_decay": 0.1,
    "clipnorm": 1.0,
    "label_smoothing": 0.1,
    "batch_size": 64,
    "epochs": 40,
    "minutes": 25.0,
}


def _translator(size: str) -> dict:
    dim, layers, heads, intermediate = _TRANSLATOR_SIZES[size]
    return {
        "class_name": "TransformerTranslator",
        "pretrained": None,
        "model": {
            "sequence_length": _TRANSLATOR_DATA["max_length"] + 1,
            "embedding_dim": dim,
            "num_encoder_layers": layers,
            "num_decoder_layers": layers,
            "num_heads": heads,
            "intermediate_dim": intermediate,
            "dropout": 0.2,
            "shared_vocabulary": True,
            "tie_embeddings": True,
            "normalize_first": True,
        },
        "data": dict(_TRANSLATOR_DATA),
        "training": dict(_TRANSLATOR_TRAINING),
    }


def _rnn_translator(size: str) -> dict:
    dim = _TRANSLATOR_SIZES[size][0]
    return {
        "class_name": "RNNTranslator",
        "pretrained": None,
        "model": {
            "embedding_dim": dim,
            "units": 2 * dim,
            "attention": "bahdanau",
            "dropout": 0.2,
        },
        "data": dict(_TRANSLATOR_DATA),
        "training": dict(_TRANSLATOR_TRAINING),
    }


_CONFIGS = {
    "translator": {
        **{size: _translator(size) for size in _TRANSLATOR_SIZES},
        # all-MiniLM-L6-v2's encoder under a fresh decoder of its width
        # (`from_bert`'s defaults), on a target vocabulary of its own.
        "minilm": {
            "class_name": "TransformerTranslator",
            "pretrained": "minilm",
            "model": {
                "sequence_length": _TRANSLATOR_DATA["max_length"] + 1,
                "dropout": 0.1,
            },
            "data": dict(_TRANSLATOR_DATA),
            "training": {
                **_TRANSLATOR_TRAINING,
                "learning_rate": 3e-4,
                "lr_hold": 0.5,
            },
        },
    },
    "rnn_translator": {size: _rnn_translator(size) for size in _TRANSLATOR_SIZES},
    "text_classifier": {
        # An ensemble of small classifiers trained from scratch.
        "small": {
            "class_name": "TextClassifier",
            "pretrained": None,
            "model": {
                "sequence_length": 64,
                "embedding_dim": 128,
                "num_layers": 1,
                "num_heads": 4,
                "intermediate_dim": 256,
                "dropout": 0.3,
                "pooling": "attention",
            },
            "data": {"vocabulary_size": 8000, "max_length": 64},
            "training": {
                "learning_rate": 1e-3,
                "decay_alpha": None,
                "weight_decay": 0.01,
                "clipnorm": None,
                "label_smoothing": 0.0,
                "ensemble": 5,
                "patience": 2,
                "batch_size": 32,
                "epochs": 10,
                "minutes": 10.0,
            },
        },
        # all-MiniLM-L6-v2 fine-tuned with BERT's recipe (Devlin et al.,
        # 2019: AdamW 5e-5, warm-up, decay to 0, a few epochs, dropout 0.1);
        # mean pooling chosen on the validation split.
        "minilm": {
            "class_name": "TextClassifier",
            "pretrained": "minilm",
            "model": {"dropout": 0.1, "pooling": "mean"},
            "data": {"max_length": 64},
            "training": {
                "learning_rate": 5e-5,
                "warmup_share": 0.1,
                "lr_hold": 0.0,
                "decay_alpha": 0.0,
                "weight_decay": 0.01,
                "clipnorm": None,
                "label_smoothing": 0.0,
                "ensemble": 1,
                "patience": 2,
                "batch_size": 32,
                "epochs": 3,
                "minutes": 10.0,
            },
        },
    },
    "language_model": {
        # Shakespeare's plays on a lossless SentencePiece vocabulary.
        "small": {
            "class_name": "TransformerLanguageModel",
            "pretrained": None,
            "model": {
                "sequence_length": 128,
                "embedding_dim": 128,
                "num_layers": 4,
                "num_heads": 4,
                "intermediate_dim": 512,
                "dropout": 0.0,
                # Chosen on the validation plays against learned positions
                # and 4 key/value heads (BENCHMARKS.md).
                "position": "rotary",
                "num_key_value_heads": 2,
            },
            "data": {"vocabulary_size": 4000},
            "training": {
                "learning_rate": 2e-3,
                "warmup_steps": 200,
                "lr_hold": 0.8,
                "decay_alpha": 0.1,
                "weight_decay": 0.05,
                "clipnorm": 1.0,
                "batch_size": 64,
                "epochs": 30,
                "minutes": 15.0,
            },
        },
    },
}


def config_tasks() -> tuple[str, ...]:
    """The tasks that have named configurations: `"language_model"`,
    `"rnn_translator"`, `"text_classifier"`, `"translator"`."""
    return tuple(sorted(_CONFIGS))


def config_names(task: str) -> tuple[str, ...]:
    """The names of `task`'s configurations, smallest model first.

    Raises:
        ValueError: `task` is not one of `config_tasks()`.
    """
    v.check_choice("task", task, config_tasks())
    return tuple(_CONFIGS[task])


def config(task: str, name: str) -> dict:
    """The named configuration of `task`: a new dict (change it freely) with
    `class_name`, `pretrained`, `model`, `data` and `training` (see the
    module's docstring).

    Args:
        task: one of `config_tasks()`.
        name: one of `config_names(task)`.

    Raises:
        ValueError: naming the argument and listing the choices.

    Example:

    ```python
    small = config("text_classifier", "small")
    classifier = TextClassifier(small["data"]["vocabulary_size"], **small["model"])
    ```
    """
    v.check_choice("name", name, config_names(task))
    return copy.deepcopy(_CONFIGS[task][name])


__all__ = ["config", "config_names", "config_tasks"]
