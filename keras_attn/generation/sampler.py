"""`Sampler`: the base decoding loop over a cache; subclasses pick the token.

The `next_fn` contract (shared by every sampler and by beam search):

```
logits, cache = next_fn(token_ids, cache, index)
```

- `token_ids`: int32 `(B, T)`: the tokens at positions `index .. index+T-1`.
  Inside the loop `T == 1` (the last token); the optional prefill pass calls it
  once with the whole prompt, `T == T0`, `index == 0`.
- `cache`: any nest (tuple / list / dict) of tensors whose shapes never change,
  with the batch on axis 0 of every leaf (beam search repeats it `beam_width`
  times and reorders it with `ops.take(leaf, beam_rows, axis=0)`). For
  `MultiHeadAttention` layers it is one `(key_cache, value_cache)` pair
  `(B, Tmax, heads, head_dim)` per layer, written at
  `cache_update_index=index`. Everything else a row needs (the
  cross-attention keys/values of its source, the source padding mask) goes
  in the cache too, passed through unchanged: `next_fn` must not close over
  tensors with a batch axis.
- `index`: scalar int32 tensor, the position of `token_ids[:, 0]` in the
  sequence, i.e. where the new keys/values are written. It changes from step
  to step without retracing.
- returns `logits`, float (any dtype; used in float32) `(B, vocab)` or
  `(B, T, vocab)`: the scores of the token at position `index + T`, i.e. after
  the last input token (with rank 3 the last time step is used; the prefill's
  logits are not used, so returning `(B, vocab)` for the last position only
  saves work), and the new cache, with the same structure, shapes and dtypes.

Prompts are `(B, T0)` int tensors, right-padded, with `prompt_lengths` `(B,)`
(every prompt holds at least one token: a start token for translation).
Decoding fills a `(B, output_length)` buffer: positions `< prompt_lengths[b]`
keep the prompt; the loop runs from `index = min(prompt_lengths) - 1`, feeding
the token at `index` and writing the one at `index + 1`; rows whose prompt is
longer are fed their own prompt tokens until it ends ("teacher forcing"), so
a batch of mixed lengths decodes each row as it would decode alone.
"""

from __future__ import annotations

import numbers

import keras
from keras import ops, tree

from keras_attn.ops import counter_random


def top_k(x, k: int):
    """`ops.top_k(x, k, sorted=True)` with ties in index order, on every backend.

    TensorFlow's and XLA's `top_k` list equal values lowest index first, as
    `argmax` picks; `torch.topk` leaves their order unspecified, so a beam of
    width 1 could leave greedy search at a tie of low-precision logits.
    PyTorch takes a stable descending sort instead.
    """
    if keras.backend.backend() == "torch":
        import torch

        values, indices = torch.sort(
            ops.convert_to_tensor(x), dim=-1, descending=True, stable=True
        )
        return values[..., :k], indices[..., :k]
    return ops.top_k(x, k=k, sorted=True)


# Log-probability given to the tokens a sampler never draws (finite: no
# inf - inf).
CUT = -1e9


def keep_most_probable(log_probs, count):
    """`log_probs` `(..., V)` renormalised over the `count` most probable
    tokens of each row (ties in index order, as `top_k` lists them), the
    others at `CUT`. `count` is an int or an int tensor shaped like
    `log_probs[..., 0]`."""
    vocab_size = log_probs.shape[-1]
    if vocab_size is None:
        vocab_size = ops.shape(log_probs)[-1]
    _, order = top_k(log_probs, vocab_size)  # (..., V): the tokens, best first
    rank = ops.argsort(order, axis=-1)  # (..., V): each token's place in it
    if not isinstance(count, int):
        count = ops.expand_dims(ops.cast(count, rank.dtype), -1)
    kept = ops.where(ops.less(rank, count), log_probs, CUT)
    return ops.log_softmax(kept, axis=-1)


