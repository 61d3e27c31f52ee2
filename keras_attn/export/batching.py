"""TF Serving's request batching: each task's parameters.

Every export writes its task's parameters to `batching_params.pbtxt` in the
version directory, where `tensorflow_model_server --enable_batching
--enable_per_model_batching_parameters` reads them; the same text works as
the server-wide `--batching_parameters_file`. The text is TF Serving's
`BatchingParameters` message (`session_bundle_config.proto`), written and
parsed with a copy of that message's schema, so a misspelt field fails here
as it would in the server. The warmup requests (`warmup.py`) cover the
batch sizes the graph runs on under these parameters.

What the server's batching does to requests that arrive together (merge,
pad, split) is imitated by the tests' stand-in, `serving_standin/batching.py`
at the repository root (not installed).
"""

from __future__ import annotations

from dataclasses import dataclass

from keras_attn import _validation as v

BATCHING_PARAMS_FILE = "batching_params.pbtxt"


def _batching_parameters_class():
    """TF Serving's `BatchingParameters` message class.

    `tensorflow-serving-api` does not ship `session_bundle_config.proto`,
    so its message is rebuilt here from the proto at TF Serving's 2.20.0
    tag (field names, numbers and wrapper types as there).
    """
    from google.protobuf import (
        descriptor_pb2,
        descriptor_pool,
        message_factory,
        wrappers_pb2,
    )

    pool = descriptor_pool.DescriptorPool()
    wrappers = descriptor_pb2.FileDescriptorProto()
    wrappers_pb2.DESCRIPTOR.CopyToProto(wrappers)
    pool.Add(wrappers)
    proto = descriptor_pb2.FileDescriptorProto(
        name="keras_attn/tensorflow_serving_batching_parameters.proto",
        package="tensorflow.serving",
        dependency=["google/protobuf/wrappers.proto"],
        syntax="proto3",
    )
    message = proto.message_type.add(name="BatchingParameters")
    field = descriptor_pb2.FieldDescriptorProto
    for name, number, wrapper in (
        ("max_batch_size", 1, "Int64Value"),
        ("batch_timeout_micros", 2, "Int64Value"),
        ("max_enqueued_batches", 3, "Int64Value"),
        ("num_batch_threads", 4, "Int64Value"),
        ("thread_pool_name", 5, "StringValue"),
        ("enable_large_batch_splitting", 8, "BoolValue"),
        ("max_execution_batch_size", 9, "Int64Value"),
    ):
        message.field.add(
            name=name,
            number=number,
            label=field.LABEL_OPTIONAL,
            type=field.TYPE_MESSAGE,
            type_name=f".google.protobuf.{wrapper}",
        )
    message.field.add(
        name="allowed_batch_sizes",
        number=6,
        label=field.LABEL_REPEATED,
        type=field.TYPE_INT64,
    )
    message.field.add(
        name="pad_variable_length_inputs",
        number=7,
        label=field.LABEL_OPTIONAL,
        type=field.TYPE_BOOL,
    )
    pool.Add(proto)
    descriptor = pool.FindMessageTypeByName("tensorflow.serving.BatchingParameters")
    return message_factory.GetMessageClass(descriptor)


