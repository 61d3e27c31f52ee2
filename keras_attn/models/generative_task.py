"""`GenerativeTask`: what the language model and the translators share as
tasks that generate token ids.

keras-hub's `CausalLM` and `Seq2SeqLM` pattern: a task defines its decoding
(the `keras_attn.generation` contract and the loop over it), and this base
gives the rest:

- `make_generate_function`: the decoding compiled once per setting
  (`tf.function` on TensorFlow, `jax.jit` reading the weights at each call
  on JAX, the function itself elsewhere) and reused across calls, rebuilt
  when the weights' variables change (`quantize`): `_task.compiled`;
- `run_generate_function`: one call of it on NumPy ids, NumPy out;
- `generate_texts`: raw strings in batches of similar length (each batch
  padded to a length bucket, `_task.bucket_length`), the results back in
  the order of the texts;
- `quantize` with the tasks' default set (`keras_attn.models.quantization`);
- `predict`, which takes token ids and points raw strings at the task's
  text methods (`text_methods`).

Imports no TensorFlow.
"""

from __future__ import annotations

import numpy as np

from keras_attn._optimizer import BuildsOptimizerFirst
from keras_attn.models import _task
from keras_attn.models._setattr import SetattrBeforeInit
from keras_attn.models.quantization import QuantizableTask


class GenerativeTask(BuildsOptimizerFirst, QuantizableTask, SetattrBeforeInit):
    """Mixin of `TransformerLanguageModel` and the translators (before
    `keras.Model` in the bases)."""

    # What `predict` suggests for raw strings (each subclass names its
    # text methods).
    text_methods = "the task's text methods"

    # -- the task's own assistant (speculative decoding) -----------------------

    @property
    def assistant_model(self):
        """The task's own assistant for speculative decoding: None, a smaller
        model of the task's kind on the same vocabularies (a draft) or, for
        the language model, `"prompt_lookup"`. The decodings that can use
        it do so unless given another (`assistant_model=False`: none): the
        language model's with every sampler but beam search, the
        translator's greedy search without kNN-MT. A draft is saved with
        the task (`model.keras`, presets) and loads with it, but is not
        among its weights (`fit` and `count_params` leave it out)."""
        return getattr(self, "_assistant_model", None)

    @assistant_model.setter
    def assistant_model(self, assistant_model):
        if assistant_model is not None:
            self._check_own_assistant(assistant_model)
        # Not tracked: the draft's weights are not the task's (`weights`,
        # `fit` and `count_params` leave them out), yet Keras' saving walks
        # the attributes, so `model.keras` and the presets hold them.
        object.__setattr__(self, "_assistant_model", assistant_model)

    def _check_own_assistant(self, assistant_model) -> None:
        """Raises unless `assistant_model` can be the task's own (each
        subclass that takes one checks it)."""
        raise ValueError(
            f"A {type(self).__name__} takes no assistant. Received: "
            f"assistant_model={assistant_model!r}"
        )

    def __setattr__(self, name, value):
        if name == "assistant_model":  # the property, past Keras' tracking
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def __dir__(self):
        # Keras' saving walks the attributes `dir()` names, the public ones
        # first, and saves an object shared by two paths (a draft's
        # tokenizers that are the task's) under the first: the draft is
        # walked last, as `_assistant_model`, after the task's tokenizers.
        return [name for name in super().__dir__() if name != "assistant_model"]

    def predict(self, x, *args, **kwargs):
        """`keras.Model.predict` on token ids (raw strings: the task's text
        methods)."""
        _task.refuse_text_predict(self, x, self.text_methods)
        return super().predict(x, *args, **kwargs)

    def make_generate_function(
        self, key, build, *, depends=(), signature=None, others=()
    ):
        """`build()` (a decoding function of int32 tensors) compiled for the
        backend once per setting `key` and kept on the task: `tf.function`
        on TensorFlow (with `signature`, the `(shape, dtype)` of each
        argument: one trace for every batch size), `jax.jit` reading the
        weights at each call on JAX, the function itself elsewhere. Rebuilt
        when the task's variables are no longer the ones it was compiled
        with (`quantize`, loading another model's weights into new
        variables) or an object of `depends` (a sampler, a datastore) is no
        longer the same; an eager decoding loop would dispatch every op of
        every step, and an uncompiled one re-trace per call. `others`:
        more models (a draft) whose weights the decoding reads."""
        return _task.compiled(
            self, key, build, depends=depends, signature=signature, others=others
        )

    @staticmethod
    def run_generate_function(generate, *arrays):
        """`generate(*arrays)` on NumPy ids, its output (a tensor or a tuple
        of them) as NumPy arrays."""
        import keras

        found = generate(*arrays)
        if isinstance(found, (tuple, list)):
            return tuple(np.asarray(keras.ops.convert_to_numpy(x)) for x in found)
        return np.asarray(keras.ops.convert_to_numpy(found))

    @staticmethod
    def generate_texts(generate_batch, texts, batch_size, verbose, title, length=len):
        """`generate_batch(batch)` (a list of strings -> one result per
        string) over `texts` in batches of `batch_size`, texts of similar
        `length` together, the results in the order of `texts`; a progress
        bar as `verbose` asks (`"auto"`: when there is more than one
        batch), under `title`. Memory stays flat as `texts` grow."""
        return _task.map_batches(
            generate_batch, texts, batch_size, verbose, title, length=length
        )
