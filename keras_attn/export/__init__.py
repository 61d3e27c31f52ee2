"""SavedModel export for TF Serving: strings in, strings and scores out.

Each exporter writes TF Serving's layout `<base>/<model_name>/<version>/` with
the tokenizer(s) and the decoding inside the graph, so that the export needs
TensorFlow and TensorFlow Text only, plus the server's warmup requests
(`warmup`) and the task's batching parameters (`batching`).
`check_servable(path)` proves it, in this TensorFlow or in that of a TF
Serving release (`releases`). `serving.StandInServer` answers Predict, REST
and batched requests around a loaded export as the server would
(`predict_protocol`): the project's stand-in for the server. See
docs/SERVING.md.
"""

from keras_attn._extras import require

# TensorFlow, TensorFlow Text and TF Serving's API protos come with the
# `export` extra: say so here, at the import, rather than in the middle of an
# export.
require("keras_attn.export", "export")

from keras_attn.export.check import ServabilityReport, check_servable  # noqa: E402
from keras_attn.export.language_model import export_language_model  # noqa: E402
from keras_attn.export.sentiment import export_sentiment  # noqa: E402
from keras_attn.export.translator import export_translator  # noqa: E402

__all__ = [
    "ServabilityReport",
    "check_servable",
    "export_language_model",
    "export_sentiment",
    "export_translator",
]
