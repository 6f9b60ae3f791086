"""Live preemption notices: SIGTERM, a local metadata server in AWS's and GCP's shapes, a file;
the checkpoint lands within the window, and the resumed run ends with the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.conftest import small_config

from vatra.config import Config
from vatra.engine import Plugin, Trainer
from vatra.errors import ConfigError
from vatra.monitor import JsonlWriter
from vatra.monitor.narrate import describe
from vatra.resilience import CheckpointPlugin, Preempted
from vatra.resilience.checkpoint.notice import BadAnswer, NoticeWatcher, read_answer
from vatra.rundir import RunDir, read_jsonl

AWS_PATH = "/latest/meta-data/spot/instance-action"
GCP_PATH = "/computeMetadata/v1/instance/preempted"


def aws_notice(in_s: float) -> tuple[int, dict[str, str], bytes]:
    """AWS's answer once noticed: the action and the machine's end, ``in_s`` seconds from now."""
    end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + in_s))
    return 200, {}, json.dumps({"action": "terminate", "time": end}).encode()


GCP = {"Metadata-Flavor": "Google"}


class MetadataServer:
    """A real HTTP server on a free port answering what ``answer`` holds: (status, headers, body)."""

    def __init__(self, answer: tuple[int, dict[str, str], bytes]) -> None:
        self.answer = answer
        self.requests: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests.append(dict(self.headers))
                status, headers, body = outer.answer
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    srv = MetadataServer((404, {}, b""))
    srv.thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(**spot: object) -> Config:
    # dropout, AdamW and a cosine schedule: the resume must restore RNG, optimizer moments and the LR
    return small_config(
        model={"hidden": [32], "dropout": 0.1},
        train={"steps": 20, "batch_size": 16},
        optim={"name": "adamw", "lr": 0.01, "schedule": "cosine", "warmup_steps": 3},
        checkpoint={"every_steps": 0, "async": True},
        spot={"poll_s": 0.02, **spot},
    )


class NoticeAt(Plugin):
    """At the end of step ``step``, make the notice happen, then wait (≤ 5 s) until it is recorded,
    as a real notice would be between two steps of a slower model."""

    def __init__(self, step: int, trigger: Any, plugin: CheckpointPlugin) -> None:
        self.step, self.trigger, self.plugin = step, trigger, plugin

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if trainer.state.step != self.step:
            return
        self.trigger()
        deadline = time.monotonic() + 5.0
        while self.plugin.stop.notice is None and time.monotonic() < deadline:
            time.sleep(0.01)


def _trainer(cfg: Config, run: Path, notice: tuple[int, Any] | None = None) -> Trainer:
    rd = RunDir(run).create()
    plugin = CheckpointPlugin(cfg, rd)
    extra = [NoticeAt(notice[0], notice[1], plugin)] if notice else []
    return Trainer.from_config(cfg, plugins=[plugin, *extra, JsonlWriter(rd)], run_dir=rd)


def _weights(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in t.model.parameters()]


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


@pytest.mark.parametrize("source", ["sigterm", "aws", "gcp", "file"])
def test_a_notice_at_a_random_step_saves_within_the_window_and_resumes_exactly(
    source: str, tmp_path: Path, server: MetadataServer
) -> None:
    # Prepare: the uninterrupted run, then the notice's trigger and its config
    ref = _trainer(_cfg(), tmp_path / "ref")
    ref.fit()
    flag = tmp_path / "notice"
    spot: dict[str, object] = {}
    if source in ("aws", "gcp"):
        spot = {"provider": source, "notice_url": server.url(AWS_PATH if source == "aws" else GCP_PATH)}
        server.answer = (404, {}, b"") if source == "aws" else (200, GCP, b"FALSE")
    elif source == "file":
        spot = {"notice_file": str(flag)}
    triggers = {
        "sigterm": lambda: os.kill(os.getpid(), signal.SIGTERM),
        "aws": lambda: setattr(server, "answer", aws_notice(3600)),  # beyond the window
        "gcp": lambda: setattr(server, "answer", (200, GCP, b"TRUE")),
        "file": flag.touch,
    }
    step = random.Random(source).randint(3, 15)
    cfg = _cfg(**spot)
    # Execute: the notice comes after `step`; every rank stops at the next step boundary
    hit = _trainer(cfg, tmp_path / "run", notice=(step, triggers[source]))
    with pytest.raises(Preempted) as stopped:
        hit.fit()
    # Assert: the checkpoint of step + 1 landed within the window, and the exit says so
    assert hit.state.step == step + 1
    (noticed,) = _events(tmp_path / "run", "preemption_notice")
    (saved,) = _events(tmp_path / "run", "preemption_checkpoint")
    window = 30.0 if source == "gcp" else 120.0
    assert noticed["source"] == ("url" if source in ("aws", "gcp") else source)
    assert noticed["window_s"] == pytest.approx(window, abs=1e-6)
    assert saved["fit"] is True and 0 < saved["save_s"] <= saved["seconds"] < window
    assert saved["step"] == step + 1
    assert stopped.value.exit_code == 143 and "within its" in str(stopped.value)
    line = describe("preemption_notice", noticed)  # the console's line for it
    assert line is not None and line.startswith("preemption notice (") and f"within {window:.0f} s" in line
    if source == "gcp":
        assert server.requests and all(r.get("Metadata-Flavor") == "Google" for r in server.requests)
    # Execute: the machine comes back (no notice any more) and the same command runs again
    server.answer = (404, {}, b"") if source == "aws" else (200, GCP, b"FALSE")
    flag.unlink(missing_ok=True)
    torch.manual_seed(4321)  # disturb the global RNG: the resume must restore it
    resumed = _trainer(cfg, tmp_path / "run")
    summary = resumed.fit()
    # Assert: same weights as the uninterrupted run, bit for bit (CPU, one process: no tolerance)
    assert summary["steps"] == 20
    assert _events(tmp_path / "run", "resumed")[0]["resumed_step"] == step + 1
    assert all(torch.equal(a, b) for a, b in zip(_weights(ref), _weights(resumed), strict=True))


def test_a_checkpoint_past_the_window_is_reported_as_not_fitting(tmp_path: Path) -> None:
    # Prepare: a window no checkpoint can meet
    flag = tmp_path / "notice"
    cfg = _cfg(notice_file=str(flag), notice_s=1e-6)
    hit = _trainer(cfg, tmp_path / "run", notice=(4, flag.touch))
    # Execute
    with pytest.raises(Preempted) as stopped:
        hit.fit()
    # Assert: still saved (best effort), but flagged as late, in the event and in the exit line
    (saved,) = _events(tmp_path / "run", "preemption_checkpoint")
    assert saved["fit"] is False and saved["seconds"] > saved["window_s"]
    assert "PAST its" in str(stopped.value)


HOSTILE = [
    ("aws", (200, {}, b"<html>captive portal</html>"), "not JSON"),
    ("aws", (200, {}, b'{"action": "reboot"}'), "without an action"),
    ("aws", (200, {}, b'["terminate"]'), "without an action"),
    ("aws", (200, {}, b'{"action": "terminate", "time": "soon"}'), "not an ISO 8601 time"),
    ("aws", (200, {}, b'{"action": "terminate", "pad": "' + b"x" * 5000 + b'"}'), "more than 4096 bytes"),
    ("aws", (500, {}, b"oops"), "HTTP 500"),
    ("aws", (302, {"Location": "http://example.invalid/"}, b""), "HTTP 302"),
    ("gcp", (200, {}, b"TRUE"), "Metadata-Flavor"),  # not GCP's server: its TRUE is not believed
    ("gcp", (200, GCP, b"true\n<script>"), "expected TRUE or FALSE"),
    ("gcp", (403, GCP, b"TRUE"), "HTTP 403"),
]


@pytest.mark.parametrize(("provider", "answer", "reason"), HOSTILE)
def test_a_hostile_metadata_answer_is_ignored_with_a_reason(
    provider: str, answer: tuple[int, dict[str, str], bytes], reason: str, server: MetadataServer
) -> None:
    # Prepare
    server.answer = answer
    cfg = _cfg(provider=provider, notice_url=server.url(AWS_PATH)).spot
    seen: list[Any] = []
    ignored: list[str] = []
    watcher = NoticeWatcher(cfg, seen.append, ignored.append)
    # Execute: two looks (a reason is reported once)
    first, second = watcher.check(), watcher.check()
    # Assert: no notice, one logged reason naming what was wrong
    assert first is None and second is None and not seen
    assert len(ignored) == 1 and reason in ignored[0], ignored


def test_a_run_under_a_hostile_endpoint_trains_to_the_end_and_logs_why(
    tmp_path: Path, server: MetadataServer
) -> None:
    # Prepare: the "metadata server" answers TRUE without being GCP's
    server.answer = (200, {}, b"TRUE")
    cfg = _cfg(provider="gcp", notice_url=server.url(GCP_PATH))
    # Execute
    summary = _trainer(cfg, tmp_path / "run").fit()
    # Assert: no false preemption, no crash; the reason is in events.jsonl
    assert summary["steps"] == 20
    assert not _events(tmp_path / "run", "preemption_notice")
    (why,) = _events(tmp_path / "run", "preemption_notice_ignored")
    assert "Metadata-Flavor" in why["reason"]


def test_aws_end_time_sooner_than_the_window_is_the_deadline(server: MetadataServer) -> None:
    server.answer = aws_notice(20)
    notice = NoticeWatcher(_cfg(notice_url=server.url(AWS_PATH)).spot, print).check()
    assert notice is not None and notice.source == "url"
    assert notice.deadline - notice.seen_at == pytest.approx(20, abs=1.5)  # whole seconds in the answer


def test_an_unreachable_endpoint_is_no_notice(tmp_path: Path) -> None:
    # a port nobody listens on (bound, then closed)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = srv.server_address[1]
    srv.server_close()
    ignored: list[str] = []
    watcher = NoticeWatcher(_cfg(notice_url=f"http://127.0.0.1:{port}/x").spot, print, ignored.append)
    assert watcher.check() is None and ignored and "unreachable" in ignored[0]


def test_the_provider_shapes() -> None:
    none = Message()
    google = Message()
    google["Metadata-Flavor"] = "Google"
    assert read_answer("aws", 404, none, b"Not Found") is None
    detail, end = read_answer(
        "aws", 200, none, json.dumps({"action": "stop", "time": "2026-12-06T12:00:00Z"}).encode()
    )
    assert "stop" in detail and end == 1796558400.0
    assert read_answer("gcp", 200, google, b"FALSE") is None
    assert read_answer("gcp", 200, google, b"TRUE") == ("instance/preempted = TRUE", None)
    with pytest.raises(BadAnswer):
        read_answer("gcp", 200, none, b"TRUE")


@pytest.mark.parametrize(
    ("spot", "says"),
    [
        ({"notice_url": "file:///etc/passwd"}, "not an http(s) URL"),
        ({"notice_url": "http://user:secret@169.254.169.254/x"}, "credentials"),
        ({"notice_s": 0}, "notice_s"),
        ({"provider": "azure"}, "provider"),
    ],
)
def test_bad_spot_keys_are_one_clear_error(spot: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match="spot") as err:
        small_config(spot=spot)
    assert says in str(err.value) and "secret" not in str(err.value)
