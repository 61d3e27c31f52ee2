"""Cached decoding: `keras_attn.generation` against keras-hub's `generate`.

Greedy generation of 64 new tokens after an 8-token prompt, batch 8, with a
2-layer decoder-only model (d_model 256, 8 heads, intermediate 1024, vocabulary
1000, 128 positions): keras-hub's `GPT2CausalLM.generate` (no preprocessor,
`jit_compile=True`, greedy sampler, token-id inputs) against our
`greedy_search` over the same weights: GPT-2's layout rebuilt from
`keras.layers.Embedding` + `keras_attn.layers.TransformerDecoderBlock`
(pre-norm, approximate GELU) + LayerNorm with tied output embeddings, the
GPT-2 weights copied in. Both greedy outputs must agree token for token (the
token embeddings are scaled up first, so that the argmax has clear margins).

Our decode is one `tf.function(jit_compile=True)` over the whole
`ops.while_loop`, with the prompt prefilled in one call. First calls (trace +
XLA compile) are timed separately; steady-state times are medians of
`--rounds` alternating rounds after warm-up, in this one process, including
the device-to-numpy copy of the result for both. A call with a different
`max_length` value (a tensor) checks that no recompilation happens. Beam
search (width 4, same model and lengths) is timed too, and so is the naive
loop it replaces: one compiled `next_fn` call per token, one sentence at a
time, argmax in NumPy ("per-call greedy").

    .venv/bin/python benchmarks/generation_bench.py [--rounds 15]

Tokens/s counts the new tokens returned: batch * 64 per call (beam search:
the best beam's 64 tokens per sequence, computed over batch * 4 rows).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras
import keras_hub
import numpy as np
import tensorflow as tf
from keras import ops

from keras_attn import generation
from keras_attn.layers.transformer_decoder_block import (
    TransformerDecoderBlock,
)

BATCH, PROMPT, NEW_TOKENS = 8, 8, 64
LENGTH = PROMPT + NEW_TOKENS
VOCAB, LAYERS, HEADS, MODEL_DIM, INTERMEDIATE, POSITIONS = 1000, 2, 8, 256, 1024, 128
BEAM_WIDTH = 4


def gelu_approximate(x):
    return keras.activations.gelu(x, approximate=True)


class DecoderLM:
    """GPT-2's layout from keras_attn blocks, with a cached `next_fn`."""

    def __init__(self):
        self.token_embedding = keras.layers.Embedding(VOCAB, MODEL_DIM)
        self.position_embedding = keras.layers.Embedding(POSITIONS, MODEL_DIM)
        self.blocks = [
            TransformerDecoderBlock(
                intermediate_dim=INTERMEDIATE,
                num_heads=HEADS,
                dropout=0.0,
                activation=gelu_approximate,
                normalize_first=True,
                layer_norm_epsilon=1e-5,
            )
            for _ in range(LAYERS)
        ]
        self.final_norm = keras.layers.LayerNormalization(epsilon=1e-5)
        hidden = self.token_embedding(ops.zeros((1, 2), "int32"))
        self.position_embedding(ops.zeros((2,), "int32"))
        for block in self.blocks:
            hidden = block(hidden)
        self.final_norm(hidden)

    def initial_cache(self, batch_size, length):
        return tuple(block.initial_cache(batch_size, length) for block in self.blocks)

    def next_fn(self, token_ids, cache, index):
        """`(B, T)` tokens at `index..` -> next-token logits `(B, V)`, cache."""
        positions = ops.arange(ops.shape(token_ids)[1], dtype="int32") + index
        x = self.token_embedding(token_ids) + self.position_embedding(positions)[None]
        new_cache = []
        for block, block_cache in zip(self.blocks, cache, strict=True):
            x, block_cache = block(
                x, self_attention_cache=block_cache, cache_update_index=index
            )
            new_cache.append(block_cache)
        last = self.final_norm(x[:, -1])  # (B, d): only the next token's logits
        logits = ops.matmul(last, ops.transpose(self.token_embedding.embeddings))
        return logits, tuple(new_cache)

    def copy_gpt2(self, backbone):
        self.token_embedding.set_weights(backbone.token_embedding.get_weights())
        self.position_embedding.set_weights(
            [backbone.position_embedding.get_weights()[0][:POSITIONS]]
        )
        for ours, theirs in zip(self.blocks, backbone.transformer_layers, strict=True):
            ours.set_weights(theirs.get_weights())
        self.final_norm.set_weights(backbone.layer_norm.get_weights())


