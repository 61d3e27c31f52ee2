"""setup.cfg's extras and `keras_attn._extras`: each extra installs the
modules that the import checks ask it for, and the core asks for Keras and
NumPy only."""

import configparser
import re
from pathlib import Path

import pytest

from keras_attn import _extras
from tests.test_case import REPO_ROOT

# The distribution that provides each import name.
PROVIDER = {
    "tensorflow": "tensorflow",
    "tensorflow_text": "tensorflow-text",
    "tensorflow_serving": "tensorflow-serving-api",
    "sentencepiece": "sentencepiece",
    "sacrebleu": "sacrebleu",
    "matplotlib": "matplotlib",
}


def setup_cfg():
    config = configparser.ConfigParser()
    config.read(Path(REPO_ROOT) / "setup.cfg")
    return config


def requirement_names(text):
    return [
        re.split(r"[ <>=!;(]", line.strip(), maxsplit=1)[0].lower()
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def resolved_extra(extras, name):
    """The distributions `pip install 'keras-attn[name]'` asks for, with the
    extra's references to other extras (`keras-attn[text]`) followed."""
    found = set()
    for requirement in requirement_names(extras[name]):
        match = re.fullmatch(r"keras-attn\[([\w,]+)\]", requirement)
        if match:
            for other in match.group(1).split(","):
                found |= resolved_extra(extras, other)
        else:
            found.add(re.sub(r"\[.*\]", "", requirement))
    return found


def test_core_requires_keras_and_numpy_only():
    core = requirement_names(setup_cfg()["options"]["install_requires"])
    assert core == ["keras", "numpy"]


@pytest.mark.parametrize("extra", sorted(_extras.EXTRAS))
def test_each_extra_installs_what_its_import_check_asks_for(extra):
    extras = setup_cfg()["options.extras_require"]
    installed = resolved_extra(extras, extra)
    for module in _extras.EXTRAS[extra]:
        assert PROVIDER[module] in installed, (extra, module)


def test_dev_installs_every_extra():
    extras = setup_cfg()["options.extras_require"]
    dev = resolved_extra(extras, "dev")
    for extra in _extras.EXTRAS:
        assert resolved_extra(extras, extra) <= dev, extra
    assert {"keras-hub", "jax", "pytest", "ruff", "build"} <= dev


def test_the_message_names_the_extra_and_the_error():
    error = ModuleNotFoundError("No module named 'tensorflow'")
    message = str(
        _extras.missing_extra_error("keras_attn.export", "export", "tensorflow", error)
    )
    assert message == (
        "keras_attn.export needs TensorFlow: pip install 'keras-attn[export]' "
        "(from a checkout: pip install -e '.[export]'). "
        "Received: ModuleNotFoundError(\"No module named 'tensorflow'\")"
    )
    with pytest.raises(ValueError, match=r"Received: extra='txt'"):
        _extras.require("keras_attn.text", "txt")
