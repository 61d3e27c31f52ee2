"""TF Serving warmup requests: `assets.extra/tf_serving_warmup_requests`.

When it loads a version, `tensorflow_model_server` (`--enable_model_warmup`,
on by default) replays the `PredictionLog` records of this TFRecord file
through the model before it serves it, so that the first real requests do
not pay for the lazy initialisation of the graph (its tokenizer resources,
Grappler's rewrites, the memory of each batch shape). It reads at most 1,000
records and fails the load on a record it cannot run
(`servables/tensorflow/saved_model_warmup_util.cc`).

Every export writes one request per signature and per batch size the graph
runs on under the task's batching configuration (`batching.py`), built with
`tensorflow-serving-api`'s protos; `check_servable` replays them all.
"""

from __future__ import annotations

from pathlib import Path

WARMUP_FILE = "tf_serving_warmup_requests"
MAX_WARMUP_RECORDS = 1000  # WarmupConsts::kMaxNumRecords


def warmup_logs(model_name: str, samples: dict, batch_sizes) -> list:
    """`PredictionLog`s: for each signature of `samples` (`{signature:
    {input: list of texts}}`) and each size in `batch_sizes`, one Predict
    request of that many rows (the signature's sample inputs, repeated:
    texts, or a language model's integer seeds)."""
    from tensorflow_serving.apis import predict_pb2, prediction_log_pb2

    from keras_attn.export._predict import request_tensor_proto

    logs = []
    for signature, inputs in samples.items():
        for size in batch_sizes:
            request = predict_pb2.PredictRequest()
            request.model_spec.name = model_name
            request.model_spec.signature_name = signature
            for name, values in inputs.items():
                rows = [values[i % len(values)] for i in range(size)]
                request.inputs[name].CopyFrom(request_tensor_proto(rows))
            logs.append(
                prediction_log_pb2.PredictionLog(
                    predict_log=prediction_log_pb2.PredictLog(request=request)
                )
            )
    if len(logs) > MAX_WARMUP_RECORDS:
        raise ValueError(
            f"TF Serving reads at most {MAX_WARMUP_RECORDS} warmup records. "
            f"Received: {len(logs)} requests"
        )
    return logs


def write_warmup(path, logs: list) -> Path:
    """Write `logs` as TF Serving's warmup TFRecord file at `path`."""
    import tensorflow as tf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for log in logs:
            writer.write(log.SerializeToString())
    return path


def read_warmup(path) -> list:
    """The `PredictionLog`s of a warmup file, read as the server reads it."""
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    logs = []
    for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
        log = prediction_log_pb2.PredictionLog()
        log.ParseFromString(record)
        logs.append(log)
        if len(logs) > MAX_WARMUP_RECORDS:
            raise ValueError(
                f"Number of warmup records exceeds the maximum "
                f"({MAX_WARMUP_RECORDS}) at {path}"
            )
    return logs
