"""SavedModel export for TF Serving: strings in, strings and scores out.

Each task says what it serves (`task.serving_spec(**options)`, a
`ServingSpec` of its signatures and metadata) and one exporter,
`export_task(task, base_dir)`, writes it: TF Serving's layout
`<base>/<model_name>/<version>/` with the tokenizer(s) and the decoding
inside the graph, so that the export needs TensorFlow and TensorFlow Text
only, plus the server's warmup requests (`warmup`) and the task's batching
parameters (`batching`). `export_translator`, `export_sentiment`,
`export_language_model` and the tasks' `export` methods are `export_task`
with each task's options.
`check_servable(path)` proves it, in this TensorFlow or in that of a TF
Serving release (`releases`), answering the export's sample and warmup
requests as the server's Predict API does. The stand-in for the server
itself (REST, batching), which the tests and benchmarks run requests
through, is test tooling outside the installed package
(`serving_standin/` at the repository root). See docs/SERVING.md.
"""

from keras_attn._extras import require

# TensorFlow, TensorFlow Text and TF Serving's API protos come with the
# `export` extra: say so here, at the import, rather than in the middle of an
# export.
require("keras_attn.export", "export")

from keras_attn.export.check import ServabilityReport, check_servable  # noqa: E402
from keras_attn.export.language_model import export_language_model  # noqa: E402
from keras_attn.export.sentiment import export_sentiment  # noqa: E402
from keras_attn.export.task import Endpoint, ServingSpec, export_task  # noqa: E402
from keras_attn.export.translator import export_translator  # noqa: E402

__all__ = [
    "Endpoint",
    "ServabilityReport",
    "ServingSpec",
    "check_servable",
    "export_language_model",
    "export_sentiment",
    "export_task",
    "export_translator",
]
