"""The project's stand-in for TF Serving's model server: test tooling, not
installed.

No package registry ships `tensorflow_model_server`, so the tests, the
serving benchmark (`benchmarks/serving_bench.py`) and the script that
writes the documented responses (`docs/serving_examples.py`) answer
requests with this instead. It lives at the repository root, outside the
`keras_attn` package (DESIGN: test tooling that imitates the server is not
installed); import it with the repository root on `sys.path` (pytest puts
it there for the tests; the scripts insert it).

- `server.StandInServer`: one export, loaded as TF Serving loads it,
  answering `PredictRequest`s, REST `:predict` bodies (`rest`), HTTP
  requests to the server's REST port (`http`: routes, methods, status
  codes) and requests that arrive together under batching;
  `server.predict_request` builds a client's `PredictRequest`.
- `http_port.serve`: `StandInServer.http` behind a socket on 127.0.0.1.
- `rest`: the REST JSON forms (`util/json_tensor.cc`).
- `batching.run_batched`: what the server's `BatchingSession` does to
  requests that arrive together (merge, pad to an allowed size, split).

A result about the export (a signature fails, an output has the wrong shape)
holds for the server; a result about the conversions or the batching holds
for this stand-in, which follows the server's sources (TF Serving 2.20.0)
but is not the server. The Predict checks and conversions it runs
(`keras_attn.export._predict`) are the installed package's, shared with
`check_servable`, which replays the warmup requests through them.
"""

from serving_standin.batching import BatchingError, run_batched
from serving_standin.server import HTTP_STATUS, StandInServer, predict_request

__all__ = [
    "HTTP_STATUS",
    "BatchingError",
    "StandInServer",
    "predict_request",
    "run_batched",
]
