"""The collectives of the compiled programs under `get_layout_map`, beside
what the Megatron-style layout implies (issue 37).

Not a timing: the CPU partitioner's plan. On JAX with 8 virtual CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`; run from any process,
the script re-executes itself so when Keras is not already on JAX with 8
devices), for each task of `--tasks` at a test size whose heads (4),
feed-forward width (64) and vocabulary (64) divide every mesh
(`TransformerLanguageModel`, `TextClassifier`, `TransformerTranslator`: d 32,
`--layers` blocks per stack, default 2, no dropout, batch 8 of 16 tokens) and
each mesh of `--meshes` (`batch x model`; default data `8x1`, model `1x2`,
`1x4`, mixed `2x4`), under `keras.distribution.ModelParallel(
layout_map=Task.get_layout_map(mesh), batch_dim_name="batch")`:

- `train`: the training step that `fit` runs: the model is compiled (SGD,
  the task's loss) and built on a batch distributed as Keras distributes it
  (`keras.src.backend.jax.trainer._distribute_data`), `make_train_function()`
  builds the `jax.jit(train_step, donate_argnums=0, out_shardings=...)` of
  Keras 3's JAX trainer, and that very jitted function (taken from the
  train function's closure) is lowered with the real state (every
  trainable, non-trainable, optimizer and metric variable's sharded value)
  and compiled: `.lower(state, data).compile().as_text()`.
- `decode`: what decoding compiles under the sharded weights: the language
  model's `generate_ids` (greedy, prompt 4 tokens, 12 in all, the
  `keras_attn.generation` loop over the KV cache, prefill then one token per
  step), the translator's `decoding_fn` (beam search, beam 4, as `translate`
  decodes), both jitted as `translate` does on JAX
  (`translator._jit_reading_weights`: the weights are arguments of the
  compiled function, with their shardings). The collectives inside the
  `while` loop are the cached token step's; those outside, the prefill's
  (the translator's: the encoder's). The classifier does not decode.
- `memory_efficient`: a forward pass (`model(x, training=False)`, jitted
  with the weights as sharded arguments as above) with `flash_attention=True`
  on every attention layer, which on a CPU (no fused kernel) takes
  `keras_attn.ops.memory_efficient_attention` at any length (counted: the
  function is wrapped while tracing; the count is the number of attention
  layers).

In each compiled HLO module the collectives are counted: `all-reduce`,
`all-gather`, `reduce-scatter`, `collective-permute`, `all-to-all` (an async
`-start`/`-done` pair counts once, at its start), as ops and as operands (XLA's
combiner merges all-reduces into one op carrying a tuple). Each is put in a
category from its mesh axes (the replica groups) and its op name (Keras's
layer names reach the HLO metadata through `jax.named_scope`): per block,
forward (`jvp`) or backward (`transpose`); the embedding lookup of the
vocabulary-sharded table; the tied output projection's input gradient; the
vocabulary-sharded softmax of the loss; batch-axis (data parallel / FSDP)
weight gathers, gradient reductions and loss/metric means. Per block it is
set beside the Megatron count: per attention 1 forward (after the output
projection) and 1 backward per distinct input (self-attention: 1, its
query, key and value read the same states; cross-attention: 2, the decoder
states and the encoder's output), per feed-forward 1 and 1.

All-gathers are traced back (through bitcasts, copies, reshapes and
transposes) to the step's parameters, whose metadata names the state leaf
(`state[0][k]`: the k-th trainable variable): an all-gather of a kernel whose
result is its full shape is a kernel gathered where a shard was enough; one
along the batch axis whose result is the kernel's model-axis shard is the
FSDP gather the layout asks for (expected where the mesh's batch axis is
more than 1).

`--no-fsdp`: `get_layout_map(mesh, fsdp=False)`, the kernels replicated
over the batch axis (data parallelism times Megatron's, what
`keras_attn.training.make_distribution("data:D,model:M")` sets).

`--activation-layouts` (an experiment, not the library's layout map) also
puts entries for layer outputs in the layout map (`<layer path>/output`,
which Keras's `ModelParallel` looks up after every layer call and applies
with a sharding constraint): the norms', the backbone embedding's, the
attention and feed-forward output projections' `(batch, None, None)`, the
query/key/value projections' `(batch, None, model, None)`, the
intermediate's `(batch, None, model)` (`ACTIVATION_LAYOUTS`). Without them,
on a mesh whose batch axis is more than 1, the partitioner is free to keep
the activations split along d over the batch axis (the kernels' d is
split there for FSDP) instead of along the batch.

    .venv/bin/python benchmarks/distribution_bench.py \\
        [--tasks language_model classifier translator] \\
        [--meshes 8x1 1x2 1x4 2x4] [--steps train decode memory_efficient] \\
        [--layers 2] [--no-fsdp] [--activation-layouts] [--json results.json] \\
        [--hlo-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks._timing import machine  # noqa: E402

DEVICES = 8
XLA_DEVICES = f"--xla_force_host_platform_device_count={DEVICES}"
TASKS = ("language_model", "classifier", "translator")
MESHES = ("8x1", "1x2", "1x4", "2x4")
STEPS = ("train", "decode", "memory_efficient")
KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
# `--activation-layouts`: layer outputs (`<layer path>/output`, which Keras
# looks up in the layout map after each layer call) pinned to the batch
# split, as data parallelism with FSDP expects, the heads and the
# feed-forward width on the model axis (an experiment: not in the layout map).
ACTIVATION_LAYOUTS = (
    (r".*(layer_norm|final_norm)/output$", ("batch", None, None)),
    (r"_backbone/embedding/output$", ("batch", None, None)),
    (r".*(attention_output|feedforward_output_dense)/output$", ("batch", None, None)),
    (r".*/(query|key|value)/output$", ("batch", None, "model", None)),
    (r".*feedforward_intermediate_dense/output$", ("batch", None, "model")),
)
# Test sizes: heads, feed-forward width and vocabulary divide every mesh.
SIZES = dict(vocabulary=64, sequence=16, dim=32, heads=4, intermediate=64, batch=8)
PROMPT, TOTAL, SOURCE, MAX_TARGET, BEAM = 4, 12, 8, 6, 4


# -- the process -------------------------------------------------------------------


def jax_ready() -> bool:
    """Whether this process runs Keras on JAX with the 8 virtual devices,
    setting it up first when neither Keras nor JAX is imported yet."""
    if "keras" not in sys.modules and "jax" not in sys.modules:
        os.environ["KERAS_BACKEND"] = "jax"
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {XLA_DEVICES}".strip()
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    if keras.backend.backend() != "jax":
        return False
    import jax

    return len(jax.devices("cpu")) >= DEVICES


def reexecute(argv, args) -> dict:
    """Run this script in a fresh process on JAX with 8 devices; its report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    keep = args.json
    if not keep:
        handle, keep = tempfile.mkstemp(suffix=".json")
        os.close(handle)
        argv += ["--json", keep]
    environment = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + XLA_DEVICES).strip(),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH")) if p
        ),
    }
    subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv], env=environment, check=True
    )
    with open(keep) as file:
        report = json.load(file)
    if not args.json:
        os.remove(keep)
    return report