@dataclass(frozen=True)
class BatchingConfig:
    """TF Serving batching parameters, validated as the server validates them.

    Attributes:
        max_batch_size: the largest request accepted; larger ones are
            refused ("Task size N is larger than maximum input batch size").
        max_execution_batch_size: the largest batch the graph runs on;
            requests above it (or above the room left in the open batch)
            are split (`enable_large_batch_splitting`).
        allowed_batch_sizes: the batch sizes the graph runs on (a merged
            batch is padded up to the next one); the last must equal
            `max_batch_size`, the server's rule. The warmup requests use
            those up to `max_execution_batch_size`.
        batch_timeout_micros: how long an open batch waits to fill.
        max_enqueued_batches: batches waiting per model; with splitting a
            request is refused when it exceeds the queue's room, so
            `max_enqueued_batches * max_execution_batch_size` must reach
            `max_batch_size`.
        num_batch_threads: None leaves the server's default, one thread per
            CPU core (the setting TF Serving's guide gives for CPU servers).
    """

    max_batch_size: int
    max_execution_batch_size: int
    allowed_batch_sizes: tuple
    batch_timeout_micros: int
    max_enqueued_batches: int
    num_batch_threads: int | None = None

    def __post_init__(self):
        sizes = tuple(self.allowed_batch_sizes)
        object.__setattr__(self, "allowed_batch_sizes", sizes)
        for name in ("max_batch_size", "max_execution_batch_size"):
            v.check_positive_int(name, getattr(self, name))
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(
                "`allowed_batch_sizes` must be increasing positive sizes. "
                f"Received: allowed_batch_sizes={sizes!r}"
            )
        if sizes[-1] != self.max_batch_size:
            # bundle_factory_util.cc, WrapSessionForBatching.
            raise ValueError(
                "Last entry in allowed_batch_sizes must match max_batch_size; "
                f"last entry was {sizes[-1]}; expected {self.max_batch_size}. "
                f"Received: allowed_batch_sizes={sizes!r}"
            )
        if self.max_execution_batch_size not in sizes:
            raise ValueError(
                "`max_execution_batch_size` must be one of the allowed batch "
                f"sizes {sizes}. Received: max_execution_batch_size="
                f"{self.max_execution_batch_size}"
            )
        room = self.max_enqueued_batches * self.max_execution_batch_size
        if room < self.max_batch_size:
            raise ValueError(
                "`max_enqueued_batches * max_execution_batch_size` must be at "
                f"least max_batch_size={self.max_batch_size}, or the server "
                "refuses the largest requests on an idle queue. Received: "
                f"max_enqueued_batches={self.max_enqueued_batches}"
            )
        if self.batch_timeout_micros < 0:
            raise ValueError(
                "`batch_timeout_micros` must be >= 0. Received: "
                f"batch_timeout_micros={self.batch_timeout_micros}"
            )

    @property
    def execution_batch_sizes(self) -> tuple:
        """The batch sizes the graph runs on: the warmup requests' sizes."""
        return tuple(
            s for s in self.allowed_batch_sizes if s <= self.max_execution_batch_size
        )

    def to_proto(self):
        message = _batching_parameters_class()()
        message.max_batch_size.value = self.max_batch_size
        message.batch_timeout_micros.value = self.batch_timeout_micros
        message.max_enqueued_batches.value = self.max_enqueued_batches
        if self.num_batch_threads is not None:
            message.num_batch_threads.value = self.num_batch_threads
        message.enable_large_batch_splitting.value = True
        message.max_execution_batch_size.value = self.max_execution_batch_size
        message.allowed_batch_sizes.extend(self.allowed_batch_sizes)
        return message

    def to_text(self) -> str:
        """The `BatchingParameters` text TF Serving reads."""
        from google.protobuf import text_format

        return text_format.MessageToString(self.to_proto())

    @classmethod
    def from_text(cls, text: str) -> BatchingConfig:
        """Parse `BatchingParameters` text (fails on fields TF Serving does
        not know, as the server does)."""
        from google.protobuf import text_format

        message = text_format.Parse(text, _batching_parameters_class()())
        if not message.enable_large_batch_splitting.value:
            raise ValueError(
                "keras_attn's batching configurations split large requests: "
                "`enable_large_batch_splitting { value: true }` is required. "
                f"Received: {text!r}"
            )
        return cls(
            max_batch_size=message.max_batch_size.value,
            max_execution_batch_size=message.max_execution_batch_size.value
            or message.max_batch_size.value,
            allowed_batch_sizes=tuple(message.allowed_batch_sizes),
            batch_timeout_micros=message.batch_timeout_micros.value,
            max_enqueued_batches=message.max_enqueued_batches.value or 10,
            num_batch_threads=message.num_batch_threads.value
            if message.HasField("num_batch_threads")
            else None,
        )


# Per task. The graph runs on batches of 1, 8 or 32 (the sizes
# benchmarks/serving_bench.py measures; on CPU every task's throughput still
# grows from 8 to 32 rows while the latency of 32 rows stays within a few
# batch-1 latencies of the small models); requests of up to 256 rows are
# accepted and split. The timeout is about a tenth of a batch-1 call of the
# task's pretrained default (sentiment: tens of milliseconds; the beam-search
# translator and the language model's decoding: over a hundred).
TASK_BATCHING = {
    "sentiment": BatchingConfig(
        max_batch_size=256,
        max_execution_batch_size=32,
        allowed_batch_sizes=(1, 8, 32, 256),
        batch_timeout_micros=2_000,
        max_enqueued_batches=16,
    ),
    "translation": BatchingConfig(
        max_batch_size=256,
        max_execution_batch_size=32,
        allowed_batch_sizes=(1, 8, 32, 256),
        batch_timeout_micros=10_000,
        max_enqueued_batches=16,
    ),
    "language_model": BatchingConfig(
        max_batch_size=256,
        max_execution_batch_size=32,
        allowed_batch_sizes=(1, 8, 32, 256),
        batch_timeout_micros=10_000,
        max_enqueued_batches=16,
    ),
}


def task_batching(task: str) -> BatchingConfig:
    if task not in TASK_BATCHING:
        raise ValueError(
            f"`task` must be one of {sorted(TASK_BATCHING)}. Received: task={task!r}"
        )
    return TASK_BATCHING[task]
