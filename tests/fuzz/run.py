"""One fuzz target under atheris (libFuzzer): ``python -m tests.fuzz.run TARGET CORPUS [libFuzzer flags]``.

The target's modules are imported with coverage instrumentation; an empty ``CORPUS`` folder is
filled with the target's seeds first, and ``-dict`` defaults to its tokens. A finding is an input
on which ``test_one_input`` raised (libFuzzer writes it as ``crash-<sha1>`` under
``-artifact_prefix``), ran past ``-timeout`` or grew past ``-rss_limit_mb``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

import atheris

INSTRUMENT = ("vatra", "tomllib", "tomli_w")  # coverage: vatra's decoders and the pure-Python TOML code


def _write_dict(tokens: list[bytes]) -> str:
    lines = ['"' + "".join(f"\\x{b:02x}" for b in token) + '"' for token in tokens]
    path = Path(tempfile.mkdtemp(prefix="vatra-fuzz-dict-")) / "tokens.dict"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit("usage: python -m tests.fuzz.run TARGET CORPUS_DIR [libFuzzer flags]")
    name, corpus = argv[1], Path(argv[2])
    from tests.fuzz.targets import MODULES, load

    if name not in MODULES:
        raise SystemExit(f"unknown target {name!r}; one of {', '.join(MODULES)}")
    with atheris.instrument_imports(include=list(INSTRUMENT)):
        target = load(name)
    corpus.mkdir(parents=True, exist_ok=True)
    if not any(corpus.iterdir()):
        for seed in [*target.seeds(), *target.findings()]:
            (corpus / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
    flags = argv[3:]
    if target.tokens and not any(f.startswith("-dict=") for f in flags):
        flags.append(f"-dict={_write_dict(list(target.tokens))}")
    prefix = next(
        (f.removeprefix("-artifact_prefix=") for f in flags if f.startswith("-artifact_prefix=")), ""
    )

    def one_input(data: bytes) -> None:
        try:
            target.test_one_input(data)
        except Exception:  # a finding: keep the input ourselves (libFuzzer's handler can stall on threads)
            path = Path(f"{prefix}crash-{hashlib.sha1(data).hexdigest()}")
            path.write_bytes(data)
            print("\n=== Uncaught Python exception: ===", file=sys.stderr)
            traceback.print_exc()
            print(f"Test unit written to {path}", file=sys.stderr, flush=True)
            os._exit(77)

    atheris.Setup([argv[0], *flags, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
