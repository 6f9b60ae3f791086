"""The traffic split of an A/B test: weights per alias, sticky per request key."""

from __future__ import annotations

import hashlib
import random
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

from vatra.errors import ConfigError

_SCALE = float(1 << 64)


@dataclass(frozen=True)
class Split:
    """Aliases and their shares of the traffic (the shares sum to 1).

    :meth:`choose` maps a request key to a variant through a hash of the key, so the same key gets
    the same variant in every request, every server process and after a restart; a request without
    a key gets a random variant. Changing the weights moves only the keys whose hash falls in the
    share that moved (the variants keep their order)."""

    aliases: tuple[str, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.aliases or len(self.aliases) != len(self.weights):
            raise ConfigError("a split needs one weight per alias, e.g. champion=0.9,challenger=0.1")
        if len(set(self.aliases)) != len(self.aliases):
            raise ConfigError(f"a split names an alias twice: {','.join(self.aliases)}")
        if abs(sum(self.weights) - 1.0) > 1e-9:
            raise ConfigError(f"a split's weights must sum to 1, not {sum(self.weights)}")

    @classmethod
    def parse(cls, text: str) -> Split:
        """``"champion=0.9,challenger=0.1"`` (weights are normalised: ``a=9,b=1`` is the same split)."""
        aliases: list[str] = []
        raw: list[float] = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            alias, sep, weight = part.partition("=")
            try:
                w = float(weight) if sep else float("nan")
            except ValueError:
                w = float("nan")
            if not alias.strip() or not w > 0 or w == float("inf"):
                raise ConfigError(
                    f"--ab {text!r}: {part!r} is not alias=weight with a positive weight"
                    " (e.g. --ab champion=0.9,challenger=0.1)"
                )
            aliases.append(alias.strip())
            raw.append(w)
        if not aliases:
            raise ConfigError("--ab is empty: give alias=weight pairs, e.g. champion=0.9,challenger=0.1")
        total = sum(raw)
        return cls(tuple(aliases), tuple(w / total for w in raw))

    @classmethod
    def single(cls, alias: str) -> Split:
        return cls((alias,), (1.0,))

    def choose(self, key: str | None) -> str:
        """The alias that serves a request with this key (``None``: a random one, by weight)."""
        if len(self.aliases) == 1:
            return self.aliases[0]
        if key is None:
            u = random.random()
        else:  # the first 8 bytes of sha256 as a uniform number in [0, 1)
            digest = hashlib.sha256(key.encode("utf-8")).digest()
            u = int.from_bytes(digest[:8], "big") / _SCALE
        i = bisect_right(self._bounds, u)
        return self.aliases[min(i, len(self.aliases) - 1)]  # u just under 1 with rounded bounds

    @cached_property
    def _bounds(self) -> list[float]:
        return list(accumulate(self.weights))

    def describe(self) -> str:
        return ", ".join(f"{a} {w:.0%}" for a, w in zip(self.aliases, self.weights, strict=True))
