"""Fuzz targets for two answers vatra reads from machines it does not control: the federation's data
contract (sent by the server, or by the first client to join) and a cloud's spot-notice answer (the
instance metadata service; on a hostile network anything that answers on its address).

Properties: ``DataContract.from_json`` returns a contract or raises ValueError; an accepted contract
round-trips through its own JSON and the comparison with a real owner's contract returns a line or
None. ``read_answer`` returns None or (detail, end time) or raises BadAnswer, for either provider and
any HTTP status.
"""

from __future__ import annotations

import json
from email.message import Message

from tests.fuzz._harness import Target

from vatra.federated.contract import DataContract, conform_problem
from vatra.resilience.checkpoint.notice import BadAnswer, read_answer

_OWN = DataContract(
    numeric=("age", "bmi"),
    categories={"sex": ["F", "M"]},
    target=("label",),
    classes={"label": [0, 1, 2]},
    encoding="onehot",
)

CONTRACT_TOKENS = [
    b'"numeric"', b'"categories"', b'"target"', b'"classes"', b'"encoding"', b'"onehot"', b'"embedding"',
    b'"age"', b'"sex"', b'"label"', b"[]", b"{}", b"null", b"true", b"1e308", b'"' + b"x" * 300 + b'"',
]  # fmt: skip


def _contract_seeds() -> list[bytes]:
    wide = DataContract(
        numeric=tuple(f"s{i}" for i in range(40)),
        categories={"city": ["Cluj", "Iași", "Timișoara"], "empty": []},
        target=("y", "z"),
        classes={"y": ["no", "yes"]},
        encoding="embedding",
    )
    return [json.dumps(c.to_json()).encode() for c in (_OWN, wide)]


def contract_one_input(data: bytes) -> None:
    """The contract as the client reads it from the server's message (JSON already parsed there)."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        return  # the message decoder's refusal (fuzzed by the "wire" target)
    try:
        contract = DataContract.from_json(raw)
    except ValueError:
        return
    assert DataContract.from_json(contract.to_json()) == contract, "an accepted contract does not round-trip"
    for own, fed in ((_OWN, contract), (contract, _OWN)):
        problem = conform_problem(own, fed)
        assert problem is None or isinstance(problem, str)


NOTICE_TOKENS = [
    b'"action"', b'"time"', b'"terminate"', b'"stop"', b'"hibernate"', b"TRUE", b"FALSE",
    b'"2026-12-06T13:39:48Z"', b'"2026-13-45T99:00:00"', b"null", b"{}", b"\xff\xfe",
]  # fmt: skip
_STATUS = (200, 404, 500, 301, 0, 200, 200, 200)


def _notice_seeds() -> list[bytes]:
    aws = json.dumps({"action": "terminate", "time": "2026-12-06T13:39:48Z"}).encode()
    return [b"\x00" + aws, b"\x01" + aws, b"\x04TRUE", b"\x05FALSE", b"\x02", b"\x07TRUE\n"]


def notice_one_input(data: bytes) -> None:
    """First byte: provider (bit 2: gcp), status (low bits), whether GCP's header is there (bit 3)."""
    if not data:
        return
    head, body = data[0], data[1:]
    provider = "gcp" if head & 4 else "aws"
    headers = Message()
    if provider == "aws" or not head & 8:
        headers["Metadata-Flavor"] = "Google"
    try:
        answer = read_answer(provider, _STATUS[head & 7], headers, body)
    except BadAnswer:
        return
    if answer is not None:
        detail, end = answer
        assert isinstance(detail, str) and (end is None or isinstance(end, float))


CONTRACT = Target("contract", contract_one_input, _contract_seeds, CONTRACT_TOKENS)
NOTICE = Target("notice", notice_one_input, _notice_seeds, NOTICE_TOKENS)
