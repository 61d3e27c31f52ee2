"""`--verbose`: Keras' verbosity of the example scripts' training and evaluation."""

import io

import pytest

from keras_attn._progress import progress_bar
from tests.test_case import load_example
from tests.training.test_budget_schedule import run_parser

cli = load_example("_cli")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_auto_is_progress_bars_on_a_terminal_and_lines_elsewhere():
    assert cli.resolve_verbosity("auto", _Terminal()) == 1
    assert cli.resolve_verbosity("auto", io.StringIO()) == 2
    assert cli.resolve_verbosity("auto", object()) == 2  # no isatty at all


@pytest.mark.parametrize("mode, expected", [("1", 1), ("2", 2), (1, 1), (2, 2)])
def test_explicit_verbosity_is_kept(mode, expected):
    assert cli.resolve_verbosity(mode, _Terminal()) == expected


@pytest.mark.parametrize("mode", ["0", "3", "bar", None])
def test_other_verbosities_are_refused(mode):
    with pytest.raises(ValueError, match=f"Received: verbose={mode!r}"):
        cli.resolve_verbosity(mode)


def test_run_arguments_resolve_verbose_to_an_int():
    parser = run_parser()
    # pytest captures standard output: not a terminal.
    assert cli.parse_run_args(parser, []).verbose == 2
    assert cli.parse_run_args(parser, ["--verbose", "1"]).verbose == 1
    with pytest.raises(SystemExit):
        cli.parse_run_args(parser, ["--verbose", "3"])


def test_progress_bar_prints_its_title_and_one_line_at_verbose_2(capsys):
    progress = progress_bar("Scoring the test text", 3, verbose=2)
    for step in (1, 2):
        progress.update(step)
    assert capsys.readouterr().out == "Scoring the test text:\n"  # nothing yet
    progress.update(3)
    out = capsys.readouterr().out
    assert out.startswith("3/3 - ") and out.endswith("\n") and out.count("\n") == 1


def test_progress_bar_draws_a_bar_at_verbose_1(capsys):
    progress = progress_bar("Translating", 2, verbose=1)
    progress.update(1)
    progress.update(2)
    out = capsys.readouterr().out
    assert out.startswith("Translating:\n")
    assert "\u2501" in out and "2/2" in out  # the bar's glyph, then the count