# -- reading the HLO ---------------------------------------------------------------

_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>.+?) "
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
    r"(?P<start>-start)?\((?P<operands>[^)]*)\)"
)
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>.+?) "
    r"(?P<opcode>[a-z][\w\-]*)\((?P<operands>[^)]*)\)"
)
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_CALLS = re.compile(
    r"(?:body|condition|calls|to_apply|true_computation|false_computation)="
    r"%([\w.\-]+)|branch_computations=\{([^}]*)\}"
)
_PASS_THROUGH = {"bitcast", "copy", "reshape", "transpose", "convert", "fusion"}


def _shapes(text):
    """The array shapes of an HLO result type (a tuple gives several)."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(text)
    ]


def _mesh_groups(line):
    """The device groups of a collective, as lists of partition ids."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names = [a for a, _ in axes]
        sizes = [int(s) for _, s in axes]
        chosen = {a.strip().strip("'") for a in mesh.group(2).split(",") if a.strip()}
        ids = list(range(math.prod(sizes)))
        groups = collections.defaultdict(list)
        for i in ids:
            coords, rest = [], i
            for size in reversed(sizes):
                coords.append(rest % size)
                rest //= size
            coords = coords[::-1]
            key = tuple(
                c for c, n in zip(coords, names, strict=True) if n not in chosen
            )
            groups[key].append(i)
        return list(groups.values())
    iota = re.search(
        r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line
    )
    if iota:
        import numpy as np

        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return ids.reshape(count, size).tolist()
    listed = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if listed:
        return [
            [int(i) for i in group.split(",") if i.strip()]
            for group in re.findall(r"\{([\d, ]*)\}", listed.group(1))
        ]
    pairs = re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*)\}", line)
    if pairs:
        return [
            [int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))
        ]
    return None


