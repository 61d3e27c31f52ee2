"""Model classes: backbones and the tasks made of them, keras-hub's pattern.

Backbones (`backbones`) are the Transformer stacks, functional
`keras.Model`s from token ids to hidden states:
`TransformerEncoderBackbone` (with `from_bert`) and
`TransformerDecoderBackbone`. Tasks put a head on one (the translator on
two) and know their task: each is a `keras.Model` built with the functional
API in its constructor, whose `get_config` rebuilds it exactly (a `.keras`
file, or a preset directory: `save_to_preset` / `from_preset`), with the
decoding contract `keras_attn.generation` consumes and `attention_maps` for
heatmaps. Given their tokenizers they work on raw strings and export for TF
Serving:

- `TransformerTranslator` and `RNNTranslator` (both `Translator`s):
  `translate(texts)`, `evaluate_translations(pairs)`, `export(path)`;
  `TransformerTranslator.from_bert(checkpoint, ...)`.
- `TextClassifier` (`from_bert` too) and `TextClassifierEnsemble`:
  `classify(texts)`, `export(path)`.
- `TransformerLanguageModel`: `generate(prompts)`, `score(texts)`,
  `export(path)`.

The networks import no TensorFlow: they build, train, decode token ids and
save on any backend; the text methods import TensorFlow Text when called.
"""

from keras_attn.models import configs
from keras_attn.models.backbones import (
    TransformerDecoderBackbone,
    TransformerEncoderBackbone,
)
from keras_attn.models.language_model import TransformerLanguageModel
from keras_attn.models.rnn_translator import RNNTranslator
from keras_attn.models.text_classifier import TextClassifier, TextClassifierEnsemble
from keras_attn.models.transformer_translator import TransformerTranslator
from keras_attn.models.translator import Translator

__all__ = [
    "RNNTranslator",
    "TextClassifier",
    "TextClassifierEnsemble",
    "TransformerDecoderBackbone",
    "TransformerEncoderBackbone",
    "TransformerLanguageModel",
    "TransformerTranslator",
    "Translator",
    "configs",
]
