"""No default SavedModel signature: keras-attn's models export theirs.

Keras's TensorFlow layers give every model a `_default_save_signature`
property, the `serving_default` that `tf.saved_model.save(model)` writes
when given no signatures: a new `tf.function` of the whole model, with
dynamic shapes, built on each read. Keras's `ExportArchive`, collecting the
resources of what it tracks, reads it on every tracked model and traces it
(for a task: the task and each backbone, every attention call with both its
explicit and its memory-efficient path, as the lengths are unknown), then
drops it: about 2 of the 5 seconds of a small language model's export.
keras-attn's exports (`task.export`, `keras_attn.export.export_task`,
`keras.Model.export` of a backbone) name their endpoints, so the models
here have none; `tf.saved_model.save` of one writes no signature unless it
is given `signatures=`.
"""

from __future__ import annotations


class ExplicitSignatures:
    """Mixin (before `keras.Model` in the bases): no default signature."""

    @property
    def _default_save_signature(self):
        return None