def build_models():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        hidden_dim=MODEL_DIM,
        intermediate_dim=INTERMEDIATE,
        max_sequence_length=POSITIONS,
    )
    # Clear argmax margins, so that both implementations pick the same tokens.
    embeddings = backbone.token_embedding.embeddings
    embeddings.assign(embeddings * 200.0)
    causal_lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    causal_lm.compile(sampler="greedy", jit_compile=True)
    ours = DecoderLM()
    ours.copy_gpt2(backbone)
    return causal_lm, ours


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)

    causal_lm, ours = build_models()
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, VOCAB, (BATCH, PROMPT)).astype("int32")
    hub_inputs = {
        "token_ids": np.pad(prompt, [[0, 0], [0, NEW_TOKENS]]),
        "padding_mask": np.arange(LENGTH)[None].repeat(BATCH, 0) < PROMPT,
    }

    def hub_generate():
        return causal_lm.generate(hub_inputs, stop_token_ids=None)["token_ids"]

    signature = [
        tf.TensorSpec((BATCH, PROMPT), tf.int32),
        tf.TensorSpec((), tf.int32),
    ]

    @tf.function(input_signature=signature, jit_compile=True)
    def greedy(prompt, max_length):
        return generation.greedy_search(
            ours.next_fn,
            prompt,
            ours.initial_cache(BATCH, LENGTH),
            max_length,
            output_length=LENGTH,
        )

    @tf.function(input_signature=signature, jit_compile=True)
    def beam(prompt, max_length):
        return generation.beam_search(
            ours.next_fn,
            prompt,
            ours.initial_cache(BATCH, LENGTH),
            max_length,
            beam_width=BEAM_WIDTH,
            output_length=LENGTH,
        )

    @tf.function(jit_compile=True)
    def one_step(token_ids, cache, index):
        return ours.next_fn(token_ids, cache, index)

    def per_call_greedy():
        """The naive loop: one compiled call per token, one sentence at a time,
        argmax in NumPy."""
        cache = ours.initial_cache(1, LENGTH)
        _, cache = one_step(tf.constant(prompt[:1, :-1]), cache, tf.constant(0))
        token = prompt[:1, -1:]
        for index in range(PROMPT - 1, LENGTH - 1):
            logits, cache = one_step(tf.constant(token), cache, tf.constant(index))
            token = np.argmax(logits.numpy(), axis=-1).astype("int32")[:, None]
        return token

    prompt_tensor = tf.constant(prompt)
    full_length = tf.constant(LENGTH, tf.int32)

    def ours_greedy():
        return greedy(prompt_tensor, full_length).numpy()

    def ours_beam():
        tokens, scores = beam(prompt_tensor, full_length)
        return tokens.numpy(), scores.numpy()

    # One-time XLA/LLVM start-up, so that it is not billed to whoever runs first.
    tf.function(lambda x: x + 1.0, jit_compile=True)(tf.constant(1.0)).numpy()
    first = {}
    first["keras_hub greedy"], hub_tokens = timed(hub_generate)
    first["ours greedy"], our_tokens = timed(ours_greedy)
    first["ours beam"], _ = timed(ours_beam)
    first["per-call greedy"], _ = timed(per_call_greedy)
    agreement = float(np.mean(hub_tokens[:, PROMPT:] == our_tokens[:, PROMPT:]))

    # Another max_length value: same program, no retrace or recompile.
    other_time, shorter = timed(lambda: greedy(prompt_tensor, tf.constant(40)).numpy())
    assert np.array_equal(shorter[:, :40], our_tokens[:, :40])
    assert greedy.experimental_get_tracing_count() == 1

    fns = {
        "keras_hub greedy": hub_generate,
        "ours greedy": ours_greedy,
        "ours beam": ours_beam,
        "per-call greedy": per_call_greedy,
    }
    for _ in range(args.warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            times[name].append(timed(fn)[0])
    median = {name: statistics.median(values) for name, values in times.items()}

    new_tokens = {name: BATCH * NEW_TOKENS for name in fns}
    new_tokens["per-call greedy"] = NEW_TOKENS  # one sentence per call
    print(
        f"backend={keras.backend.backend()} tf={tf.__version__} "
        f"keras={keras.__version__} keras_hub={keras_hub.__version__} "
        f"cpus={os.cpu_count()} rounds={args.rounds}"
    )
    print(
        f"batch {BATCH}, prompt {PROMPT}, {NEW_TOKENS} new tokens, {LAYERS} layers, "
        f"d_model {MODEL_DIM}, vocab {VOCAB}"
    )
    print(f"greedy tokens identical to keras-hub: {agreement:.1%}")
    print(f"{'':18s} {'first call s':>12s} {'median ms':>10s} {'tokens/s':>10s}")
    for name in fns:
        print(
            f"{name:18s} {first[name]:12.2f} {median[name] * 1e3:10.1f} "
            f"{new_tokens[name] / median[name]:10.0f}"
        )
    ratio = median["keras_hub greedy"] / median["ours greedy"]
    round_ratio = statistics.median(
        hub / mine
        for hub, mine in zip(
            times["keras_hub greedy"], times["ours greedy"], strict=True
        )
    )
    print(
        f"greedy speed-up over keras-hub: {ratio:.2f}x "
        f"(median of per-round ratios {round_ratio:.2f}x)"
    )
    beam_sentence = median["ours beam"] / BATCH
    print(
        f"beam width {BEAM_WIDTH}: {beam_sentence * 1e3:.1f} ms/sentence, "
        f"{median['per-call greedy'] / beam_sentence:.1f}x faster than per-call "
        f"greedy ({median['per-call greedy'] * 1e3:.1f} ms/sentence)"
    )
    print(
        f"greedy call with a new max_length value (40): {other_time * 1e3:.1f} ms "
        f"(tracing count {greedy.experimental_get_tracing_count()})"
    )


if __name__ == "__main__":
    main()
