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

from keras_attn.export.check import ServabilityReport, check_servable
from keras_attn.export.language_model import export_language_model
from keras_attn.export.sentiment import export_sentiment
from keras_attn.export.translator import export_translator

__all__ = [
    "ServabilityReport",
    "check_servable",
    "export_language_model",
    "export_sentiment",
    "export_translator",
]