def check_token_id(name: str, value, allow_none: bool = False):
    """A non-negative Python int token id (or `None` where allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
            f"`{name}` must be a non-negative integer token id. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def resolve_stop_token_ids(end_token_id=None, stop_token_ids=None) -> tuple:
    """The token ids that finish a row: keras-attn's `end_token_id` and
    keras-hub's `stop_token_ids` (a list or tuple of ids), together."""
    ids = []
    if end_token_id is not None:
        ids.append(check_token_id("end_token_id", end_token_id))
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, (list, tuple)):
            raise ValueError(
                "`stop_token_ids` must be a list or tuple of token ids (as in "
                f"keras-hub). Received: stop_token_ids={stop_token_ids!r}"
            )
        for token_id in stop_token_ids:
            if not (
                isinstance(token_id, numbers.Integral)
                and not isinstance(token_id, bool)
                and token_id >= 0
            ):
                raise ValueError(
                    "`stop_token_ids` must hold non-negative integer token ids. "
                    f"Received: stop_token_ids={stop_token_ids!r}"
                )
            ids.append(int(token_id))
    return tuple(dict.fromkeys(ids))


def is_stop_token(tokens, stop_token_ids: tuple):
    """Boolean tensor shaped like `tokens`: whether each is a stop token."""
    hit = ops.zeros_like(tokens, dtype="bool")
    for token_id in stop_token_ids:
        hit = ops.logical_or(hit, ops.equal(tokens, token_id))
    return hit


def resolve_lengths(max_length, output_length):
    """`(output_length: int, max_length: scalar int32 tensor)`.

    `output_length` is the static width of the returned tokens (and must fit
    the cache); `max_length`, an int or a scalar tensor, is where decoding
    stops (prompt included), clipped to `output_length`.
    """
    if output_length is None:
        if isinstance(max_length, numbers.Integral) and not isinstance(
            max_length, bool
        ):
            output_length = int(max_length)
        else:
            raise ValueError(
                "`output_length` (a Python int) is needed when `max_length` is "
                f"a tensor. Received: max_length={max_length!r}, "
                "output_length=None"
            )
    if (
        isinstance(output_length, bool)
        or not isinstance(output_length, numbers.Integral)
        or output_length < 1
    ):
        raise ValueError(
            "`output_length` must be a positive integer. "
            f"Received: output_length={output_length!r}"
        )
    if isinstance(max_length, numbers.Integral) and not isinstance(max_length, bool):
        if not 1 <= max_length <= output_length:
            raise ValueError(
                "`max_length` must be in [1, output_length]. "
                f"Received: max_length={max_length}, output_length={output_length}"
            )
    max_length = ops.minimum(ops.cast(max_length, "int32"), int(output_length))
    return int(output_length), max_length


def prepare_prompt(prompt, prompt_lengths, pad_token_id, output_length):
    """Normalise a prompt: `(prompt (B, T0), tokens (B, L), lengths (B,))`.

    `tokens` is the output buffer: the prompt where it is valid, `pad_token_id`
    everywhere else.
    """
    prompt = ops.convert_to_tensor(prompt)
    if len(prompt.shape) != 2:
        raise ValueError(
            "`prompt` must be an int tensor of shape (batch, prompt_length). "
            f"Received: prompt.shape={tuple(prompt.shape)}"
        )
    prompt = ops.cast(prompt, "int32")
    prompt_width = prompt.shape[1]
    if prompt_width is not None and prompt_width > output_length:
        raise ValueError(
            "The prompt is longer than the output. Received: "
            f"prompt.shape={tuple(prompt.shape)}, output_length={output_length}"
        )
    batch_size = ops.shape(prompt)[0]
    if prompt_lengths is None:
        lengths = ops.full((batch_size,), ops.shape(prompt)[1], dtype="int32")
    else:
        lengths = ops.cast(ops.convert_to_tensor(prompt_lengths), "int32")
        if len(lengths.shape) != 1:
            raise ValueError(
                "`prompt_lengths` must have shape (batch,). "
                f"Received: prompt_lengths.shape={tuple(lengths.shape)}"
            )
    # Every prompt holds at least its first token.
    lengths = ops.clip(lengths, 1, ops.shape(prompt)[1])
    positions = ops.arange(output_length, dtype="int32")[None, :]  # (1, L)
    padded = ops.pad(prompt, [[0, 0], [0, output_length - ops.shape(prompt)[1]]])
    tokens = ops.where(
        positions < lengths[:, None], padded, ops.cast(pad_token_id, "int32")
    )  # (B, L)
    return prompt, tokens, lengths


