"""docs/server.md as a user runs it: its `vllm-interp serve` command as written (the embedded
model, port 8000), then every ```python block saved as one script and run with `python`, then
its curl lines with bash — and its schema file equal to the op classes'."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
from conftest import python_blocks, serving, user_environment
from vllm_runner.server.json_ops import interventions_schema

DOCS = Path(__file__).parents[3] / "docs"
PAGE = DOCS / "server.md"
DONE = "SERVER DOCS OK"


def _bash_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def test_the_schema_file_is_the_op_classes_schema_and_accepts_the_pages_examples() -> None:
    schema = json.loads((DOCS / "interventions.schema.json").read_text())
    assert schema == interventions_schema(), \
        "regenerate docs/interventions.schema.json from json_ops.interventions_schema()"
    examples = [json.loads(found) for found in re.findall(r'"interventions": (\[.*?\])}',
                                                          _bash_blocks()[1])]
    assert examples
    for example in examples:
        jsonschema.validate(example, schema)
    bad = [{"op": "save", "location": "layers.0.layer_output", "colour": "red"}]
    try:
        jsonschema.validate(bad, schema)
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("the schema accepts a field no op has")


def test_the_pages_commands_and_examples_run_as_written(tmp_path: Path) -> None:
    start, curl = _bash_blocks()
    assert start.strip() == "vllm-interp serve --port 8000"
    command = start.strip().split()
    command[0] = str(Path(sys.executable).parent / command[0])
    with serving(command, "http://localhost:8000", tmp_path / "server.log", cwd=tmp_path):
        script = "\n".join(python_blocks(PAGE)) + f"\nprint({DONE!r})\n"
        (tmp_path / "client.py").write_text(script)
        ran = subprocess.run([sys.executable, "client.py"], cwd=tmp_path, env=user_environment(),
                             capture_output=True, text=True, timeout=300)
        assert DONE in ran.stdout, ran.stderr[-4000:]
        (tmp_path / "curl.sh").write_text("set -euo pipefail\n" + curl)
        ran = subprocess.run(["bash", "curl.sh"], cwd=tmp_path, env=user_environment(),
                             capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr[-4000:]
        answers, text, decoder = [], ran.stdout.strip(), json.JSONDecoder()
        while text:  # curl prints each answer without a newline after it
            answer, end = decoder.raw_decode(text)
            answers.append(answer)
            text = text[end:].strip()
        assert answers[0]["shape"] == [576]
        assert answers[-1]["choices"][0]["interp"]["error"] is None
