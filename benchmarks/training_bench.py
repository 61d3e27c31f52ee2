"""Training throughput of the example models against the matching keras.io recipes.

Tokens per second of a full training step (forward, backward and optimizer
update: `model.train_on_batch` on a batch held in memory, the compiled
`train_step` that `model.fit` runs) of each of our three example models and of
the keras.io recipe for the same task, in float32 and mixed_bfloat16, all in
this one process:

- sentiment: `examples/sentiment.py --pretrained none`'s classifier (one
  ensemble member, trained from scratch) vs "Text classification with
  Transformer" (Apoorv Nandan); the script's default, the fine-tuned
  all-MiniLM-L6-v2, is benchmarked against keras-hub's BERT in
  `pretrained_bench.py`;
- translation: `examples/translate.py`'s Transformer vs "English-to-Spanish
  translation with a sequence-to-sequence Transformer" (fchollet);
- language model: `examples/language_model.py`'s model vs "Text generation
  with a miniature GPT" (Apoorv Nandan).

Each model keeps its own architecture: ours are built by `keras_attn.models`
with the example script's defaults (read from the script's own `parse_args`)
and compiled with the script's loss, optimizer (AdamW with clipping; the
scripts' learning-rate callback is left out) and metrics; the recipes are
rebuilt below as the keras.io
sources define them (the Keras 3 versions of the classification and
translation recipes; the miniature GPT's TensorFlow version, written with
`keras.ops` as its Keras 3 port is), with `keras.layers.MultiHeadAttention`,
their own embedding / block layers, losses, optimizers (the string defaults:
"adam", "rmsprop") and metrics. Deviations, none of which changes the work of
a training step: the translation recipe's unused inference sub-models
(`encoder`, `decoder`) are not built; the classification recipe's float32
`Input` is int32 here (under mixed_bfloat16 Keras casts a float input to
bfloat16, which rounds token ids above 256); the causal masks are tiled with
`tf.tile` (see the note at the recipes); the recipes' data preparation (IMDB,
spa-eng, `TextVectorization`) is replaced by ours, see below. Mixed precision
is only the global policy, for the recipes as for ours (the recipes keep their
softmax / logits layers in the policy; ours emit float32 logits by design).

"At the same sizes on the same data": for each pair, both models are fed the
same token batch, at two sizes (batch, length, vocabulary):

- `recipe`: the recipe's own batch size, sequence length and vocabulary size;
- `ours`: the example script's defaults.

The vocabulary size sets both models' embedding and output layers. Token ids
are real data, tokenized with our `SubwordTokenizer`, trained as the example
script trains it (SentencePiece, training split; its vocabulary is the `ours`
size, so at the recipe's larger vocabulary the ids use only part of the
table):

- sentiment: the movie-review sentences, *packed*: consecutive sentences fill
  each row of `length` tokens (label: that of the row's first sentence), so
  every position is a real token; the recipe's IMDB reviews (about 230 words)
  mostly fill its 200 positions, our sentences (about 26 tokens) would leave
  most of a row empty.
- translation: one random training pair per row (English -> German, Ding),
  source and `START + target` each truncated and padded to `length`; the
  pairs are short, so much of each row is padding (the fill is printed).
- language model: consecutive windows of the Shakespeare token stream
  (`language_model_dataset`), no padding.

Tokens = the non-padding input tokens of a batch: token ids for sentiment and
language model; source + decoder-input tokens for translation. Both models of
a pair process the same tokens, so ours/recipe is also the inverse ratio of
step times. The four candidates of a (task, size) group (ours and recipe, in
both policies) are all built and compiled first (the dtype policy set before
each build) and run twice (tracing, optimizer state), then timed alternately
round by round with `_timing.alternate` (`inner` steps per sample, chosen so
that a sample lasts about 0.25 s): medians of `--rounds` rounds after one
warm-up round. The groups are built and timed one after another, and each
group's models are freed before the next is built. XLA is off, as Keras'
`jit_compile="auto"` leaves it on a CPU-only machine (and as the examples run).

    .venv/bin/python benchmarks/training_bench.py [--rounds 8] [--json PATH]
    .venv/bin/python benchmarks/training_bench.py --smoke     # a check, ~1 minute
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras
import numpy as np
import tensorflow as tf
from _timing import alternate
from keras import layers, ops

from keras_attn.datasets import (
    load_movie_reviews,
    load_shakespeare,
    load_translation_pairs,
)
from keras_attn.text import (
    PAD_ID,
    SubwordTokenizer,
    language_model_dataset,
    train_subword_vocabulary,
    translation_dataset,
)

TASKS = ("sentiment", "translation", "language_model")
POLICIES = ("float32", "mixed_bfloat16")
# The recipes' batch size, sequence length and vocabulary size.
RECIPE_SIZES = {
    "sentiment": (32, 200, 20000),
    "translation": (64, 20, 15000),
    "language_model": (128, 80, 20000),
}
RECIPE_NAMES = {
    "sentiment": "Text classification with Transformer",
    "translation": "English-to-Spanish translation with a seq2seq Transformer",
    "language_model": "Text generation with a miniature GPT",
}
EXAMPLE_SCRIPTS = {
    "sentiment": "sentiment",
    "translation": "translate",
    "language_model": "language_model",
}
SMOKE_SIZE = (4, 16)  # batch, length; vocabulary: the smoke tokenizer's
SMOKE_VOCABULARY = 500  # pieces of the smoke tokenizers (300 is too few here)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the keras.io recipes ----------------------------------------------------
# As on keras.io (Keras 3 versions), but for one call: the causal masks are
# tiled over the batch with `tf.tile` (as the recipes' TensorFlow versions
# did), since Keras 3.15's `keras.ops.tile` cannot take the symbolic
# `[batch, 1, 1]` repeats while the functional model is being built.
# Text classification with Transformer and Text generation with a miniature
# GPT define the same TokenAndPositionEmbedding.


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


class TransformerBlock(layers.Layer):
    """Text classification with Transformer: post-norm encoder block."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [
                layers.Dense(ff_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


def recipe_sentiment(vocab_size, maxlen):
    embed_dim = 32  # Embedding size for each token
    num_heads = 2  # Number of attention heads
    ff_dim = 32  # Hidden layer size in feed forward network inside transformer
    # The recipe's `Input(shape=(maxlen,))` is float32: under mixed_bfloat16
    # Keras casts it to bfloat16, which rounds token ids above 256 (7991 ->
    # 8000) and corrupts or crashes the embedding lookup. Token ids are int32.
    inputs = layers.Input(shape=(maxlen,), dtype="int32")
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(
        optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    return model


# English-to-Spanish translation with a sequence-to-sequence Transformer.


class TransformerEncoder(layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim = embed_dim
        self.dense_dim = dense_dim
        self.num_heads = num_heads
        self.attention = layers.MultiHeadAttention(
            num_heads=num_heads, key_dim=embed_dim
        )
        self.dense_proj = keras.Sequential(
            [
                layers.Dense(dense_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        if mask is not None:
            padding_mask = ops.cast(mask[:, None, :], dtype="int32")
        else:
            padding_mask = None
        attention_output = self.attention(
            query=inputs, value=inputs, key=inputs, attention_mask=padding_mask
        )
        proj_input = self.layernorm_1(inputs + attention_output)
        proj_output = self.dense_proj(proj_input)
        return self.layernorm_2(proj_input + proj_output)


class PositionalEmbedding(layers.Layer):
    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(
            input_dim=vocab_size, output_dim=embed_dim
        )
        self.position_embeddings = layers.Embedding(
            input_dim=sequence_length, output_dim=embed_dim
        )
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.embed_dim = embed_dim

    def call(self, inputs):
        length = ops.shape(inputs)[-1]
        positions = ops.arange(0, length, 1)
        embedded_tokens = self.token_embeddings(inputs)
        embedded_positions = self.position_embeddings(positions)
        return embedded_tokens + embedded_positions

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)


class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim = embed_dim
        self.latent_dim = latent_dim
        self.num_heads = num_heads
        self.attention_1 = layers.MultiHeadAttention(
            num_heads=num_heads, key_dim=embed_dim
        )
        self.attention_2 = layers.MultiHeadAttention(
            num_heads=num_heads, key_dim=embed_dim
        )
        self.dense_proj = keras.Sequential(
            [
                layers.Dense(latent_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        inputs, encoder_outputs = inputs
        causal_mask = self.get_causal_attention_mask(inputs)
        if mask is None:
            inputs_padding_mask, encoder_outputs_padding_mask = None, None
        else:
            inputs_padding_mask, encoder_outputs_padding_mask = mask
        attention_output_1 = self.attention_1(
            query=inputs,
            value=inputs,
            key=inputs,
            attention_mask=causal_mask,
            query_mask=inputs_padding_mask,
        )
        out_1 = self.layernorm_1(inputs + attention_output_1)
        attention_output_2 = self.attention_2(
            query=out_1,
            value=encoder_outputs,
            key=encoder_outputs,
            query_mask=inputs_padding_mask,
            key_mask=encoder_outputs_padding_mask,
        )
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        proj_output = self.dense_proj(out_2)
        return self.layernorm_3(out_2 + proj_output)

    def get_causal_attention_mask(self, inputs):
        input_shape = ops.shape(inputs)
        batch_size, sequence_length = input_shape[0], input_shape[1]
        i = ops.arange(sequence_length)[:, None]
        j = ops.arange(sequence_length)
        mask = ops.cast(i >= j, dtype="int32")
        mask = ops.reshape(mask, (1, input_shape[1], input_shape[1]))
        mult = ops.concatenate(
            [ops.expand_dims(batch_size, -1), ops.convert_to_tensor([1, 1])],
            axis=0,
        )
        return tf.tile(mask, mult)  # keras.ops.tile: see the note above


def recipe_translation(vocab_size, sequence_length):
    embed_dim = 256
    latent_dim = 2048
    num_heads = 8
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(encoder_inputs)
    encoder_outputs = TransformerEncoder(embed_dim, latent_dim, num_heads)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    x = PositionalEmbedding(sequence_length, vocab_size, embed_dim)(decoder_inputs)
    x = TransformerDecoder(embed_dim, latent_dim, num_heads)([x, encoder_outputs])
    x = layers.Dropout(0.5)(x)
    decoder_outputs = layers.Dense(vocab_size, activation="softmax")(x)
    transformer = keras.Model(
        {"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs},
        decoder_outputs,
        name="transformer",
    )
    transformer.compile(
        "rmsprop",
        loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0),
        metrics=["accuracy"],
    )
    return transformer


# Text generation with a miniature GPT.


def causal_attention_mask(batch_size, n_dest, n_src, dtype):
    """1's in the lower triangle, counting from the lower right corner."""
    i = ops.arange(n_dest)[:, None]
    j = ops.arange(n_src)
    m = i >= j - n_src + n_dest
    mask = ops.cast(m, dtype)
    mask = ops.reshape(mask, [1, n_dest, n_src])
    mult = ops.concatenate(
        [ops.expand_dims(batch_size, -1), ops.convert_to_tensor([1, 1])], 0
    )
    return tf.tile(mask, mult)  # keras.ops.tile: see the note above


class CausalTransformerBlock(layers.Layer):
    """The miniature GPT's `TransformerBlock` (renamed here: causal mask)."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads, embed_dim)
        self.ffn = keras.Sequential(
            [
                layers.Dense(ff_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        input_shape = ops.shape(inputs)
        batch_size = input_shape[0]
        seq_len = input_shape[1]
        causal_mask = causal_attention_mask(batch_size, seq_len, seq_len, "bool")
        attention_output = self.att(inputs, inputs, attention_mask=causal_mask)
        attention_output = self.dropout1(attention_output)
        out1 = self.layernorm1(inputs + attention_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


def recipe_language_model(vocab_size, maxlen):
    embed_dim = 256  # Embedding size for each token
    num_heads = 2  # Number of attention heads
    feed_forward_dim = 256  # Hidden layer size in feed forward network
    inputs = layers.Input(shape=(maxlen,), dtype="int32")
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = CausalTransformerBlock(embed_dim, num_heads, feed_forward_dim)
    x = transformer_block(x)
    outputs = layers.Dense(vocab_size)(x)
    model = keras.Model(inputs=inputs, outputs=[outputs, x])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile("adam", loss=[loss_fn, None])  # no loss on the block's output
    return model


# -- our example models ------------------------------------------------------


def load_example(name):
    """An example script as a module (its `main` is not run)."""
    if os.path.join(ROOT, "examples") not in sys.path:  # its `_cli`, `_options`
        sys.path.insert(0, os.path.join(ROOT, "examples"))
    path = os.path.join(ROOT, "examples", f"{EXAMPLE_SCRIPTS[name]}.py")
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_defaults(name, smoke):
    """The script's module and its defaults (`--smoke`: its smoke settings)."""
    module = load_example(name)
    argv = ["--smoke"] if smoke else []
    if name in ("sentiment", "translation"):
        # The models trained from scratch, the recipes' kind of model; the
        # fine-tuned MiniLM classifier is compared with keras-hub's BERT in
        # benchmarks/pretrained_bench.py.
        argv.extend(["--pretrained", "none"])
    args = module.parse_args(argv)
    if smoke and name == "translation":
        # One block per side (keras_attn.models.configs' "tiny"): tracing
        # the train step dominates a smoke run.
        args.size = "tiny"
    return module, args


def ours(task, length):
    """Our model as the example script builds and compiles it, at `length`."""
    args = copy.copy(task.args)
    if task.name == "sentiment":
        args.max_length = length
        return task.example.build_member(args, task.tokenizer, "member_0", None)
    if task.name == "translation":
        args.max_length = length
        tokenizers = {
            "source_tokenizer": task.tokenizer,
            "target_tokenizer": task.tokenizer,
        }
        return task.example.build(args, tokenizers)
    args.sequence_length = length
    return task.example.build(args, task.tokenizer)


# -- data --------------------------------------------------------------------


@dataclass
class Task:
    name: str
    tokenizer: SubwordTokenizer
    texts: object  # what `batch` draws from
    example: object  # the example script's module
    args: object  # its parsed defaults
    seconds: float  # loading + tokenizer training


def prepare(name, workdir, smoke):
    """The task's training split and tokenizer, as the example script makes them."""
    started = time.perf_counter()
    module, args = example_defaults(name, smoke)
    if smoke:
        args.vocabulary_size = SMOKE_VOCABULARY
    path = os.path.join(workdir, f"{name}.model")
    if name == "sentiment":
        texts = load_movie_reviews().train
        if smoke:
            texts = texts[::20][:400]
        vocab = train_subword_vocabulary(
            [text for text, _ in texts],
            path,
            vocabulary_size=args.vocabulary_size,
            lowercase=True,
        )
    elif name == "translation":
        texts = load_translation_pairs("de-en", alternatives=args.alternatives).train
        if smoke:
            texts = texts[:600]
        vocab = train_subword_vocabulary(
            [text for pair in texts for text in pair],
            path,
            vocabulary_size=args.vocabulary_size,
        )
    else:
        texts = load_shakespeare().train
        if smoke:
            texts = texts[:1]
        vocab = train_subword_vocabulary(
            [document.text for document in texts],
            path,
            vocabulary_size=args.vocabulary_size,
            lossless=True,
        )
    tokenizer = SubwordTokenizer(vocab)
    return Task(name, tokenizer, texts, module, args, time.perf_counter() - started)


def sentiment_batch(task, batch_size, length):
    """Rows of `length` tokens packed with consecutive (shuffled) sentences."""
    needed = batch_size * length
    order = np.random.default_rng(0).permutation(len(task.texts))
    texts = [task.texts[index] for index in order]  # the file is sorted by label
    ids, labels, count = [], [], 0
    for start in range(0, len(texts), 256):
        chunk = texts[start : start + 256]
        pieces = task.tokenizer.tokenize([text for text, _ in chunk])
        for row, (_, label) in zip(pieces.to_list(), chunk, strict=True):
            ids.append(row)
            labels.append([int(label)] * len(row))
            count += len(row)
        if count >= needed:
            break
    stream = np.concatenate(ids)[:needed]
    if stream.size < needed:
        raise ValueError(f"not enough sentences for {batch_size}x{length} tokens")
    token_ids = stream.reshape(batch_size, length).astype("int32")
    row_labels = np.concatenate(labels)[:needed].reshape(batch_size, length)[:, 0]
    return {
        "x": tf.constant(token_ids),
        "y": tf.constant(row_labels.astype("int32")),
        "tokens": int((token_ids != PAD_ID).sum()),
        "positions": token_ids.size,
    }


def translation_batch(task, batch_size, length):
    """One shuffled training pair per row, both sides padded to `length`."""
    dataset = translation_dataset(
        task.texts,
        task.tokenizer,
        task.tokenizer,
        batch_size=batch_size,
        max_length=length,
        shuffle=True,
        seed=0,
        bucket_boundaries=None,
        sample_weight=True,
        drop_remainder=True,
    )
    inputs, targets, weights = next(iter(dataset))
    source = inputs["encoder_inputs"].numpy()
    decoder = inputs["decoder_inputs"].numpy()
    return {
        "x": inputs,
        "y": targets,
        "sample_weight": weights,
        "tokens": int((source != PAD_ID).sum() + (decoder != PAD_ID).sum()),
        "positions": source.size + decoder.size,
    }


def language_model_batch(task, batch_size, length):
    """`batch_size` consecutive windows of the token stream."""
    documents = task.texts
    for count in range(1, len(documents) + 1):
        dataset = language_model_dataset(
            documents[:count],
            task.tokenizer,
            sequence_length=length,
            batch_size=batch_size,
            shuffle=False,
            drop_remainder=True,
            document_tokens=True,
        )
        batch = next(iter(dataset), None)
        if batch is not None:
            break
    else:
        raise ValueError(f"not enough text for {batch_size}x{length} tokens")
    inputs, targets = batch
    ids = inputs.numpy()
    return {
        "x": inputs,
        "y": targets,
        "tokens": int((ids != PAD_ID).sum()),
        "positions": ids.size,
    }


BATCHES = {
    "sentiment": sentiment_batch,
    "translation": translation_batch,
    "language_model": language_model_batch,
}


# -- timing ------------------------------------------------------------------


def build(task, who, vocab_size, length):
    if who == "recipe":
        return {
            "sentiment": recipe_sentiment,
            "translation": recipe_translation,
            "language_model": recipe_language_model,
        }[task.name](vocab_size, length)
    return ours(task, length)


def make_step(model, who, task, batch):
    y = batch["y"]
    if who == "recipe" and task.name == "language_model":
        y = [y, None]  # the recipe's second output (the block's) has no loss
    # Our translator trains with the dataset's padding weights, as the script.
    weights = batch.get("sample_weight") if who == "ours" else None

    def step():
        model.train_on_batch(batch["x"], y, sample_weight=weights)

    return step


def sizes_of(task, smoke):
    """(label, batch, length, vocabulary) of each size compared."""
    if smoke:
        return [("smoke", *SMOKE_SIZE, task.tokenizer.vocabulary_size)]
    args = task.args
    length = args.sequence_length if task.name == "language_model" else args.max_length
    return [
        ("recipe", *RECIPE_SIZES[task.name]),
        ("ours", args.batch_size, length, task.tokenizer.vocabulary_size),
    ]


def run_group(task, label, batch_size, length, vocab_size, policies, rounds, smoke):
    """Build, trace and time ours and the recipe in each policy, at one size."""
    started = time.perf_counter()
    batch = BATCHES[task.name](task, batch_size, length)
    steps, info = {}, {}
    for policy in policies:
        for who in ("ours", "recipe"):
            keras.config.set_dtype_policy(policy)
            model = build(task, who, vocab_size, length)
            step = make_step(model, who, task, batch)
            first = time.perf_counter()
            step()  # traces the train function, creates the optimizer state
            traced = time.perf_counter() - first
            first = time.perf_counter()
            if not smoke:
                step()
            info[(who, policy)] = {
                "params": model.count_params(),
                "trace_s": traced,
                "second_step_s": time.perf_counter() - first,
            }
            steps[(who, policy)] = step
            keras.config.set_dtype_policy("float32")
    # Repeat each call so that a timed sample lasts about 0.25 s at least.
    typical = sorted(v["second_step_s"] for v in info.values())[len(info) // 2]
    inner = 1 if smoke else max(1, min(50, math.ceil(0.25 / typical)))
    # Two steps already ran; one more warm-up round, alternating.
    medians = alternate(steps, rounds=rounds, warmup=0 if smoke else 1, inner=inner)
    rows = []
    for (who, policy), seconds in medians.items():
        rows.append(
            {
                "task": task.name,
                "size": label,
                "batch": batch_size,
                "length": length,
                "vocabulary": vocab_size,
                "model": who,
                "policy": policy,
                "params": info[(who, policy)]["params"],
                "tokens_per_batch": batch["tokens"],
                "positions_per_batch": batch["positions"],
                "ms_per_step": seconds * 1e3,
                "tokens_per_second": batch["tokens"] / seconds,
                "trace_s": info[(who, policy)]["trace_s"],
                "inner": inner,
            }
        )
    for row in rows:
        if row["model"] == "ours":
            recipe = next(
                r
                for r in rows
                if r["model"] == "recipe" and r["policy"] == row["policy"]
            )
            row["ours_over_recipe"] = (
                row["tokens_per_second"] / recipe["tokens_per_second"]
            )
    return rows, time.perf_counter() - started


def describe(task, label, batch_size, length, vocab_size, rows):
    tokens = rows[0]["tokens_per_batch"]
    positions = rows[0]["positions_per_batch"]
    counted = {
        "sentiment": "token ids",
        "translation": "source + decoder-input tokens",
        "language_model": "token ids",
    }[task.name]
    return (
        f"{task.name} @ {label}: batch {batch_size}, length {length}, vocabulary "
        f"{vocab_size}; {tokens} tokens per batch ({counted}, "
        f"{100 * tokens / positions:.0f}% of {positions} positions)"
    )


def print_table(rows):
    print(
        f"{'task':<15} {'size':<7} {'policy':<15} {'model':<7} {'params':>10} "
        f"{'ms/step':>9} {'tokens/s':>10} {'ours/recipe':>11}"
    )
    for row in rows:
        ratio = row.get("ours_over_recipe")
        print(
            f"{row['task']:<15} {row['size']:<7} {row['policy']:<15} "
            f"{row['model']:<7} {row['params']:>10,} {row['ms_per_step']:9.1f} "
            f"{row['tokens_per_second']:10.0f} "
            f"{'' if ratio is None else f'{ratio:.2f}':>11}"
        )
    print(
        "ours/recipe = our tokens/s / the recipe's at the same size, policy and "
        "batch (> 1: ours trains faster)"
    )
    speedups = []
    for row in rows:
        if row["policy"] == "mixed_bfloat16":
            base = next(
                (
                    r
                    for r in rows
                    if r["policy"] == "float32"
                    and (r["task"], r["size"], r["model"])
                    == (row["task"], row["size"], row["model"])
                ),
                None,
            )
            if base:
                speedups.append(
                    f"{row['task']}@{row['size']} {row['model']} "
                    f"{row['tokens_per_second'] / base['tokens_per_second']:.2f}"
                )
    if speedups:
        print("mixed_bfloat16 / float32 tokens/s: " + ", ".join(speedups))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes and tokenizers, 1 round (a check that it runs)",
    )
    parser.add_argument(
        "--tasks", default=",".join(TASKS), help=f"comma-separated, of {TASKS}"
    )
    parser.add_argument(
        "--sizes", default="recipe,ours", help="comma-separated: recipe, ours"
    )
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated"
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    tasks = [t for t in args.tasks.split(",") if t]
    policies = [p for p in args.policies.split(",") if p]
    sizes = {s for s in args.sizes.split(",") if s}
    if unknown := set(tasks) - set(TASKS):
        parser.error(f"unknown tasks {sorted(unknown)}")
    started = time.perf_counter()
    # Each model traces its own train function; TensorFlow would call every
    # new one a "retracing" of the same Python function.
    tf.get_logger().setLevel("ERROR")
    # Once: `set_random_seed` makes the models built before it re-trace.
    keras.utils.set_random_seed(0)
    print(
        f"tensorflow {tf.__version__}, keras {keras.__version__}, "
        f"{os.cpu_count()} CPUs, threads "
        f"{tf.config.threading.get_intra_op_parallelism_threads() or 'auto'}; "
        f"model.train_on_batch, jit_compile auto (off on a CPU); medians of "
        f"{rounds} rounds{' (smoke)' if args.smoke else ''}"
    )
    rows, sections = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for name in tasks:
            task = prepare(name, workdir, args.smoke)
            print(
                f"{name}: tokenizer of {task.tokenizer.vocabulary_size} pieces "
                f"({task.seconds:.1f} s to load and train); recipe: "
                f'"{RECIPE_NAMES[name]}"',
                flush=True,
            )
            for label, batch_size, length, vocab_size in sizes_of(task, args.smoke):
                if not args.smoke and label not in sizes:
                    continue
                group, seconds = run_group(
                    task,
                    label,
                    batch_size,
                    length,
                    vocab_size,
                    policies,
                    rounds,
                    args.smoke,
                )
                keras.backend.clear_session()  # the group's models are gone
                gc.collect()
                line = describe(task, label, batch_size, length, vocab_size, group)
                sections.append(line)
                print(f"  {line} [{seconds:.0f} s]", flush=True)
                rows += group
    print()
    print_table(rows)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(
                {
                    "tensorflow": tf.__version__,
                    "keras": keras.__version__,
                    "rounds": rounds,
                    "smoke": args.smoke,
                    "sizes": sections,
                    "rows": rows,
                },
                file,
                indent=1,
            )


if __name__ == "__main__":
    main()
