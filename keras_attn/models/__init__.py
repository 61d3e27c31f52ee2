"""Model classes: networks that know their task.

Each is a `keras.Model` built with the functional API in its constructor,
whose constructor arguments are its `get_config` (a `.keras` file rebuilds
it exactly), with the decoding contract `keras_attn.generation` consumes and
`attention_maps` for heatmaps. Given their tokenizers they work on raw
strings and export for TF Serving:

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

from keras_attn.models.language_model import TransformerLanguageModel
from keras_attn.models.rnn_translator import RNNTranslator
from keras_attn.models.text_classifier import TextClassifier, TextClassifierEnsemble
from keras_attn.models.transformer_translator import TransformerTranslator
from keras_attn.models.translator import Translator

__all__ = [
    "RNNTranslator",
    "TextClassifier",
    "TextClassifierEnsemble",
    "TransformerLanguageModel",
    "TransformerTranslator",
    "Translator",
]