def run_prefill(next_fn, prompt, cache, prefill: bool):
    """Fill the cache for the prompt positions with one `next_fn` call.

    Skipped when `prefill=False` or the prompt is statically one token long
    (the loop feeds it anyway). Positions past a row's prompt length get
    values of padding tokens, but the loop overwrites each position before
    any query attends to it (the causal mask hides the rest), so they never
    matter.
    """
    if not prefill or prompt.shape[1] == 1:
        return cache
    _, cache = next_fn(prompt, cache, ops.convert_to_tensor(0, "int32"))
    return cache


def start_index(lengths, prefill: bool):
    """The first position fed inside the loop."""
    if not prefill:
        return ops.convert_to_tensor(0, "int32")
    return ops.cast(ops.maximum(ops.min(lengths) - 1, 0), "int32")


def last_step_logits(logits):
    """`(B, vocab)` logits of the next token from `(B, vocab)` or `(B, T, V)`."""
    if len(logits.shape) == 3:
        return logits[:, -1, :]
    if len(logits.shape) != 2:
        raise ValueError(
            "`next_fn` must return logits of shape (batch, vocab) or "
            f"(batch, T, vocab). Received: logits.shape={tuple(logits.shape)}"
        )
    return logits


def write_column(tokens, position, column):
    """`tokens` `(B, L)` with column `position` replaced by `column` `(B,)`.

    A `where` over the buffer rather than `slice_update`: plain TF ops in the
    exported graph, and cheap next to a model step.
    """
    positions = ops.arange(ops.shape(tokens)[-1], dtype="int32")  # (L,)
    hit = ops.equal(positions, position)
    while len(hit.shape) < len(tokens.shape):
        hit = hit[None]
    return ops.where(hit, ops.expand_dims(column, -1), tokens)


