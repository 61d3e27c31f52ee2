"""benchmarks/gqa_decoding_bench.py end to end at tiny sizes (`--quick`):
the KV-cache bytes of grouped-query attention are exactly `kv_heads / heads`
of multi-head attention's, the figures are positive, and each variant's
compiled decoding steps really went through its own cache. Speed is not
asserted."""

import json
import math
from fractions import Fraction

import pytest

pytestmark = pytest.mark.tf_only  # tf.function with a fixed input signature


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from benchmarks import gqa_decoding_bench

    out = tmp_path_factory.mktemp("gqa_decoding_bench") / "results.json"
    returned = gqa_decoding_bench.main(["--quick", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["results"] == json.loads(json.dumps(returned["results"]))
    return written


def test_quick_sizes(report):
    config = report["config"]
    assert report["backend"] == "tensorflow"
    assert config["quick"] and config["xla"]
    assert (config["heads"], config["kv_heads"]) == (4, 2)
    assert [r["context"] for r in report["results"]] == config["contexts"]


def test_cache_bytes_ratio_is_exactly_kv_heads_over_heads(report):
    config = report["config"]
    expected = Fraction(config["kv_heads"], config["heads"])
    for r in report["results"]:
        mha, gqa = r["MHA"]["cache_bytes"], r["GQA"]["cache_bytes"]
        assert Fraction(gqa, mha) == expected
        assert r["bytes_ratio"] == float(expected)
        assert r["bytes_ratio_exact"] == f"{expected.numerator}/{expected.denominator}"
        # Keys and values of every block, float32, (batch, context, heads, head_dim).
        per_head = 2 * config["layers"] * config["batch"] * r["context"] * 4
        assert mha == per_head * config["heads"] * config["head_dim"]
        assert gqa == per_head * config["kv_heads"] * config["head_dim"]


def test_tokens_per_second_positive(report):
    for r in report["results"]:
        for variant in ("MHA", "GQA"):
            row = r[variant]
            assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
            assert row["tokens_per_s"] == pytest.approx(
                report["config"]["batch"]
                * report["config"]["steps"]
                / row["seconds_per_call"]
            )
            assert len(row["seconds_per_round"]) == report["config"]["rounds"]
            assert row["best_tokens_per_s"] >= row["tokens_per_s"]
        assert r["speed_ratio"] == pytest.approx(
            r["GQA"]["tokens_per_s"] / r["MHA"]["tokens_per_s"]
        )


def test_each_variant_decoded_through_its_own_cache(report):
    config = report["config"]
    heads = {"MHA": config["heads"], "GQA": config["kv_heads"]}
    for r in report["results"]:
        assert r["start_index"] == r["context"] - config["steps"]
        for variant, count in heads.items():
            row = r[variant]
            # The cache the compiled steps returned: the variant's heads.
            assert row["key_value_heads"] == count
            assert row["key_cache_shape"] == [
                config["batch"],
                r["context"],
                count,
                config["head_dim"],
            ]
            assert row["cache_tensors"] == 2 * config["layers"]
            assert row["cache_bytes"] == row["input_cache_bytes"]
            # The steps wrote their keys and values there, and only there.
            assert row["written_positions_changed"]
            assert row["other_positions_kept"]
            assert row["output_finite"]
            # Compiled once per variant and context.
            assert row["tracing_count"] == 1
