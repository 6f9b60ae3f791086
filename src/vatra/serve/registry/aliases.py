"""Aliases (``champion``, ``challenger``, ...) and their append-only history.

Each move of an alias is one record, ``models/<name>/aliases/<alias>/<seq>.json``, written only
if absent (:meth:`~vatra.resilience.StoreBackend.create`: a hard link locally, a conditional PUT
on S3). A writer reads the newest record k, builds record k + 1 from it (its ``from`` is record
k's ``to``) and creates it; when another process created k + 1 first, it reads again and tries
k + 2. So concurrent promotes from many processes all land, in one order, each naming the version
it replaced, and the alias is always its newest record's ``to``. Nothing is ever rewritten.
"""

from __future__ import annotations

import getpass
import os
import time
from collections.abc import Callable
from typing import Any

from vatra.resilience._base import StoreBackend
from vatra.resilience.manifest import decode_record, encode_record
from vatra.serve.registry._records import MOVE_KIND, AliasMove, RegistryError, RegistryUsageError, check_alias

MAX_TRIES = 10_000  # create attempts before giving up (each lost race costs one listing and one read)


def current_user() -> str:
    """Who moves an alias: ``VATRA_USER`` (a CI job's or a service's name), else the login name."""
    try:
        return os.environ.get("VATRA_USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's anonymous uid)
        return f"uid{os.getuid()}"


def rollback_target(moves: list[AliasMove]) -> str | None:
    """The version a rollback moves to: promotes push their version, rollbacks pop one, and the
    alias returns to the one below the top; None when there is nothing below it."""
    stack: list[str] = []
    for move in moves:
        if move.action == "promote":
            stack.append(move.target)
        elif stack:
            stack.pop()
    return stack[-2] if len(stack) >= 2 else None


class AliasLog:
    """The alias histories of one registry (every name), on its backend."""

    def __init__(self, backend: StoreBackend, key: bytes | None) -> None:
        self.backend = backend
        self.key = key

    @staticmethod
    def folder(name: str, alias: str | None = None) -> str:
        return f"models/{name}/aliases/" + (f"{alias}/" if alias else "")

    def aliases(self, name: str) -> list[str]:
        prefix = self.folder(name)
        found = {k.removeprefix(prefix).split("/", 1)[0] for k in self.backend.keys(prefix)}
        return sorted(a for a in found if a)

    def moves(self, name: str, alias: str) -> list[AliasMove]:
        """Every move of ``alias``, oldest first; a damaged or tampered record raises, naming it."""
        prefix = self.folder(name, alias)
        out = []
        for key in self.backend.keys(prefix):
            stem = key.removeprefix(prefix).removesuffix(".json")
            if not stem.isdigit():
                continue
            record = decode_record(self.backend.get(key), MOVE_KIND, key, self.key)
            out.append(AliasMove.from_record(record, name, alias, int(stem), key))
        return sorted(out, key=lambda m: m.seq)

    def current(self, name: str, alias: str) -> str | None:
        moves = self.moves(name, alias)
        return moves[-1].target if moves else None

    def history(self, name: str) -> list[AliasMove]:
        """Every alias move of ``name``, in time order."""
        moves = [m for alias in self.aliases(name) for m in self.moves(name, alias)]
        return sorted(moves, key=lambda m: (m.time, m.alias, m.seq))

    def append(
        self,
        name: str,
        alias: str,
        action: str,
        target: Callable[[list[AliasMove]], str],
        reason: str,
        evidence: dict[str, Any] | None,
    ) -> AliasMove:
        """Append one move; ``target(moves so far)`` picks its version, again after each lost race."""
        check_alias(alias)
        prefix = self.folder(name, alias)
        for _ in range(MAX_TRIES):
            moves = self.moves(name, alias)
            seq = moves[-1].seq + 1 if moves else 0
            move = AliasMove(
                name,
                alias,
                seq,
                action,
                moves[-1].target if moves else None,
                target(moves),
                current_user(),
                time.time(),
                reason,
                evidence,
            )
            if self.backend.create(
                f"{prefix}{seq:010d}.json", encode_record(move.record(), MOVE_KIND, self.key)
            ):
                return move
        raise RegistryError(f"{name}@{alias}: lost {MAX_TRIES} races to move the alias; try again")

    def promote(
        self, name: str, alias: str, version: str, reason: str, evidence: dict[str, Any] | None = None
    ) -> AliasMove:
        return self.append(name, alias, "promote", lambda _moves: version, reason, evidence)

    def rollback(
        self, name: str, alias: str, reason: str, evidence: dict[str, Any] | None = None
    ) -> AliasMove:
        def target(moves: list[AliasMove]) -> str:
            if not moves:
                raise RegistryUsageError(f"{name}@{alias}: the alias was never set; nothing to roll back")
            back = rollback_target(moves)
            if back is None:
                raise RegistryUsageError(
                    f"{name}@{alias}: no earlier version in the alias's history to roll back to "
                    f"(it has {len(moves)} move(s)); promote the version you want instead"
                )
            return back

        return self.append(name, alias, "rollback", target, reason, evidence)
