"""Reading and checking requests to the server: each problem is one line and a 4xx status."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vatra._extras import require

if TYPE_CHECKING:
    from starlette.requests import Request

ARROW = "application/vnd.apache.arrow.stream"
MAX_KEY = 256
_VALUES = (str, int, float, bool, type(None), list)  # a list: a tensor model's row


class BadRequest(Exception):
    """A request the server refuses; ``status`` is the 4xx it answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes (whatever Content-Length says)."""
    too_large = BadRequest(f"the body is over the limit of {limit} bytes: send fewer rows per request", 413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not JSON ({err}); send a JSON object") from None
    except RecursionError:
        raise BadRequest("the body nests JSON too deeply; send a flat object of rows") from None


def request_key(value: Any) -> str | None:
    """A request's key (a string or an integer; logged with every row, so at most MAX_KEY long)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"key must be a string or an integer, not {type(value).__name__}")
    if value is not None and len(value) > MAX_KEY:
        raise BadRequest(f"key is {len(value)} characters long; at most {MAX_KEY}")
    return value


def json_rows(body: bytes) -> tuple[list[dict[str, Any]], str | None]:
    """``{"rows": [{column: value, ...}, ...], "key": ...}`` → rows and key."""
    payload = _json(body)
    if not isinstance(payload, dict) or "rows" not in payload:
        raise BadRequest('the body must be a JSON object with "rows": [{"column": value, ...}, ...]')
    rows = payload["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise BadRequest('"rows" must be a list of objects, one {"column": value} per row')
    for i, row in enumerate(rows):
        for column, value in row.items():
            if not isinstance(value, _VALUES):
                raise BadRequest(
                    f"row {i} column {column!r} is an object: values must be numbers, strings,"
                    " booleans, null or (for a tensor input) lists of numbers",
                    422,
                )
    return rows, request_key(payload.get("key"))


def arrow_rows(body: bytes, limit: int) -> list[dict[str, Any]]:
    """An Arrow IPC stream → rows, each batch validated in full before anything reads it. A
    compressed stream may expand far beyond its body: reading stops (413) once the batches
    decoded so far hold more than ``limit`` bytes."""
    pa = require("pyarrow", "serve", "Arrow requests")
    batches, size = [], 0
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(body))
        for batch in reader:
            batch.validate(full=True)
            size += batch.nbytes
            if size > limit:
                raise BadRequest(
                    f"the Arrow stream expands to over {limit} bytes: send fewer rows per request", 413
                )
            batches.append(batch)
        table = pa.Table.from_batches(batches, schema=reader.schema)
    except (pa.ArrowException, OSError, ValueError) as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise BadRequest(f"the body is not a valid Arrow IPC stream: {message}") from None
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def check_rows(rows: list[dict[str, Any]], columns: Sequence[str] | None) -> None:
    """Refuse (422) an empty request and rows whose columns are not the model's."""
    if not rows:
        raise BadRequest('"rows" is empty: send at least one row', 422)
    if columns is None:
        return
    wanted = set(columns)
    for i, row in enumerate(rows):
        if row.keys() == wanted:
            continue
        missing = sorted(wanted - row.keys())
        unknown = sorted(row.keys() - wanted)
        what = f"lacks column {missing[0]!r}" if missing else f"has unknown column {unknown[0]!r}"
        more = len(missing) + len(unknown) - 1
        also = f" (and {more} more column problems)" if more else ""
        raise BadRequest(
            f"row {i} {what}{also}: the model takes {len(wanted)} columns ({_preview(columns)})", 422
        )


def _preview(columns: Sequence[str]) -> str:
    return ", ".join(columns) if len(columns) <= 6 else ", ".join(columns[:5]) + ", ..."


def outcome(body: bytes) -> tuple[str, float]:
    """``{"id": "...", "value": number}`` → id and value (booleans count as 1 and 0)."""
    payload = _json(body)
    if not isinstance(payload, dict) or "id" not in payload or "value" not in payload:
        raise BadRequest('the body must be a JSON object {"id": "<prediction id>", "value": <number>}')
    id_, value = payload["id"], payload["value"]
    if not isinstance(id_, str):
        raise BadRequest(f"id must be a string (a prediction id from /predict), not {type(id_).__name__}")
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"value must be a finite number or a boolean, not {value!r}", 422)
    return id_, float(value)


def jsonable(value: Any) -> Any:
    """``json.dumps``'s fallback for numpy scalars and arrays in model outputs."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def arrow_stream(ids: list[str], outputs: list[dict[str, Any]]) -> bytes:
    """The outputs as an Arrow IPC stream with an ``id`` column first."""
    pa = require("pyarrow", "serve", "Arrow responses")
    table = pa.Table.from_pylist([{"id": i, **o} for i, o in zip(ids, outputs, strict=True)])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())
