"""Inputs for the export tests (the small tokenizer is in tests/conftest.py)."""

from pathlib import Path

FIXTURES = Path(__file__).parent.parent / "fixtures"

# Inputs a TF Serving client may send: each must give outputs of the right
# shapes, never an error.
NASTY_TEXTS = [
    "",
    "   \t  ",
    "word " * 2000,  # 10,000 characters
    "Grüße aus Köln!",
    "bad bytes \xff\xfe here",
]


def nasty_batch():
    """The texts above as bytes, with genuinely invalid UTF-8 in the last."""
    batch = [text.encode("utf-8") for text in NASTY_TEXTS[:-1]]
    batch.append(b"bad bytes \xff\xfe here")
    return batch
