"""benchmarks/gpu_check.py end to end at tiny sizes on a CPU, as it runs on a
GPU machine: the JAX backend, TensorFlow unimportable, the data folder that
benchmarks/gpu_check_bundle.py prepares (here from the small fixture pairs)."""

import importlib.util
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.test_case import BLOCK_TENSORFLOW, REPO_ROOT


@pytest.mark.large  # 80 s; run it before a session's GPU check
def test_tiny_run_on_jax_without_tensorflow(tmp_path):
    bundle = tmp_path / "bundle"
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "benchmarks", "gpu_check_bundle.py"),
            "--out",
            str(bundle),
            "--skip-wheels",
            "--data-file",
            os.path.join(REPO_ROOT, "tests", "fixtures", "de_en_pairs.tsv"),
            "--vocabulary-size",
            "400",
        ],
        check=True,
        capture_output=True,
        cwd=REPO_ROOT,
    )
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    assert manifest["data"]["test"] > 0
    assert (bundle / "data" / "en_de.model").exists()

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_TENSORFLOW)
    out = tmp_path / "gpu_check.json"
    environment = dict(
        os.environ,
        KERAS_BACKEND="jax",
        PYTHONPATH=os.pathsep.join([str(site), REPO_ROOT]),
    )
    completed = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "benchmarks", "gpu_check.py"),
            "--tiny",
            "--long-lengths",
            "32,48",
            "--data",
            str(bundle / "data"),
            "--out",
            str(out),
        ],
        env=environment,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    report = json.loads(out.read_text())
    assert completed.returncode == 0, (report.get("problems"), completed.stderr[-3000:])
    assert report["problems"] == []
    assert report["errors"] == {}
    assert report["versions"]["platform"] == "cpu"
    # Every JAX part ran; the PyTorch part where PyTorch is installed (make
    # test-backends installs it), on the CPU here.
    for part in ("long", "float32", "numerics", "paths", "speed", "training", "costs"):
        assert report[part], part
    if importlib.util.find_spec("torch") is None:
        assert report["skipped"] == ["torch: PyTorch is not installed"]
    else:
        assert report["skipped"] == []
        assert report["torch"]["layers"] and report["torch"]["op"]

    # The long part: every path, dtype, length and padding measured; no
    # cuDNN lengths kernel on a CPU.
    long_rows = report["long"]
    assert {
        (row["path"], row["dtype"], row["length"], row["padded"]) for row in long_rows
    } == {
        (path, dtype, length, padded)
        for path in ("keras_attn", "explicit", "keras_dot_product_attention")
        for dtype in ("bfloat16", "float32")
        for length in (32, 48)  # --long-lengths
        for padded in (False, True)
    }
    assert all(row["ms"] > 0 and row["temp_bytes"] > 0 for row in long_rows)
    assert all(not row["cudnn_fused"] for row in long_rows)
    assert {row["lengths_kernel"] for row in long_rows if "lengths_kernel" in row} == {
        None
    }

    # The float32 part: every candidate ran (Pallas's kernel interpreted on
    # the CPU) and agrees with the float64-accurate explicit path.
    float32_rows = report["float32"]
    assert {row["variant"] for row in float32_rows} >= {
        "explicit",
        "explicit padded",
        "explicit causal",
        "keras_attn",
        "keras_attn padded",
        "keras_attn causal",
        "memory_efficient",
        "memory_efficient q1024 kall",
        "pallas b128",
    }
    for row in float32_rows:
        assert row["finite"] and row["ms"] > 0, row
        assert max(row["max_difference"].values()) < 1e-5, row

    numerics = [row for row in report["numerics"] if "asked" in row]
    assert {row["policy"] for row in numerics} == {
        "float32",
        "mixed_float16",
        "mixed_bfloat16",
    }
    # Without a GPU no cuDNN kernel runs; flash_attention=True takes the
    # memory-efficient op, False the explicit path.
    assert {row["took"] for row in numerics if row["asked"] == "explicit"} == {
        "explicit_or_xla"
    }
    assert {
        row["took"] for row in numerics if row["asked"] == "fused_or_memory_efficient"
    } == {"memory_efficient"}
    assert all(row["empty_rows_zero"] and row["finite"] for row in numerics)
    assert any(row["empty_rows"] for row in numerics)
    # float32 rows run at the reference's matmul precision (not TF32 on a GPU).
    assert all(
        row["matmul_precision"] == "highest"
        for row in numerics
        if row["policy"] == "float32"
    )
    # Gradient differences are reported per variable of the layer, as shares of
    # the largest gradient of any variable.
    gradient_rows = [row for row in report["numerics"] if "gradients" in row]
    assert {(row["case"], row["policy"]) for row in gradient_rows} == {
        (case, policy)
        for case in ("padding", "causal")
        for policy in ("float32", "mixed_float16", "mixed_bfloat16")
    }
    for row in gradient_rows:
        assert set(row["per_variable"]) == {
            f"{name}/{kind}"
            for name in ("query", "key", "value", "attention_output")
            for kind in ("kernel", "bias")
        }
        assert row["max_relative_difference"] == max(row["per_variable"].values())
        assert row["worst_variable"] in row["per_variable"]

    training = report["training"]
    assert training["policy"] == "mixed_float16"
    assert training["optimizer"] == "LossScaleOptimizer"
    assert training["loss_finite"]
    assert training["steps"] > 0 and training["target_tokens_per_second"] > 0
    assert training["test_sentences"] == manifest["data"]["test"]
    assert 0.0 <= training["test_bleu"] <= 100.0
    assert len(training["examples"]) > 0

    assert report["speed"][0]["keras_attn_ms"] > 0
    assert report["speed"][0]["keras_hub_ms"] > 0