def _axes(groups, mesh_shape):
    """The mesh axes along which a collective's groups vary."""
    if groups is None:
        return "?"
    model = mesh_shape[1]
    varying = set()
    for group in groups:
        coords = [(i // model, i % model) for i in group]
        if len({c[0] for c in coords}) > 1:
            varying.add("batch")
        if len({c[1] for c in coords}) > 1:
            varying.add("model")
    return "+".join(a for a in ("batch", "model") if a in varying) or "none"


def parse_hlo(text: str) -> dict:
    """Computations, instructions and collectives of a compiled HLO module."""
    computations, current, entry = {}, None, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("{")[0].split("(")[0]:
            current = header.group("name")
            computations[current] = {"lines": [], "calls": set()}
            if header.group("entry"):
                entry = current
            continue
        if current is None or line.strip() == "}":
            continue
        computations[current]["lines"].append(line)
        for called, branches in _CALLS.findall(line):
            names = [called] if called else re.findall(r"%([\w.\-]+)", branches)
            computations[current]["calls"].update(names)
    # Computations run inside a `while` loop (its body and condition, and
    # everything they call).
    looped, frontier = set(), []
    for comp in computations.values():
        for line in comp["lines"]:
            if re.search(r"\swhile\(", line):
                frontier += re.findall(r"(?:body|condition)=%([\w.\-]+)", line)
    while frontier:
        name = frontier.pop()
        if name in looped or name not in computations:
            continue
        looped.add(name)
        frontier += list(computations[name]["calls"])
    return {"computations": computations, "entry": entry, "looped": looped}


def _parameter_of(name, instructions, depth=0):
    """The entry parameter an instruction passes through, if any."""
    found = instructions.get(name)
    if found is None or depth > 8:
        return None
    opcode, operands, line = found
    if opcode == "parameter":
        meta = re.search(r'op_name="([^"]*)"', line)
        return meta.group(1) if meta else line
    if opcode in _PASS_THROUGH and len(operands) == 1:
        return _parameter_of(operands[0], instructions, depth + 1)
    return None


def _op_name(instruction):
    if instruction is None:
        return None
    meta = re.search(r'op_name="([^"]*)"', instruction[2])
    return meta.group(1) if meta else None


def collectives(text: str, mesh_shape) -> list:
    """Every collective of a compiled HLO module, with its computation,
    operands, shapes, mesh axes, op name and (all-gathers) source param."""
    module = parse_hlo(text)
    found = []
    for comp_name, comp in module["computations"].items():
        instructions = {}
        for line in comp["lines"]:
            match = _INSTRUCTION.match(line)
            if match:
                operands = re.findall(r"%([\w.\-]+)", match.group("operands"))
                instructions[match.group("name")] = (
                    match.group("opcode"),
                    operands,
                    line,
                )
        for line in comp["lines"]:
            match = _COLLECTIVE.match(line)
            if not match:
                continue
            operands = re.findall(r"%([\w.\-]+)", match.group("operands"))
            meta = re.search(r'op_name="([^"]*)"', line)
            shapes = _shapes(match.group("shape"))
            if match.group("start") and match.group("kind") == "all-gather":
                shapes = shapes[len(shapes) // 2 :]  # (operands, results)
            found.append(
                {
                    "kind": match.group("kind"),
                    "name": match.group("name"),
                    "computation": comp_name,
                    "in_loop": comp_name in module["looped"],
                    "operands": max(1, len(operands)),
                    "shapes": [list(s) for _, s in shapes],
                    "axes": _axes(_mesh_groups(line), mesh_shape),
                    "op_name": meta.group(1) if meta else "",
                    "operand_op_names": [
                        _op_name(instructions.get(o)) or (meta.group(1) if meta else "")
                        for o in operands
                    ]
                    or [meta.group(1) if meta else ""],
                    "sources": [_parameter_of(o, instructions) for o in operands],
                }
            )
    return found


# -- what each collective is for ---------------------------------------------------

_BLOCK = re.compile(r"/((?:encoder|decoder)_\d+)/")


def block_of(op_name: str):
    match = _BLOCK.search(op_name)
    return match.group(1) if match else None


def category(op: str, kind: str, axes: str, sourced: bool = False) -> str:
    """What a collective (or one operand of a combined one) does, from its
    kind, mesh axes and op name."""
    backward = "transpose(" in op
    if "model" not in axes:
        if kind == "all-gather":
            if sourced:
                return "batch axis: FSDP weight all-gather"
            return "batch axis: activation all-gather"
        if kind == "reduce-scatter":
            return "batch axis: gradient reduce-scatter"
        if not backward and re.search(r"crossentropy|compile_loss|metric", op):
            return "batch axis: loss/metric mean"
        if not backward and re.search(r"_norm/", op):
            return "batch axis: layer-norm statistics over a split d"
        if not backward and re.search(r"/dot_general|einsum", op):
            return "batch axis: partial sums of a dot over a split d"
        return f"batch axis: {kind} ({'backward' if backward else 'forward'})"
    if axes != "model":
        return f"{axes} axes: {kind}"
    if kind == "all-gather" and not sourced and re.search(r"/(reduce|argmax)", op):
        return "sampler: argmax over the sharded vocabulary"
    if kind == "all-gather" and not sourced and "/while/" in op:
        return "sampler: beam top-k over the sharded vocabulary"
    if kind != "all-reduce":
        return f"model axis: {kind}"
    block = block_of(op)
    if block:
        attention = re.search(r"(self_attention|cross_attention)", op)
        if not backward:
            if "attention_output" in op:
                return f"block forward: {attention.group(1)} output"
            if "feedforward_output_dense" in op:
                return "block forward: feed-forward output"
        else:
            inputs = set(re.findall(r"[/(:](query|key|value)/", op))
            if attention and inputs:
                if attention.group(1) == "self_attention":
                    which = "query/key/value"  # the same states
                else:
                    which = "/".join(
                        i for i in ("query", "key", "value") if i in inputs
                    )
                return f"block backward: {attention.group(1)} input ({which})"
            if "feedforward_intermediate_dense" in op:
                return "block backward: feed-forward input"
        return f"block {'backward' if backward else 'forward'}: other"
    if "token_embedding" in op and not backward and re.search(r"gather|take", op):
        return "embedding lookup (vocabulary-sharded table)"
    if "token_embedding" in op and backward and re.search(r"scatter|_take", op):
        return "embedding lookup backward: table gradient"
    if "token_embedding" in op and backward:
        return "tied output projection: input gradient"
    if re.search(r"crossentropy|log_softmax", op):
        return "softmax over the sharded vocabulary (loss or sampler)"
    return "model axis: all-reduce (other)"


def megatron_per_block(block: str, task: str, step: str = "train") -> dict:
    """Megatron's model-axis all-reduces of one block, forward and backward
    (a forward pass or a decoding step: none backward)."""
    cross = task == "translator" and block.startswith("decoder")
    backward = (4 if cross else 2) if step == "train" else 0
    return {"forward": 3 if cross else 2, "backward": backward}


def summarize(
    found: list, task: str, mesh_shape, shapes: dict, params: dict, step="train"
) -> dict:
    """Counts by kind, by category (ops, and operands: a combined all-reduce
    counts once as an op and once per operand, each operand in its own
    category), per block; the all-gathers, each with its verdict."""
    by_kind = {k: {"ops": 0, "operands": 0} for k in KINDS}
    by_category = collections.Counter()
    by_category_operands = collections.Counter()
    blocks = collections.defaultdict(
        lambda: {
            "forward": 0,
            "backward": 0,
            "forward_operands": 0,
            "backward_operands": 0,
            "loop_forward": 0,
            "loop_forward_operands": 0,
        }
    )
    gathers = []
    for c in found:
        by_kind[c["kind"]]["ops"] += 1
        by_kind[c["kind"]]["operands"] += c["operands"]
        sourced = any(  # traced to a variable (not the data)
            source and source.startswith(("state[", "values["))
            for source in c["sources"]
        )
        names = [
            category(op, c["kind"], c["axes"], sourced)
            for op in c["operand_op_names"][: c["operands"]]
        ]
        names += [names[-1]] * (c["operands"] - len(names))
        distinct = sorted(set(names))
        c["operand_categories"] = names
        c["category"] = (
            distinct[0] if len(distinct) == 1 else "combined: " + " + ".join(distinct)
        )
        by_category[c["category"]] += 1
        by_category_operands.update(names)
        counted = set()
        for op, name in zip(c["operand_op_names"], names, strict=False):
            if not name.startswith("block "):
                continue
            phase = "backward" if name.startswith("block backward") else "forward"
            if c["in_loop"]:  # a decoding loop's token step
                phase = "loop_forward"
            entry = blocks[block_of(op)]
            entry[phase + "_operands"] += 1
            if (block_of(op), phase) not in counted:
                counted.add((block_of(op), phase))
                entry[phase] += 1
        if c["kind"] == "all-gather":
            gathers.append(classify_gather(c, mesh_shape, shapes, params))
    for block, entry in blocks.items():
        entry["megatron"] = megatron_per_block(block, task, step)
    return {
        "total_ops": sum(v["ops"] for v in by_kind.values()),
        "total_operands": sum(v["operands"] for v in by_kind.values()),
        "by_kind": by_kind,
        "by_category": dict(sorted(by_category.items())),
        "by_category_operands": dict(sorted(by_category_operands.items())),
        "blocks": dict(sorted(blocks.items())),
        "in_loop": {
            "ops": sum(1 for c in found if c["in_loop"]),
            "by_category": dict(
                collections.Counter(c["category"] for c in found if c["in_loop"])
            ),
        },
        "all_gathers": gathers,
        "kernel_all_gathers": [g for g in gathers if g["verdict"] == KERNEL_IN_FULL],
        "collectives": found,
    }


KERNEL_IN_FULL = "kernel gathered in full"
FSDP_GATHER = "FSDP gather of the batch split: expected"


def classify_gather(c: dict, mesh_shape, shapes: dict, params: dict) -> dict:
    """Whether an all-gather regathers a kernel that is split over the mesh.

    Traced to a step parameter: the variable it reads. Its result against the
    variable's full shape (the kernel gathered whole where a shard was
    enough: flagged, unless the mesh has no model axis and the gather runs
    over the batch axis, which is FSDP's gather), and its model-axis shard
    (the batch split gathered back: FSDP's gather, expected on a batch axis
    of more than 1). Without a source, a result of exactly a split kernel's
    full shape is flagged as a possible kernel; anything else is an
    activation."""
    model = mesh_shape[1]
    result = [tuple(s) for s in c["shapes"]]
    sources = [params.get(s, s) for s in c["sources"] if s]
    verdict, matches = "activation", []

    def shard_of(full, axes):
        return tuple(
            size // model if axis == "model" else size
            for size, axis in zip(full, axes or [None] * len(full), strict=True)
        )

    for path in sources:
        full, axes = shapes.get(path, (None, None))
        if full is None:
            matches.append(f"{path} (not a model variable)")
            verdict = "state other than a model variable"
            continue
        split = axes is not None and any(a is not None for a in axes)
        shard = shard_of(full, axes)
        if any(sorted(r) == sorted(full) for r in result):
            matches.append(f"{path} (full {tuple(full)})")
            if model == 1 and c["axes"] == "batch":
                verdict = FSDP_GATHER
            else:
                verdict = KERNEL_IN_FULL if split else "replicated variable"
        elif any(sorted(r) == sorted(shard) for r in result):
            matches.append(f"{path} (model shard {shard})")
            verdict = FSDP_GATHER if c["axes"] == "batch" else "kernel shard"
        else:
            matches.append(f"{path} (part)")
            verdict = "part of a kernel"
    if not sources:
        for path, (full, axes) in shapes.items():
            split = axes is not None and any(a is not None for a in axes)
            if split and any(r == tuple(full) for r in result) and model > 1:
                matches.append(f"{path}? (full {tuple(full)}, no source)")
                verdict = KERNEL_IN_FULL
    return {
        "name": c["name"],
        "axes": c["axes"],
        "shapes": c["shapes"],
        "in_loop": c["in_loop"],
        "op_name": c["op_name"],
        "sources": sources,
        "matches": matches,
        "verdict": verdict,
    }


# -- the models and the compiled programs ------------------------------------------


def build(task: str, layers: int):
    from keras_attn.models import (
        TextClassifier,
        TransformerLanguageModel,
        TransformerTranslator,
    )

    s = SIZES
    common = dict(
        embedding_dim=s["dim"],
        num_heads=s["heads"],
        intermediate_dim=s["intermediate"],
        dropout=0.0,
    )
    if task == "language_model":
        return TransformerLanguageModel(
            s["vocabulary"], s["sequence"], num_layers=layers, **common
        )
    if task == "classifier":
        return TextClassifier(
            s["vocabulary"], s["sequence"], num_layers=layers, **common
        )
    return TransformerTranslator(
        s["vocabulary"],
        s["vocabulary"],
        sequence_length=s["sequence"],
        num_encoder_layers=layers,
        num_decoder_layers=layers,
        **common,
    )


def model_class(task: str):
    from keras_attn import models

    return {
        "language_model": models.TransformerLanguageModel,
        "classifier": models.TextClassifier,
        "translator": models.TransformerTranslator,
    }[task]


def batch_of(task: str):
    import numpy as np

    rng = np.random.RandomState(0)
    b, t, v = SIZES["batch"], SIZES["sequence"], SIZES["vocabulary"]
    ids = rng.randint(1, v, (b, t)).astype("int32")
    if task == "language_model":
        return ids, np.roll(ids, -1, axis=1)
    if task == "classifier":
        return ids, rng.randint(0, 2, (b, 1)).astype("float32")
    source = rng.randint(1, v, (b, t)).astype("int32")
    return {"encoder_inputs": source, "decoder_inputs": ids}, np.roll(ids, -1, axis=1)


def loss_of(task: str):
    import keras

    if task == "classifier":
        return keras.losses.BinaryCrossentropy()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def parameters(model) -> dict:
    """The compiled programs' parameter names (`state[i][k]` of the train
    step, `values[k]` of the stateless calls) -> variable paths."""
    names = {}
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables if model.optimizer is not None else [],
        model.metrics_variables,
    )
    for i, variables in enumerate(groups):
        for k, variable in enumerate(variables):
            names[f"state[{i}][{k}]"] = variable.path
    for k, variable in enumerate(model.variables):
        names[f"values[{k}]"] = variable.path
    return names


def compile_train_step(model, x, y) -> str:
    """The HLO of the jitted `train_step` that `fit` runs."""
    from keras.src.backend.jax.trainer import _distribute_data

    data = _distribute_data((x, y, None))
    model._symbolic_build(data_batch=data)
    model.make_train_function(force=True)
    closure = [cell.cell_contents for cell in model.train_function.__closure__ or ()]
    jitted = [fn for fn in closure if hasattr(fn, "lower")]
    if len(jitted) != 1:
        raise RuntimeError(
            "Keras's train function no longer closes over one jitted train_step"
        )
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    return jitted[0].lower(state, data).compile().as_text()


def compile_reading_weights(model, fn, *args) -> str:
    """`translator._jit_reading_weights(model, fn)`'s compiled HLO: the
    weights are arguments (with their shardings), mapped onto the variables
    by a `keras.StatelessScope`."""
    import jax
    import keras

    variables = list(model.variables)

    def stateless(values, *inputs):
        with keras.StatelessScope(
            state_mapping=list(zip(variables, values, strict=True))
        ):
            return fn(*inputs)

    values = [variable.value for variable in variables]
    return jax.jit(stateless).lower(values, *args).compile().as_text()


def compile_decoding(task: str, model) -> str:
    import numpy as np
    from keras.src.backend.jax.trainer import _distribute_data

    rng = np.random.RandomState(1)
    b, v = SIZES["batch"], SIZES["vocabulary"]
    if task == "language_model":
        prompt = _distribute_data(rng.randint(4, v, (b, PROMPT)).astype("int32"))
        return compile_reading_weights(
            model, lambda p: model.generate_ids(p, TOTAL, end_token_id=None), prompt
        )
    source = _distribute_data(rng.randint(4, v, (b, SOURCE)).astype("int32"))
    decode = model.decoding_fn(MAX_TARGET, beam_width=BEAM)
    return compile_reading_weights(model, decode, source)


def compile_memory_efficient(model, x) -> tuple:
    """A forward pass with every attention on the memory-efficient path, and
    how many attention calls took it while tracing.

    Every layer with a `flash_attention` attribute (keras-attn's attention
    layers read it at call) gets `True` for the trace: on a CPU, where no
    fused kernel runs, that is the memory-efficient path at any length.
    (`keras.config.enable_flash_attention()` would not do: in Keras 3.15 it
    restores the default, `None`, which takes the path from 1024 keys.)"""
    import importlib

    from keras.src.backend.jax.trainer import _distribute_data

    attention_ops = importlib.import_module("keras_attn.ops.attention")
    calls = []
    original = attention_ops.memory_efficient_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    layers = [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if hasattr(layer, "flash_attention")
    ]
    saved = [layer.flash_attention for layer in layers]
    attention_ops.memory_efficient_attention = counted
    for layer in layers:
        layer.flash_attention = True
    try:
        data = _distribute_data(x)
        hlo = compile_reading_weights(model, lambda d: model(d, training=False), data)
    finally:
        attention_ops.memory_efficient_attention = original
        for layer, value in zip(layers, saved, strict=True):
            layer.flash_attention = value
    return hlo, len(calls)


def attention_layers(task: str, layers: int) -> int:
    return {"language_model": layers, "classifier": layers, "translator": 3 * layers}[
        task
    ]


def run_case(task: str, mesh_text: str, args) -> dict:
    import keras

    shape = tuple(int(n) for n in mesh_text.split("x"))
    devices = keras.distribution.list_devices()[: math.prod(shape)]
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices=devices)
    cls = model_class(task)
    layout_map = cls.get_layout_map(mesh, fsdp=not args.no_fsdp)
    if args.activation_layouts:
        for pattern, axes in ACTIVATION_LAYOUTS:
            layout_map[pattern] = axes
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    keras.distribution.set_distribution(distribution)
    try:
        keras.utils.set_random_seed(0)
        model = build(task, args.layers)
        from keras_attn.models.layouts import check_layout_map

        check_layout_map(model, layout_map)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_of(task))
        shapes = {
            w.path: (
                list(w.shape),
                None if layout_map[w.path] is None else list(layout_map[w.path].axes),
            )
            for w in model.weights
        }
        x, y = batch_of(task)
        results = {}
        programs = {}
        if "train" in args.steps:
            programs["train"] = lambda: (compile_train_step(model, x, y), None)
        if "decode" in args.steps and task != "classifier":
            programs["decode"] = lambda: (compile_decoding(task, model), None)
        if "memory_efficient" in args.steps:
            programs["memory_efficient"] = lambda: compile_memory_efficient(model, x)
        for step, compile_fn in programs.items():
            began = time.perf_counter()
            hlo, path_calls = compile_fn()
            if args.hlo_dir:
                os.makedirs(args.hlo_dir, exist_ok=True)
                name = f"{task}_{mesh_text}_{step}.hlo.txt"
                with open(os.path.join(args.hlo_dir, name), "w") as file:
                    file.write(hlo)
            summary = summarize(
                collectives(hlo, shape), task, shape, shapes, parameters(model), step
            )
            summary["compile_seconds"] = time.perf_counter() - began
            if path_calls is not None:
                summary["memory_efficient_calls"] = path_calls
                summary["attention_layers"] = attention_layers(task, args.layers)
            results[step] = summary
            print(
                f"{task} {mesh_text} {step}: {summary['total_ops']} collectives "
                f"({summary['compile_seconds']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        keras.distribution.set_distribution(None)
    return {"task": task, "mesh": mesh_text, "shape": list(shape), "steps": results}


# -- the report --------------------------------------------------------------------


def _kinds(summary) -> str:
    short = {
        "all-reduce": "AR",
        "all-gather": "AG",
        "reduce-scatter": "RS",
        "collective-permute": "CP",
        "all-to-all": "A2A",
    }
    parts = []
    for kind, counts in summary["by_kind"].items():
        if counts["ops"]:
            extra = (
                f" ({counts['operands']} operands)"
                if counts["operands"] != counts["ops"]
                else ""
            )
            parts.append(f"{counts['ops']} {short[kind]}{extra}")
    return ", ".join(parts) or "none"


def _blocks(summary) -> str:
    """Model-axis all-reduces per block, grouped: `n x fwd+bwd [tensors]
    (Megatron)`, and in a decoding loop `token step fwd`."""
    groups = collections.Counter()
    for entry in summary["blocks"].values():
        m = entry["megatron"]
        if entry["loop_forward"]:
            extra = (
                f" [{entry['loop_forward_operands']}]"
                if entry["loop_forward_operands"] != entry["loop_forward"]
                else ""
            )
            groups[
                f"token step {entry['loop_forward']}{extra} (Megatron {m['forward']})"
            ] += 1
        if entry["forward"] or entry["backward"]:
            where = "prefill " if entry["loop_forward"] else ""
            ops = f"{entry['forward']}+{entry['backward']}"
            tensors = f"{entry['forward_operands']}+{entry['backward_operands']}"
            extra = f" [{tensors}]" if tensors != ops else ""
            groups[
                f"{where}{ops}{extra} (Megatron {m['forward']}+{m['backward']})"
            ] += 1
    return "; ".join(f"{n}x {text}" for text, n in groups.items()) or "-"


def table(cases: list) -> str:
    lines = [
        "| task | mesh | step | collectives per step | model-axis all-reduces "
        "per block, fwd+bwd ops | kernel all-gathers (in full) | FSDP gathers |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        for step, s in case["steps"].items():
            fsdp = sum(1 for g in s["all_gathers"] if g["verdict"].startswith("FSDP"))
            loop = f"; {s['in_loop']['ops']} in the loop" if step == "decode" else ""
            lines.append(
                f"| {case['task']} | {case['mesh']} | {step} | {_kinds(s)}{loop} | "
                f"{_blocks(s)} | {len(s['kernel_all_gathers'])} | {fsdp} |"
            )
    lines.append("")
    lines.append(
        "Breakdown by category: all-reduced / gathered tensors (a combined op "
        "counts each operand in its own category), then the combined ops:"
    )
    for case in cases:
        for step, s in case["steps"].items():
            parts = [f"{name}: {n}" for name, n in s["by_category_operands"].items()]
            combined = [c for c in s["collectives"] if c["operands"] > 1]
            tail = (
                f" ({len(combined)} combined ops carry "
                f"{sum(c['operands'] for c in combined)} of them)"
                if combined
                else ""
            )
            lines.append(
                f"- {case['task']} {case['mesh']} {step}: " + "; ".join(parts) + tail
            )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--meshes", nargs="+", default=list(MESHES))
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--layers", type=int, default=2, help="blocks per stack")
    parser.add_argument(
        "--activation-layouts",
        action="store_true",
        help="also pin the layers' outputs to the batch split (an experiment)",
    )
    parser.add_argument(
        "--no-fsdp",
        action="store_true",
        help="get_layout_map(mesh, fsdp=False): kernels replicated over the batch "
        "axis (what make_distribution('data:D,model:M') sets)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--hlo-dir", help="also write every compiled HLO module here")
    args = parser.parse_args(argv)
    for text in args.meshes:
        if not re.fullmatch(r"\d+x\d+", text):
            parser.error(f"a mesh is BATCHxMODEL, e.g. 2x4. Received: {text!r}")
        batch, model = (int(n) for n in text.split("x"))
        if batch * model > DEVICES or SIZES["batch"] % batch:
            parser.error(
                f"a mesh needs at most {DEVICES} devices and a batch axis that "
                f"divides the batch of {SIZES['batch']}. Received: {text!r}"
            )
        if SIZES["heads"] % model or SIZES["vocabulary"] % model:
            parser.error(f"the model axis must divide 4 heads. Received: {text!r}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not jax_ready():
        return reexecute(argv, args)
    import jax
    import keras

    info = machine()
    versions = {"keras": keras.__version__, "jax": jax.__version__}
    print(
        f"{info['cpu']}, {info['cpus']} CPUs, avx512_bf16 {info['avx512_bf16']}, "
        f"amx_bf16 {info['amx_bf16']}; keras {versions['keras']}, jax "
        f"{versions['jax']}, {len(jax.devices())} virtual CPU devices",
        flush=True,
    )
    began = time.perf_counter()
    cases = [run_case(task, mesh, args) for task in args.tasks for mesh in args.meshes]
    report = {
        "machine": info,
        "versions": versions,
        "config": {
            "tasks": args.tasks,
            "meshes": args.meshes,
            "steps": args.steps,
            "layers": args.layers,
            "activation_layouts": args.activation_layouts,
            "fsdp": not args.no_fsdp,
            "sizes": SIZES,
            "decode": {
                "prompt": PROMPT,
                "total": TOTAL,
                "source": SOURCE,
                "max_target": MAX_TARGET,
                "beam": BEAM,
            },
        },
        "seconds": time.perf_counter() - began,
        "results": cases,
    }
    print()
    print(table(cases))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    return report


if __name__ == "__main__":
    main()
