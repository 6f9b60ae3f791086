"""Preemption notices besides SIGTERM: a provider's metadata endpoint, polled, or a file that appears.

A daemon thread polls ``spot.notice_url`` and checks for ``spot.notice_file`` every ``spot.poll_s``;
the first notice is handed to a callback (the checkpoint plugin's stop agreement) and the thread
ends. The metadata answer is untrusted input: anything but the provider's documented shapes is
ignored with a logged reason, never taken for a notice and never raised.

- AWS ``GET /latest/meta-data/spot/instance-action``: 404 while the machine may run; 200 with
  ``{"action": "terminate" | "stop" | "hibernate", "time": "2026-12-06T12:00:00Z"}`` once noticed.
- GCP ``GET /computeMetadata/v1/instance/preempted`` (request header ``Metadata-Flavor: Google``,
  which the answer carries too): ``FALSE``, then ``TRUE``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from email.message import Message
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vatra.config._spot import SpotConfig

log = logging.getLogger("vatra.spot")

MAX_ANSWER_BYTES = 4096  # both providers answer in well under 100 bytes
FETCH_TIMEOUT_S = 2.0  # a metadata server answers in milliseconds; a busy host may take longer
AWS_ACTIONS = ("terminate", "stop", "hibernate")


class BadAnswer(ValueError):
    """A metadata answer in neither the 'no notice' nor the 'notice' shape: ignored, with this reason."""


@dataclass(frozen=True)
class Notice:
    """A preemption notice: where it came from, when it was seen and when the machine ends."""

    source: str  # "sigterm", "url" or "file"
    seen_at: float  # unix seconds
    deadline: float  # unix seconds by which the checkpoint must have landed
    detail: str = ""


def read_answer(provider: str, status: int, headers: Message, body: bytes) -> tuple[str, float | None] | None:
    """None: no notice. Else (detail, end time in unix seconds or None). Raises :class:`BadAnswer`."""
    if len(body) > MAX_ANSWER_BYTES:
        raise BadAnswer(f"answer of more than {MAX_ANSWER_BYTES} bytes")
    if provider == "gcp":
        if headers.get("Metadata-Flavor") != "Google":
            raise BadAnswer("answer without the header Metadata-Flavor: Google (not GCP's metadata server)")
        if status != 200:
            raise BadAnswer(f"HTTP {status}")
        text = body.decode("ascii", errors="replace").strip()
        if text not in ("TRUE", "FALSE"):
            raise BadAnswer(f"preempted is {text[:40]!r}, expected TRUE or FALSE")
        return ("instance/preempted = TRUE", None) if text == "TRUE" else None
    if status == 404:
        return None
    if status != 200:
        raise BadAnswer(f"HTTP {status}")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadAnswer("instance-action is not JSON") from None
    if not isinstance(doc, dict) or doc.get("action") not in AWS_ACTIONS:
        raise BadAnswer(f"instance-action without an action of {', '.join(AWS_ACTIONS)}")
    when = doc.get("time")
    try:
        end = datetime.fromisoformat(when).timestamp() if isinstance(when, str) else None
    except ValueError:
        raise BadAnswer(f"instance-action time {str(when)[:40]!r} is not an ISO 8601 time") from None
    return f"instance-action {doc['action']} at {when}", end


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A metadata server answers in place; a redirect (elsewhere) is refused, as an HTTP 3xx."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


# no proxy from the environment: the metadata service is link-local and must be asked directly
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def fetch(url: str, provider: str, timeout_s: float) -> tuple[int, Message, bytes]:
    """(status, headers, at most MAX_ANSWER_BYTES + 1 bytes of body); raises OSError when unreachable."""
    headers = {"Metadata-Flavor": "Google"} if provider == "gcp" else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout_s) as answer:
            return answer.status, answer.headers, answer.read(MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as err:  # 404 is AWS's "no notice": an answer, not a failure
        with err:
            return err.code, err.headers, err.read(MAX_ANSWER_BYTES + 1)


class NoticeWatcher:
    """Polls the endpoint and the file on a daemon thread; calls ``on_notice`` once, then ends.

    Thread-safety: ``on_notice`` runs on the watcher's thread and must only record the notice (the
    training loop acts on it at its next step boundary). ``on_ignored(reason)`` is called once per
    distinct reason, also on that thread.
    """

    def __init__(
        self,
        spot: SpotConfig,
        on_notice: Callable[[Notice], None],
        on_ignored: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.spot = spot
        self.on_notice = on_notice
        self.on_ignored = on_ignored
        self.reasons: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vatra-spot-notice", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.spot.poll_s + FETCH_TIMEOUT_S)

    def check(self) -> Notice | None:
        """One look at the file and the endpoint."""
        spot, now = self.spot, time.time()
        window = now + spot.window_s()
        if spot.notice_file and Path(spot.notice_file).exists():
            return Notice("file", now, window, f"{spot.notice_file} appeared")
        if not spot.notice_url:
            return None
        try:
            status, headers, body = fetch(spot.notice_url, spot.provider, timeout_s=FETCH_TIMEOUT_S)
            found = read_answer(spot.provider, status, headers, body)
        except BadAnswer as err:
            self._ignored(str(err))
            return None
        except OSError as err:  # unreachable now: a later poll may reach it
            self._ignored(f"unreachable ({type(err).__name__})")
            return None
        if found is None:
            return None
        detail, end = found
        # the provider's own end time when it is sooner than the window (and not already past)
        deadline = end if end is not None and now < end < window else window
        return Notice("url", now, deadline, detail)

    def _ignored(self, reason: str) -> None:
        if reason in self.reasons:
            return
        self.reasons.add(reason)
        log.warning("spot.notice_url: ignored an answer: %s", reason)
        self.on_ignored(reason)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self.check()
            except Exception as err:  # a watcher must never take the run down
                self._ignored(f"{type(err).__name__}: {err}")
                notice = None
            if notice is not None:
                self.on_notice(notice)
                return
            self._stop.wait(self.spot.poll_s)
