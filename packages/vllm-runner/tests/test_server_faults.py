"""The server when its engine core dies under load: every request in flight ends with an error
that says so, within seconds; `/health` stops answering 200 and our own routes do not hang; and
a server started again serves as before."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from test_server import PROMPT, running_server

#: How long anything may take to answer once the engine is gone.
PROMPTLY_S = 30.0


def _engine_core_of(base: str) -> psutil.Process:
    """The engine core process of the server listening at `base`."""
    port = int(base.rsplit(":", 1)[1])
    (listening,) = {connection.pid for connection in psutil.net_connections("tcp")
                    if connection.laddr and connection.laddr.port == port
                    and connection.status == psutil.CONN_LISTEN}
    children = psutil.Process(listening).children(recursive=True)
    cores = [child for child in children if "EngineCore" in " ".join(child.cmdline())
             or "EngineCore" in child.name()]
    assert len(cores) == 1, [(child.name(), child.cmdline()) for child in children]
    return cores[0]


def _stream(base: str, ended: dict[int, Any], index: int, started: threading.Event) -> None:
    """A long streamed completion with a program; `ended[index]` says how it ended."""
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 110, "ignore_eos": True,
                       "stream": True, "interventions": [
                           {"op": "save", "location": "layers.*.layer_output"}]}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    lines: list[bytes] = []
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            for line in answer:
                lines.append(line)
                started.set()
        ended[index] = ("finished", b"".join(lines)[-2000:])
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
        ended[index] = ("broken", f"{type(error).__name__}: {error}".encode()
                        + b"".join(lines)[-2000:])


def _status(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=PROMPTLY_S) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, OSError) as error:
        return type(error).__name__


def test_an_engine_core_killed_under_load_ends_every_request_and_a_restart_serves(
        model_dir: str, tmp_path: Path) -> None:
    with running_server(model_dir, tmp_path) as base:
        ended: dict[int, Any] = {}
        events = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(base, ended, index, event), daemon=True)
                   for index, event in enumerate(events)]
        for thread in threads:
            thread.start()
        assert all(event.wait(120) for event in events)  # every request is generating
        _engine_core_of(base).send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(timeout=PROMPTLY_S)
        assert time.monotonic() - killed < PROMPTLY_S + 5 and len(ended) == 4, ended
        for how, text in ended.values():
            # Each ends, none as if it had finished: the stream breaks or ends with an error.
            assert how == "broken" or b"error" in text.lower(), (how, text[-500:])
            assert b'"finish_reason":"length"' not in text[-600:], text[-600:]
        health = _status(f"{base}/health")
        assert health != 200, health
        started = time.monotonic()
        held = _status(f"{base}/v1/interp/held")
        assert held != 200 and time.monotonic() - started < PROMPTLY_S, held
    with running_server(model_dir, tmp_path) as again:
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "interventions": [
            {"op": "save", "location": "logits"}]}).encode()
        request = urllib.request.Request(f"{again}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            choice = json.load(answer)["choices"][0]
        assert choice["interp"]["error"] is None and "logits" in choice["interp"]["saves"]