@pytest.mark.parametrize(
    "call_kwargs",
    [
        {"value_mask": np.array([[True] * 7, [True] * 3 + [False] * 4, [False] * 7])},
        {"use_causal_mask": True},
        {"attention_mask": np.tri(5, 7, dtype=bool)[None].repeat(3, axis=0)},
    ],
    ids=["padding", "causal", "explicit_mask"],
)
def test_the_same_inputs_reference_is_the_float32_layer(call_kwargs):
    # The large-logits reference: float64 attention of the layer's own
    # projections. For a float32 layer it must be the layer's output, with
    # rows that attend to no key exactly zero.
    from benchmarks import gpu_check
    from keras_attn.layers import MultiHeadAttention

    rng = np.random.default_rng(0)
    query = rng.normal(size=(3, 5, 16)).astype("float32")
    value = rng.normal(size=(3, 7, 16)).astype("float32")
    if call_kwargs.get("use_causal_mask"):
        value = value[:, :5]
    layer = MultiHeadAttention(num_heads=2, key_dim=4, flash_attention=False)
    expected = keras.ops.convert_to_numpy(layer(query, value, **call_kwargs))
    reference = gpu_check.same_inputs_reference(layer, query, value, call_kwargs)
    np.testing.assert_allclose(reference, expected, rtol=1e-5, atol=1e-5)
    if "value_mask" in call_kwargs:
        assert (reference[2] == 0).all()


def test_a_path_may_be_as_far_from_the_same_inputs_reference_as_the_explicit_path():
    from benchmarks import gpu_check

    reference = np.zeros((1, 2, 4))
    outputs = {
        "explicit": reference + 0.5,  # Keras's numerics: the bound
        "auto": reference + 0.1,
        "fused_or_memory_efficient": reference + 0.6,
    }
    rows = [
        {
            "case": "large_logits",
            "policy": "mixed_bfloat16",
            "asked": path,
            "max_error_vs_float32": 0.9,
            "tolerance": 0.03,
            "finite": True,
        }
        for path in outputs
    ]
    gpu_check.compare_with_same_inputs(
        rows, "large_logits", "mixed_bfloat16", outputs, reference, scale=1.0
    )
    explicit, auto, fused = rows
    assert fused["tolerance"] == pytest.approx(0.5)
    assert "max_error_vs_same_inputs" not in explicit
    assert explicit["error_vs_same_inputs_not_checked"] == pytest.approx(0.5)
    assert auto["max_error_vs_same_inputs"] == pytest.approx(0.1)
    assert auto["tolerance"] == pytest.approx(0.5)
    found = gpu_check.problems({"errors": {}, "numerics": rows})
    assert found == [
        "difference 6.00e-01 > 0.5: large_logits mixed_bfloat16 "
        "fused_or_memory_efficient None"
    ]


