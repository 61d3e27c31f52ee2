"""examples/_cli.py: the run directory, --evaluate-only, --steps and
--pretrained, without running a script."""

import argparse
import json

import pytest

from tests.test_case import load_example, write_bert_checkpoint

cli = load_example("_cli")


def parse(argv, epochs=7):
    parser = argparse.ArgumentParser()
    cli.add_run_arguments(
        parser, out="runs/x", epochs=epochs, time_budget=10.0, batch_size=8
    )
    parser.add_argument("--data", default=None)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    return cli.parse_run_args(parser, argv)


def finished_run(directory):
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("backup", "checkpoints", "members", "export"):
        (directory / name).mkdir()
    (directory / "model.keras").write_text("model")
    (directory / "done.json").write_text("{}")
    (directory / "metrics.json").write_text(
        json.dumps(
            {
                "metrics": {"train_seconds": 12.0, "test_bleu": 1.0},
                "config": {"data": "pairs.tsv", "max_length": 16},
            }
        )
    )
    return directory


def test_a_finished_run_is_refused_unless_overwritten(tmp_path):
    out = finished_run(tmp_path / "run")
    with pytest.raises(SystemExit, match=f"--evaluate-only {out}; to train"):
        cli.start_run(parse(["--out", str(out), "--mixed-precision", "off"]))
    cli.start_run(parse(["--out", str(out), "--overwrite", "--mixed-precision", "off"]))
    # What the run wrote is gone, its TF Serving versions are kept.
    assert sorted(p.name for p in out.iterdir()) == ["export"]


def test_evaluate_only_points_at_the_run_and_takes_its_data(tmp_path):
    out = finished_run(tmp_path / "run")
    args = parse(["--evaluate-only", str(out), "--data", "other.tsv"])
    assert args.out == str(out)
    cli.inherit_run_options(args, ("data", "max_length"))
    assert args.data == "pairs.tsv" and args.max_length == 16
    with pytest.raises(SystemExit):
        parse(["--evaluate-only", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit):
        parse(["--evaluate-only", str(out), "--overwrite"])


def test_evaluate_only_keeps_the_training_figures(tmp_path):
    out = finished_run(tmp_path / "run")
    config = {"evaluate_only": str(out), "beam_width": 2}
    cli.write_metrics(out, {"test_bleu": 2.0}, config, {"backend": "x"})
    written = json.loads((out / "metrics.json").read_text())
    assert written["metrics"] == {"train_seconds": 12.0, "test_bleu": 2.0}
    assert written["config"]["data"] == "pairs.tsv"  # the run's own
    assert written["evaluated_only"] == config


def test_the_summary_says_when_a_command_trained_nothing():
    # --evaluate-only: the command's own metrics have no training time, and
    # its summary must not claim 0 minutes of training.
    assert cli.training_minutes({"test_bleu": 2.0}) == "- (not trained by this command)"
    assert cli.training_minutes({"train_seconds": 90.0}) == 1.5
    table = cli.summary_table([("training minutes", cli.training_minutes({}))])
    assert "0.0000" not in table


def test_steps_set_the_epochs_and_turn_the_budget_off():
    args = parse(["--steps", "25"])
    assert args.time_budget is None
    options = cli.fit_options(args, steps_per_epoch=10, decay_alpha=0.1)
    assert (options["epochs"], options["max_steps"]) == (3, 25)
    assert options["minutes"] is None and options["decay_alpha"] == 0.1
    budgeted = parse(["--steps", "25", "--time-budget", "5"])
    assert budgeted.time_budget == 5.0
    assert cli.fit_options(parse([]), 10)["epochs"] == 7
    assert "learning_rate" not in cli.fit_options(parse([]), 10)
    with pytest.raises(SystemExit):
        parse(["--steps", "0"])


def test_load_pretrained_names(tmp_path):
    directory = write_bert_checkpoint(tmp_path / "bert")
    assert cli.load_pretrained("none") is None
    assert cli.load_pretrained(directory).hidden_size == 16
    with pytest.raises(ValueError, match="must be a BERT checkpoint directory"):
        cli.load_pretrained(tmp_path / "missing")


def test_number_lists_check_their_bounds():
    parse_list = cli.number_list(float, 0, 1)
    assert parse_list("0,0.5") == (0.0, 0.5)
    for bad in ("0.5,1", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"in \[0, 1\)"):
            parse_list(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
        cli.number_list(int, positive=True)("4,0")


def test_smoke_splits_take_the_first_of_every_strided_split():
    from keras_attn.datasets.splits import Splits

    splits = Splits(train=tuple(range(100)), validation=tuple(range(10)), test=())
    smoke = cli.smoke_splits(splits, (3, 2, 5), (20, 1, 1))
    assert (smoke.train, smoke.validation, smoke.test) == ((0, 20, 40), (0, 1), ())


def test_a_finished_run_writes_metrics_and_prints_the_summary(tmp_path, capsys):
    from keras_attn.datasets.splits import Splits

    args = parse(["--out", str(tmp_path), "--mixed-precision", "off"])
    run = cli.start_run(args)
    assert run.out == tmp_path and run.policy == "float32"
    cli.write_translations(
        tmp_path / "t.tsv",
        {"sources": ["a"], "references": ["b"], "hypotheses": ["c"]},
    )
    assert (tmp_path / "t.tsv").read_text() == "a\tb\tc\n"
    splits = Splits(train=(1, 2), validation=(3,), test=(4,))
    metrics = {"test_bleu": 1.5, "train_seconds": 60.0}
    cli.finish(
        run,
        args,
        metrics,
        splits,
        [("test BLEU", 1.5)],
        title="t",
        export=None,
        plots=[],
    )
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["metrics"] == metrics
    assert written["splits"] == {"train": 2, "validation": 1, "test": 1}
    summary = capsys.readouterr().out
    assert summary.index("test BLEU") < summary.index("training minutes")
    lines = [line.split() for line in summary.splitlines()]
    assert ["export", "-"] in lines and ["plots", "-"] in lines
