"""examples/translate.py's draft (`--assistant-layers`, `--assistant-dim`,
`--assistant-training`): the options, the draft's sizes, the translator's
frozen layers after distilling, and (slow) runs that train one beside the
translator both ways, record its greedy speed-up and save it with the
translator."""

import json
from types import SimpleNamespace

import pytest

from tests.examples.test_data_options import load_script
from tests.examples.test_scripts import FIXTURES, run_script
from tests.test_case import fresh_json

pytestmark = pytest.mark.tf_only


def test_assistant_options_and_sizes(capsys):
    script = load_script("translate")
    assert script.parse_args([]).assistant_layers == 0  # no draft by default
    # Chosen on the validation pairs (docs/TRANSLATION.md).
    assert script.parse_args([]).assistant_training == "data"
    distill = script.parse_args(["--assistant-training", "distill"])
    assert distill.assistant_training == "distill"
    args = script.parse_args(["--pretrained", "none", "--assistant-layers", "1"])
    translator = SimpleNamespace(embedding_dim=256, num_heads=8, shared_vocabulary=True)
    assert script.assistant_sizes(args, translator) == {
        "num_encoder_layers": 1,
        "num_decoder_layers": 1,
        "embedding_dim": 128,
        "num_heads": 4,
        "intermediate_dim": 512,
        "shared_vocabulary": True,
    }
    args = script.parse_args(["--assistant-layers", "2", "--assistant-dim", "30"])
    sizes = script.assistant_sizes(args, translator)
    assert (sizes["embedding_dim"], sizes["num_heads"]) == (30, 3)  # 3 divides 30
    for argv, message in (
        (["--assistant-layers", "-1"], "--assistant-layers must be 0 or more"),
        (["--assistant-dim", "0"], "--assistant-dim must be positive"),
        (
            ["--model", "rnn", "--assistant-layers", "1"],
            "--assistant-layers drafts for the Transformer translator",
        ),
        (["--assistant-training", "teacher"], "invalid choice: 'teacher'"),
    ):
        with pytest.raises(SystemExit):
            script.parse_args(argv)
        assert message in capsys.readouterr().err, argv


def test_distilling_a_draft_keeps_the_translators_frozen_layers_frozen():
    # Keras's Distiller sets `teacher.trainable = False` and never undoes it;
    # setting `trainable = True` back would unfreeze the pretrained source
    # embedding the translator keeps fixed.
    from keras_attn.models import TransformerTranslator

    cli = load_script("_cli")
    sizes = dict(
        sequence_length=8, embedding_dim=16, num_encoder_layers=1,
        num_decoder_layers=1, num_heads=2, intermediate_dim=32,
    )  # fmt: skip
    translator = TransformerTranslator(50, 50, freeze_source_embedding=True, **sizes)
    draft = TransformerTranslator(50, 50, name="draft", **sizes)
    draft.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    trainable = len(translator.trainable_weights)

    trainee = cli.distiller(translator, draft, draft.optimizer, draft.loss)
    assert translator.trainable_weights == []  # the teacher, frozen while distilling
    trainee.restore_teacher()
    assert translator.trainable
    assert not translator.source_embedding.trainable
    assert len(translator.trainable_weights) == trainable


# Slow: a training end to end. The translator's own draft (translate, the
# export, model.keras, presets, a fresh process) is tested in
# tests/models/test_translator_assistant.py. `make test-slow` trains each
# kind of draft once across the two scripts: on the data (the default)
# here, distilled in tests/examples/test_language_model_eval.py; the other
# runs are `large`.
@pytest.mark.slow
@pytest.mark.parametrize(
    "training", ["data", pytest.param("distill", marks=pytest.mark.large)]
)
def test_a_draft_trained_beside_the_translator_is_saved_and_used(tmp_path, training):
    out = tmp_path / "run"
    run_script(
        "translate.py", "--smoke", "--pretrained", "none", "--data",
        FIXTURES / "de_en_pairs.tsv", "--assistant-layers", 1, "--beam-width", 1,
        "--length-penalty", 0, "--assistant-training", training, "--out", out,
    )  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    assert metrics["assistant_same_translations"] is True
    assert metrics["assistant"]["training"] == training
    assert 0 <= metrics["assistant"]["validation_agreement"] <= 1
    assert metrics["assistant"]["num_decoder_layers"] == 1
    assert metrics["assistant"]["embedding_dim"] == 64  # half of --smoke's 128
    assert metrics["assistant_speedup"] > 0
    # Exported with greedy search: the draft decodes in the SavedModel.
    export = out / "export" / "translator" / "1"
    served = json.loads((export / "assets.extra" / "keras_attn.json").read_text())
    assert served["assistant"]["num_decoder_layers"] == 1
    fresh = """
import json, sys
import keras
import keras_attn

model = keras.saving.load_model(sys.argv[1] + "/model.keras")
preset = keras_attn.models.TransformerTranslator.from_preset(sys.argv[1] + "/preset")
print(json.dumps([len(model.assistant_model.decoder_blocks),
                  len(preset.assistant_model.decoder_blocks)]))
"""
    assert fresh_json(fresh, out) == [1, 1]
