"""Write the REST and gRPC examples of docs/SERVING.md from real answers.

Sends each example request through `serving_standin.StandInServer` (the
tests' stand-in for the server, at the repository root: the export loaded as
TF Serving loads it, with the server's REST and Predict conversions), runs
the page's own gRPC client code on the answer, and writes the requests and
answers into the page's marked regions (`<!-- serving-examples:NAME -->` ...
`<!-- /serving-examples:NAME -->`) with `--write`, or prints them.

    python docs/serving_examples.py [--sentiment EXPORT] [--translator EXPORT] \
        [--language-model EXPORT] [--write]

EXPORT is a model directory (its highest version is used) or a version
directory of the matching task; the regions of the tasks not given are left
as they are.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "SERVING.md"
# serving_standin: test tooling at the repository root, not installed.
sys.path.insert(0, str(PAGE.parents[1]))
KEEP = 4  # items shown of a longer array
MORE = "…"
BAD_BYTES = b"bad bytes \xff\xfe here"

# (model, body): every body is sent as it is written on the page.
REST_EXAMPLES = [
    ("sentiment", {"instances": ["A gorgeous, witty film.", "The plot is thin."]}),
    (
        "sentiment",
        {
            "signature_name": "serving_default",
            "inputs": {
                "text": [
                    "A gorgeous, witty film.",
                    {"b64": base64.b64encode(BAD_BYTES).decode("ascii")},
                ]
            },
        },
    ),
    ("translator", {"instances": ["Where is the station?"]}),
    (
        "translator",
        {
            "signature_name": "translate_with_alignment",
            "inputs": {"text": ["Where is the station?"]},
        },
    ),
    ("language_model", {"instances": ["KING:\n"]}),
    (
        "language_model",
        {"signature_name": "score", "inputs": {"text": ["To be, or not to be"]}},
    ),
]
GRPC_TEXTS = ["Where is the station?"]


def abbreviate(value):
    """`value` with every list longer than `KEEP` cut to `KEEP` items and
    `MORE`."""
    if isinstance(value, list):
        items = [abbreviate(v) for v in value[:KEEP]]
        return [*items, MORE] if len(value) > KEEP else items
    if isinstance(value, dict):
        return {k: abbreviate(v) for k, v in value.items()}
    return value


def parse_answer(text: str):
    """A JSON answer, keeping each number's digits as the server wrote them."""
    from keras_attn.export._predict import JsonNumber

    return json.loads(text, parse_float=lambda s: JsonNumber(float(s), s))


def curl_block(model: str, body: dict, answer: str) -> str:
    from keras_attn.export._predict import dumps

    shown = dumps(abbreviate(parse_answer(answer)))
    return (
        f"curl -s localhost:8501/v1/models/{model}:predict \\\n"
        f"  -d '{json.dumps(body, ensure_ascii=False)}'\n"
        f"# {shown}\n"
    )


def python_block(marker: str) -> str:
    """The page's ```python block that contains `marker`."""
    blocks = re.findall(r"^```python[^\n]*\n(.*?)^```", PAGE.read_text(), re.M | re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def regions(exports: dict) -> dict:
    """The page's regions for the exports given (`{model name: path}`; any
    of sentiment, translator, language_model)."""
    from keras_attn.export.batching import task_batching
    from serving_standin import StandInServer

    new = {
        "batching-translation": "```text\n"
        + task_batching("translation").to_text()
        + "```\n"
    }
    for model, path in exports.items():
        with StandInServer(path) as server:
            rest = []
            for example_model, body in REST_EXAMPLES:
                if example_model != model:
                    continue
                status, answer = server.rest(json.dumps(body))
                if status != 200:
                    raise RuntimeError(f"{model}: {body} answered {status}: {answer}")
                rest.append(curl_block(model, body, answer))
            new[f"rest-{model}"] = "```bash\n" + "\n".join(rest) + "```\n"
            if model == "translator":
                client = {}
                exec(python_block("def translate_with_alignment("), client)
                results = client["translate_with_alignment"](server.stub(), GRPC_TEXTS)
                new["grpc"] = (
                    "```text\n" + json.dumps(results, ensure_ascii=False) + "\n```\n"
                )
    return new


def write_regions(text: str, new: dict) -> str:
    for name, content in new.items():
        begin = f"<!-- serving-examples:{name} -->\n"
        end = f"<!-- /serving-examples:{name} -->"
        start, stop = text.find(begin), text.find(end)
        if start < 0 or stop < start:
            raise ValueError(f"{PAGE.name} has no region {name!r}")
        text = text[: start + len(begin)] + content + text[stop:]
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentiment", help="a sentiment export")
    parser.add_argument("--translator", help="a translator export")
    parser.add_argument("--language-model", help="a language model export")
    parser.add_argument(
        "--write", action="store_true", help=f"rewrite the regions of {PAGE}"
    )
    args = parser.parse_args(argv)
    exports = {
        "sentiment": args.sentiment,
        "translator": args.translator,
        "language_model": args.language_model,
    }
    new = regions({name: path for name, path in exports.items() if path})
    if args.write:
        PAGE.write_text(write_regions(PAGE.read_text(), new))
        print(f"wrote {', '.join(new)} into {PAGE}")
    else:
        for name, content in new.items():
            print(f"== {name}\n{content}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
