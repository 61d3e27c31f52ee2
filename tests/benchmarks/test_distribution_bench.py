"""benchmarks/distribution_bench.py on the `1x4` mesh (pure model
parallelism; the bench runs itself in a fresh process on JAX with 8 virtual
CPU devices): the compiled train step, decoding and memory-efficient forward
of every task all-gather no kernel, every block all-reduces at least
Megatron's count, and the counts add up to the breakdown the bench reports.
The HLO reader is also checked on a hand-written module. Nothing is timed."""

import json

import pytest

from benchmarks import distribution_bench as bench

# What a pure model-parallel mesh may all-reduce or gather outside the
# blocks: the vocabulary-sharded table and its softmax, nothing else.
EXPECTED_EXTRAS = {
    "embedding lookup (vocabulary-sharded table)",
    "tied output projection: input gradient",
    "softmax over the sharded vocabulary (loss or sampler)",
    "sampler: argmax over the sharded vocabulary",
    "sampler: beam top-k over the sharded vocabulary",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("distribution_bench") / "results.json"
    returned = bench.main(["--meshes", "1x4", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["results"] == json.loads(json.dumps(returned["results"]))
    return written


def cases(report):
    return {(case["task"], case["mesh"]): case for case in report["results"]}


@pytest.mark.slow  # the bench's own run on 8 virtual devices
def test_every_task_and_step_compiled(report):
    found = cases(report)
    assert set(found) == {(task, "1x4") for task in bench.TASKS}
    for (task, _), case in found.items():
        expected = {"train", "memory_efficient"} | (
            set() if task == "classifier" else {"decode"}
        )
        assert set(case["steps"]) == expected
        assert case["shape"] == [1, 4]


@pytest.mark.slow  # the bench's own run on 8 virtual devices
def test_no_kernel_is_all_gathered(report):
    """Under (1, 4) no all-gather reads a model variable, and none has the
    full shape of a split kernel (in any order of its axes)."""
    for (task, _), case in cases(report).items():
        kernels = [
            sorted(case_shape)
            for case_shape in _split_kernel_shapes(task, report["config"]["layers"])
        ]
        for step, summary in case["steps"].items():
            assert summary["kernel_all_gathers"] == [], (task, step)
            for gather in summary["all_gathers"]:
                assert gather["sources"] == [], (task, step, gather)
                for shape in gather["shapes"]:
                    assert sorted(shape) not in kernels, (task, step, gather)
                assert gather["verdict"] == "activation", (task, step, gather)


def _split_kernel_shapes(task, layers):
    """The full shapes of the kernels the layout splits, at the bench's size."""
    s = bench.SIZES
    d, heads, ff, vocab = s["dim"], s["heads"], s["intermediate"], s["vocabulary"]
    return [
        (d, heads, d // heads),  # query, key, value
        (heads, d // heads, d),  # attention output
        (d, ff),
        (ff, d),
        (vocab, d),  # token embedding
    ]


@pytest.mark.slow  # the bench's own run on 8 virtual devices
def test_train_step_all_reduces_at_least_megatron_per_block(report):
    for (task, _), case in cases(report).items():
        summary = case["steps"]["train"]
        blocks = summary["blocks"]
        expected_blocks = (
            {f"encoder_{i}" for i in range(2)} | {f"decoder_{i}" for i in range(2)}
            if task == "translator"
            else {
                f"{'decoder' if task == 'language_model' else 'encoder'}_{i}"
                for i in range(2)
            }
        )
        assert set(blocks) == expected_blocks, task
        for name, entry in blocks.items():
            megatron = entry["megatron"]
            assert megatron == bench.megatron_per_block(name, task, "train")
            assert entry["forward"] >= megatron["forward"], (task, name, entry)
            assert entry["forward_operands"] >= megatron["forward"], (task, name)
            assert entry["backward_operands"] >= megatron["backward"], (task, name)
            assert entry["backward"] >= 1, (task, name, entry)
        # The language model's blocks: exactly Megatron's two forward
        # all-reduces; backward two ops, the attention's combining q, k, v.
        if task == "language_model":
            for entry in blocks.values():
                assert (entry["forward"], entry["backward"]) == (2, 2)


@pytest.mark.slow  # the bench's own run on 8 virtual devices
def test_counts_match_the_breakdown(report):
    for (task, _), case in cases(report).items():
        for step, s in case["steps"].items():
            kinds = s["by_kind"]
            assert s["total_ops"] == sum(v["ops"] for v in kinds.values())
            assert s["total_operands"] == sum(v["operands"] for v in kinds.values())
            assert s["total_ops"] == len(s["collectives"]) > 0
            assert sum(s["by_category"].values()) == s["total_ops"], (task, step)
            assert sum(s["by_category_operands"].values()) == s["total_operands"]
            # Blocks and the named extras account for every all-reduced tensor.
            in_blocks = sum(
                e["forward_operands"]
                + e["backward_operands"]
                + e["loop_forward_operands"]
                for e in s["blocks"].values()
            )
            extras = {
                name: n
                for name, n in s["by_category_operands"].items()
                if not name.startswith("block ")
            }
            assert set(extras) <= EXPECTED_EXTRAS, (task, step, extras)
            assert not any(n.endswith(": other") for n in s["by_category_operands"])
            assert in_blocks + sum(extras.values()) == s["total_operands"]
            # Pure model parallelism: every collective runs on the model axis.
            assert {c["axes"] for c in s["collectives"]} == {"model"}, (task, step)
            assert set(s["by_kind"]) == set(bench.KINDS)


@pytest.mark.slow  # the bench's own run on 8 virtual devices
def test_vocabulary_extras_of_the_language_model(report):
    """The sharded vocabulary costs an all-reduce for the lookup, one for the
    tied projection's input gradient, and the softmax's (max, sum, target
    logit and its gradient) in the train step."""
    s = cases(report)[("language_model", "1x4")]["steps"]["train"]
    operands = s["by_category_operands"]
    assert operands["embedding lookup (vocabulary-sharded table)"] == 1
    assert operands["tied output projection: input gradient"] == 1
    assert operands["softmax over the sharded vocabulary (loss or sampler)"] >= 3


@pytest.mark.slow  # the bench's own run on 8 virtual devices
def test_decoding_token_step(report):
    """Inside the decoding loop each block all-reduces Megatron's forward
    count; greedy decoding's argmax gathers one value and index per shard."""
    found = cases(report)
    for task in ("language_model", "translator"):
        s = found[(task, "1x4")]["steps"]["decode"]
        assert s["in_loop"]["ops"] > 0
        decoders = {k: e for k, e in s["blocks"].items() if k.startswith("decoder")}
        assert decoders, task
        for name, entry in decoders.items():
            assert entry["loop_forward"] == entry["megatron"]["forward"], (task, name)
            assert entry["megatron"]["backward"] == 0
    lm = found[("language_model", "1x4")]["steps"]["decode"]
    gathers = lm["by_category_operands"]["sampler: argmax over the sharded vocabulary"]
    assert gathers == 2
    assert all(g["in_loop"] for g in lm["all_gathers"])


@pytest.mark.slow  # the bench's own run on 8 virtual devices
def test_memory_efficient_path_taken(report):
    for (task, _), case in cases(report).items():
        s = case["steps"]["memory_efficient"]
        assert s["memory_efficient_calls"] == s["attention_layers"] > 0, task
        assert s["by_kind"]["all-gather"]["ops"] == 0, task
        for name, entry in s["blocks"].items():
            assert entry["forward"] == entry["megatron"]["forward"], (task, name)
            assert entry["backward"] == 0


# -- the HLO reader, on a hand-written module (no JAX) -----------------------------

HLO = "\n".join(
    [
        "HloModule m",
        "",
        "%add (x: f32[], y: f32[]) -> f32[] {",
        "  %x = f32[] parameter(0)",
        "  %y = f32[] parameter(1)",
        "  ROOT %a = f32[] add(%x, %y)",
        "}",
        "",
        "%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {",
        "  %p = (s32[], f32[4,8]{1,0}) parameter(0)",
        "  %g = f32[4,8]{1,0} get-tuple-element(%p), index=1",
        "  %ar.loop = f32[4,8]{1,0} all-reduce(%g), channel_id=3, "
        "replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="
        '"jit(f)/while/body/decoder_0/feedforward_output_dense/dot_general"}',
        "  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %ar.loop)",
        "}",
        "",
        "ENTRY %main (k: f32[8,2,4]) -> f32[8,8] {",
        "  %k = f32[8,2,4]{2,1,0} parameter(0), sharding={devices=[1,4,1]<=[4]}, "
        'metadata={op_name="state[0][3]"}',
        "  %b = f32[8,2,4]{2,1,0} bitcast(%k)",
        "  %ag = f32[8,8,4]{2,1,0} all-gather(%b), channel_id=1, "
        "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}, "
        'metadata={op_name="jit(f)/decoder_0/self_attention/query/dot_general"}',
        "  %u = f32[4,8]{1,0} negate(%x)",
        '  %v = f32[4,8]{1,0} negate(%x), metadata={op_name="jit(f)/transpose(jvp(m))'
        '/decoder_0/feedforward_intermediate_dense/dot_general"}',
        "  %ar = (f32[4,8]{1,0}, f32[4,8]{1,0}) all-reduce(%u, %v), channel_id=2, "
        "replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add, "
        'metadata={op_name="jit(f)/decoder_0/(a:b)"}',
        "  %s = f32[4,8]{1,0} all-reduce-start(%u), channel_id=4, "
        "replica_groups=[2,4]<=[8], to_apply=%add",
        "  %d = f32[4,8]{1,0} all-reduce-done(%s)",
        "  %w = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body",
        "  ROOT %r = f32[8,8]{1,0} copy(%d)",
        "}",
    ]
)


def test_hlo_reader():
    found = bench.collectives(HLO, (2, 4))
    by_name = {c["name"]: c for c in found}
    assert set(by_name) == {"ag", "ar", "ar.loop", "s"}  # the -done not counted
    assert by_name["ar.loop"]["in_loop"] and not by_name["ar"]["in_loop"]
    assert by_name["ar.loop"]["axes"] == "model"  # [2,4]<=[8]: rows of the mesh
    assert by_name["ag"]["axes"] == "model"
    assert by_name["ar"]["axes"] == "batch"  # columns
    assert by_name["ar"]["operands"] == 2
    assert by_name["ag"]["sources"] == ["state[0][3]"]
    assert by_name["ag"]["shapes"] == [[8, 8, 4]]
    shapes = {"blocks/query/kernel": ([8, 8, 4], ["batch", "model", None])}
    gather = bench.classify_gather(
        by_name["ag"], (2, 4), shapes, {"state[0][3]": "blocks/query/kernel"}
    )
    assert gather["verdict"] == bench.KERNEL_IN_FULL
    summary = bench.summarize(found, "language_model", (2, 4), shapes, {}, "train")
    assert summary["total_ops"] == 4 and summary["total_operands"] == 5
    assert summary["blocks"]["decoder_0"]["loop_forward"] == 1
    assert sum(summary["by_category_operands"].values()) == 5
