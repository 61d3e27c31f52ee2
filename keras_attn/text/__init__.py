"""Subword tokenizers and `tf.data` input pipelines for the three tasks.

- `train_subword_vocabulary(texts, path, ...)`: a SentencePiece model trained
  on a training split, saved as `path` (+ a readable `.vocab` file).
- `SubwordTokenizer(path)`: a Keras layer that tokenizes and detokenizes with
  TensorFlow Text ops only (runs in `tf.function`, `tf.data`, SavedModels).
- `WordPieceTokenizer(vocabulary)`: BERT's tokenizer (`[CLS] pieces [SEP]`),
  for pretrained encoders (`keras_attn.checkpoints.load_minilm`), on TensorFlow
  Text ops too.
- `translation_dataset`, `classification_dataset`, `language_model_dataset`:
  batched, padded (id 0), bucketed, cached, shuffled and prefetched
  `tf.data.Dataset`s for `model.fit`.
- `TextClassifierPreprocessor`, `LanguageModelPreprocessor`,
  `TranslatorPreprocessor`: strings -> a task's inputs, as Keras layers that
  map a `tf.data.Dataset` (keras-hub's preprocessors; `task.preprocessor`).
- `with_cardinality(dataset)`: the same dataset with its number of batches
  counted, so `fit` knows the epoch's length (and does not warn that the
  input "ran out of data").

Special ids: `PAD_ID` 0, `UNK_ID` 1, `START_ID` 2, `END_ID` 3.
"""

from keras_attn._extras import require

# TensorFlow and TensorFlow Text come with the `text` extra: say so here, at
# the import, rather than fail later inside a tokenizer.
require("keras_attn.text", "text", ("tensorflow", "tensorflow_text"))

from keras_attn.text.pipelines import (  # noqa: E402
    classification_dataset,
    language_model_dataset,
    translation_dataset,
    with_cardinality,
)
from keras_attn.text.preprocessors import (  # noqa: E402
    LanguageModelPreprocessor,
    TextClassifierPreprocessor,
    TranslatorPreprocessor,
)
from keras_attn.text.tokenizer import SubwordTokenizer  # noqa: E402
from keras_attn.text.vocabulary import (  # noqa: E402
    END_ID,
    PAD_ID,
    START_ID,
    UNK_ID,
    train_subword_vocabulary,
)
from keras_attn.text.wordpiece import WordPieceTokenizer  # noqa: E402

__all__ = [
    "END_ID",
    "PAD_ID",
    "START_ID",
    "UNK_ID",
    "LanguageModelPreprocessor",
    "SubwordTokenizer",
    "TextClassifierPreprocessor",
    "TranslatorPreprocessor",
    "WordPieceTokenizer",
    "classification_dataset",
    "language_model_dataset",
    "train_subword_vocabulary",
    "translation_dataset",
    "with_cardinality",
]
