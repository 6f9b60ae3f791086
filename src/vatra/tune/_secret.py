"""Database passwords in storage URLs: kept out of every file, log, event and command line.

A ``postgresql://user:PASSWORD@host/db`` URL (or ``...?password=PASSWORD``) is split in two:
the URL without its password is what ``config.toml``, ``study.json``, the report and the workers'
command lines carry; the password reaches this process's connection as an argument and the workers
as ``PGPASSWORD`` in their environment, which libpq (under psycopg) reads itself, as it reads
``PGPASSFILE`` and ``~/.pgpass`` when no password is given at all.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from vatra._extras import require
from vatra.errors import ConfigError

PASSWORD_ENV = "PGPASSWORD"
# query or key=value keys whose value is a secret (libpq's names; matched after percent-decoding)
SECRET_KEYS = frozenset({"password", "sslpassword"})
# SQLAlchemy schemes whose driver is on libpq, which reads PGPASSWORD, PGPASSFILE and ~/.pgpass
LIBPQ_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2")

# scheme://user:PASSWORD@ — the password runs to the last "@" before any white space: a password
# may hold "@", ":", "/" or "?" unencoded, and when unsure more is hidden, never less
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s]*):(?P<secret>\S*)@")
# key=value in a query (?a=1&b=2) or a libpq key/value string (host=h password='p w')
_PARAM = re.compile(
    r"(?P<head>(?:^|[?&;\s])(?P<key>[^=&?#;\s]+)\s*=\s*)(?P<secret>'(?:[^'\\]|\\.)*'?|[^&#;\s]*)"
)


def redact(text: str) -> str:
    """``text`` (a storage URL, or a message that holds one) with every password as ``***``."""
    text = _USERINFO.sub(lambda m: f"{m['head']}:***@", text)

    def param(m: re.Match[str]) -> str:
        return f"{m['head']}***" if unquote(m["key"]).lower() in SECRET_KEYS else m[0]

    return _PARAM.sub(param, text)


def split_password(url: str) -> tuple[str, str | None]:
    """``(url without its password, the password or None)``, read as SQLAlchemy reads the URL
    (user:password@ or a ``password`` query key, percent-encoded or not). A path (the journal file)
    or a URL without a password comes back as it is."""
    if "://" not in url:
        return url, None
    require("sqlalchemy", "tune", "tune.storage URLs")  # optuna's RDB storage is on it
    from sqlalchemy.engine import URL, make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigError(
            f"tune.storage {redact(url)!r}: not a database URL; expected postgresql://user@host:port/db"
        ) from None
    if "@" in (parsed.host or ""):  # user:p@ss@host: SQLAlchemy would take "ss@host" for the host
        raise ConfigError(
            f"tune.storage {redact(url)!r}: the password holds '@'; write it %40, or better leave it "
            "out of the URL and set PGPASSWORD or use ~/.pgpass"
        )
    keys = {unquote(k).lower(): k for k in parsed.query}
    if parsed.password is None and "password" not in keys and not SECRET_KEYS & keys.keys():
        return url, None
    if parsed.drivername not in LIBPQ_SCHEMES or SECRET_KEYS - {"password"} & keys.keys():
        raise ConfigError(
            f"tune.storage {redact(url)!r}: a secret in this URL would be written to config.toml "
            "and worker command lines; leave it out: a postgresql:// storage takes the password "
            "from PGPASSWORD or ~/.pgpass"
        )
    password = parsed.password
    if password is None:
        given = parsed.query[keys["password"]]
        password = given if isinstance(given, str) else given[-1]
    bare = URL.create(
        parsed.drivername,
        username=parsed.username,
        host=parsed.host,
        port=parsed.port,
        database=parsed.database,
        query={k: v for k, v in parsed.query.items() if k != keys.get("password")},
    )
    return bare.render_as_string(hide_password=False), str(password) or None