class Sampler:
    """Base class of the samplers: owns the decoding `ops.while_loop`.

    The loop calls `next_fn` once per new token over a fixed-shape cache,
    turns the logits into float32 log-probabilities (`compute_log_probs`,
    scaled by `temperature`) and asks `get_next_token` for the next token.
    Subclasses override `get_next_token` only (keras-hub's sampler design).

    The whole decode is one `ops.while_loop` with fixed loop-variable shapes:
    under `tf.function` (with or without `jit_compile=True`) or `jax.jit` it
    traces once for a given batch size and prompt width; the index, the
    prompt lengths, `max_length` and the seed are tensors and may change
    between calls without retracing or recompiling. It uses TF ops only
    (through `keras.ops`) and no Python-side state, so it exports in a
    SavedModel.

    Args:
        temperature: positive float; logits are divided by it.
        seed: default seed of the random samplers (int or `None`).

    Call arguments:
        next_fn: `(token_ids, cache, index) -> (logits, cache)`; see the module
            docstring of `keras_attn.generation.sampler`.
        prompt: int `(B, T0)`, right-padded with `pad_token_id`.
        cache: the initial cache nest (zeros), with room for `output_length`
            positions.
        max_length: int or scalar int tensor: decoding stops when sequences
            reach this length (prompt included).
        prompt_lengths: int `(B,)`, the valid prompt tokens of each row;
            defaults to `T0` for every row.
        end_token_id: optional int; a row that generates it is finished: it
            keeps it, then emits `pad_token_id`. The loop ends when every
            row is finished.
        stop_token_ids: optional list or tuple of ints (keras-hub's name):
            more ids that finish a row, as `end_token_id` does; both may be
            given.
        pad_token_id: int written after the end token and past `max_length`.
        output_length: static width of the result; defaults to `max_length`
            (then a Python int). Needed when `max_length` is a tensor.
        seed: int or scalar int tensor for the random samplers, or one
            seed per row (a `(B,)` int tensor or a list of ints: a row's
            draws then depend on its own seed only, not on the other rows
            or its place in the batch); defaults to the constructor's seed
            (a fresh random one if both are `None`).
        prefill: fill the cache for the prompt with one `next_fn` call on the
            whole `(B, T0)` prompt before the loop (faster); with `False` the
            loop steps through the prompt one token at a time (for a
            `next_fn` that only takes one token).

    Returns:
        int32 tokens `(B, output_length)`: the prompt, then the generated
        tokens, then `pad_token_id`.

    Example:

    ```python
    sampler = keras_attn.generation.TopKSampler(k=10, temperature=0.8)
    tokens = sampler(next_fn, prompt, cache, max_length=64, end_token_id=2)
    ```
    """

    def __init__(self, temperature: float = 1.0, seed: int | None = None):
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, numbers.Real)
            or not temperature > 0
        ):
            raise ValueError(
                "`temperature` must be a positive float. "
                f"Received: temperature={temperature!r}"
            )
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
        ):
            raise ValueError(f"`seed` must be an int or None. Received: seed={seed!r}")
        self.temperature = float(temperature)
        self.seed = seed

    def compute_log_probs(self, logits):
        """float32 `log_softmax(logits / temperature)`, `(B, vocab)`."""
        logits = ops.cast(logits, "float32")
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return ops.log_softmax(logits, axis=-1)

    def distribution(self, log_probs):
        """float32 log-probabilities of the distribution `get_next_token`
        draws from, shaped like `log_probs` (`(..., vocab)`, temperature
        applied): the tokens it never draws at a large negative value, the
        others renormalised. Speculative sampling
        (`keras_attn.generation.speculative_sample`) accepts and corrects
        guesses against it. This base class draws from `log_probs` itself."""
        return ops.cast(log_probs, "float32")

    def get_next_token(self, log_probs, seed):
        """The next token of each row.

        Args:
            log_probs: float32 `(B, vocab)`, temperature applied.
            seed: 32-bit seed tensor, fresh at every step (for
                `keras_attn.ops.counter_random` draws): scalar, or `(B,)`,
                one per row, when the call was given a seed per row.

        Returns:
            int `(B,)`.
        """
        raise NotImplementedError

    def __call__(
        self,
        next_fn,
        prompt,
        cache,
        max_length,
        *,
        prompt_lengths=None,
        end_token_id: int | None = None,
        pad_token_id: int = 0,
        output_length: int | None = None,
        seed=None,
        prefill: bool = True,
        stop_token_ids=None,
    ):
        stop_ids = resolve_stop_token_ids(end_token_id, stop_token_ids)
        state = self.start(
            next_fn,
            prompt,
            cache,
            max_length,
            prompt_lengths=prompt_lengths,
            pad_token_id=pad_token_id,
            output_length=output_length,
            seed=seed,
            prefill=prefill,
        )
        state = self.decode(
            next_fn, state, stop_ids=stop_ids, pad_token_id=pad_token_id
        )
        return self.result(state, stop_ids=stop_ids)

    # -- the loop in parts: `__call__` is `start`, `decode`, `result` ----------
    #
    # A caller that decodes in chunks (`TransformerLanguageModel.stream`)
    # compiles `start` and `decode(..., until=...)` and calls them from
    # Python, the state (a dict of tensors, the cache among them) passed from
    # one call to the next; `decided_tokens` is what the chunks have decided.
    # `stop_ids` is `resolve_stop_token_ids(end_token_id, stop_token_ids)`.

    def start(
        self,
        next_fn,
        prompt,
        cache,
        max_length,
        *,
        prompt_lengths=None,
        pad_token_id: int = 0,
        output_length: int | None = None,
        seed=None,
        prefill: bool = True,
    ) -> dict:
        """The decoding's state before its first step (the prompt prefilled):
        a dict of tensors, `index` the position fed next. The arguments are
        `__call__`'s."""
        pad_token_id = check_token_id("pad_token_id", pad_token_id)
        output_length, max_length = resolve_lengths(max_length, output_length)
        prompt, tokens, lengths = prepare_prompt(
            prompt, prompt_lengths, pad_token_id, output_length
        )
        seed = counter_random.seed_tensor(self.seed if seed is None else seed)
        counter_random.check_row_seeds(seed, ops.shape(tokens)[0])
        cache = run_prefill(next_fn, prompt, cache, prefill)
        index = start_index(lengths, prefill)
        inputs = ops.take(tokens, index, axis=1)[:, None]  # (B, 1)
        done = ops.zeros_like(lengths, dtype="bool")  # (B,)
        return {
            "tokens": tokens,
            "inputs": inputs,
            "cache": cache,
            "index": index,
            "done": done,
            "lengths": lengths,
            "max_length": max_length,
            "seed": seed,
        }

    def running(self, state, *, stop_ids: tuple = (), until=None):
        """Scalar bool tensor: whether the decoding of `state` goes on (and,
        with `until`, a scalar int, whether its index is below it)."""
        return self._going(
            state["index"], state["done"], state["max_length"], stop_ids, until
        )

    @staticmethod
    def _going(index, done, max_length, stop_ids, until=None):
        going = ops.less(index, max_length - 1)
        if until is not None:
            going = ops.logical_and(going, ops.less(index, until))
        if not stop_ids:
            return going
        return ops.logical_and(going, ops.logical_not(ops.all(done)))

    def decode(
        self,
        next_fn,
        state,
        *,
        stop_ids: tuple = (),
        pad_token_id: int = 0,
        until=None,
    ) -> dict:
        """`state` decoded to the end, or (`until`: a scalar int or int32
        tensor) until its index reaches `until`: one `ops.while_loop` either
        way, tracing once for every `until`. The tokens do not depend on
        where the decoding was stopped and resumed."""
        lengths, max_length = state["lengths"], state["max_length"]
        seed = state["seed"]

        def cond(tokens, inputs, cache, index, done):
            return self._going(index, done, max_length, stop_ids, until)

        def body(tokens, inputs, cache, index, done):
            logits, cache = next_fn(inputs, cache, index)
            log_probs = self.compute_log_probs(last_step_logits(logits))  # (B, V)
            next_token = ops.cast(
                self.get_next_token(log_probs, counter_random.step_seed(seed, index)),
                "int32",
            )  # (B,)
            position = index + 1
            in_prompt = ops.less(position, lengths)  # (B,)
            next_token = ops.where(
                in_prompt, ops.take(tokens, position, axis=1), next_token
            )
            next_token = ops.where(done, pad_token_id, next_token)
            tokens = write_column(tokens, position, next_token)
            if stop_ids:
                ended = ops.logical_and(
                    ops.logical_not(in_prompt), is_stop_token(next_token, stop_ids)
                )
                done = ops.logical_or(done, ended)
            return tokens, next_token[:, None], cache, position, done

        names = ("tokens", "inputs", "cache", "index", "done")
        found = ops.while_loop(cond, body, tuple(state[name] for name in names))
        return {**state, **dict(zip(names, found, strict=True))}

    def decided_tokens(self, state, *, stop_ids: tuple = ()):
        """int32 `(B, output_length)`: the tokens decided so far, final at
        the positions up to `state["index"]` (padding after them)."""
        return state["tokens"]

    def result(self, state, *, stop_ids: tuple = ()):
        """What `__call__` returns for a finished `state`."""
        return state["tokens"]

    def get_config(self) -> dict:
        return {"temperature": self.temperature, "seed": self.seed}

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)


def map_cache(fn, cache):
    """Apply `fn` to every tensor of a cache nest (keeps the structure)."""
    return tree.map_structure(fn, cache)