def test_a_square_temporary_on_the_long_padded_path_is_a_problem():
    from benchmarks import gpu_check

    def row(path, temp_bytes, **extra):
        return {
            "dtype": "bfloat16",
            "length": 16384,
            "padded": True,
            "path": path,
            "temp_bytes": temp_bytes,
            **extra,
        }

    rows = [
        row("keras_attn", 2**20),
        row("keras_attn", None, error="XlaRuntimeError: RESOURCE_EXHAUSTED"),
        row("explicit", None, error="XlaRuntimeError: RESOURCE_EXHAUSTED"),
        row("keras_attn", 2**30, problem="(T, T)-sized tensors in the program"),
    ]
    found = gpu_check.problems({"errors": {}, "long": rows})
    assert found == [
        "long keras_attn bfloat16 16384 padded=True: XlaRuntimeError: "
        "RESOURCE_EXHAUSTED",
        "long keras_attn bfloat16 16384 padded=True: (T, T)-sized tensors in the "
        "program",
    ]
    # The explicit path and Keras's op are skipped where their (B, N, T, T)
    # float32 tensors cannot fit; keras-attn's path is always measured.
    shape = (2, 65536, 8, 64)
    assert not gpu_check.long_fits("explicit", shape, "bfloat16", 140 * 2**30)
    assert gpu_check.long_fits("explicit", (2, 4096, 8, 64), "bfloat16", 140 * 2**30)
    assert gpu_check.long_fits("keras_attn", shape, "bfloat16", 140 * 2**30)


@pytest.mark.parametrize("value", ["", "4096,x", "0,16"])
def test_long_lengths_must_be_positive_integers(value, capsys):
    from benchmarks import gpu_check

    with pytest.raises(SystemExit):
        gpu_check.main(["--long-lengths", value])
    error = capsys.readouterr().err
    assert "--long-lengths must be positive integers" in error
    assert f"Received: {value!r}" in error


def test_square_shapes_finds_the_tensors_that_grow_as_the_square_of_the_length():
    import jax
    import jax.numpy as jnp

    from benchmarks import gpu_check

    heads = jax.ShapeDtypeStruct((2, 48, 4), "float32")

    def scores(q):
        return jnp.einsum("btf,bsf->bts", q, q).max(axis=-1)

    def rows(q):
        return (q * q).sum(axis=-1)

    square = jax.jit(scores).lower(heads).compile().as_text()
    assert gpu_check.square_shapes(square, 48) == ["f32[2,48,48]"]
    linear = jax.jit(rows).lower(heads).compile().as_text()
    assert gpu_check.square_shapes(linear, 48) == []
    assert gpu_check.square_shapes("%m = pred[2,1,48,48]{3,2,1,0} and", 48) == [
        "pred[2,1,48,48]"
    ]


def test_the_automatic_float32_path_is_accurate_and_runs_pallas():
    from benchmarks import gpu_check

    def row(variant, masks, difference, triton=False):
        return {
            "length": 4096,
            "variant": variant,
            "masks": masks,
            "ms": 1.0,
            "finite": True,
            "triton": triton,
            "max_difference": {"outputs": difference, "d_query": difference / 2},
        }

    rows = [
        row("explicit", "none", 1e-3),
        row("keras_attn", "none", 1.5e-3, triton=True),  # within 2x
        row("explicit padded", "padded", 1e-3),
        row("keras_attn padded", "padded", 3e-3, triton=True),  # beyond
        row("explicit causal", "causal", 1e-3),
        row("keras_attn causal", "causal", 1e-3),  # no Triton kernel
        dict(row("pallas b64", "none", 0.0), error="refused", finite=True),
    ]
    for platform, expected in (
        ("cpu", ["float32 keras_attn padded 4096: differs by 3.00e-03 > 2.00e-03"]),
        (
            "gpu",
            [
                "float32 keras_attn padded 4096: differs by 3.00e-03 > 2.00e-03",
                "float32 keras_attn causal 4096: Pallas's kernel did not run",
            ],
        ),
    ):
        report = {"errors": {}, "versions": {"platform": platform}, "float32": rows}
        assert gpu_check.problems(report) == expected
