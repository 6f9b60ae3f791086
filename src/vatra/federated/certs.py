"""``vatra fl certs``: a private CA, a TLS server certificate it signs, and one bearer token per client.

Layout of the folder (0700; keys and tokens are created with mode 0600, never readable by others
even for a moment, whatever the umask)::

    ca.pem  ca.key          the certificate authority (clients trust ca.pem)
    server.pem  server.key  the server's certificate (SAN: localhost, 127.0.0.1, ::1, extra hosts)
    tokens.json             {client id: sha256 of its token}  (server side: no token in clear)
    clients/<id>.token      the token client <id> presents (give each client only its own)
    .gitignore              "*": git never picks up the folder, wherever it lies
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from vatra._io import atomic_write
from vatra.errors import ConfigError

VALID_DAYS = 365


def _write(path: Path, data: bytes, private: bool = False) -> None:
    # Whole or not at all, and a private file (key, token) is 0600 from its first byte: no moment
    # where it is readable by others or half-written.
    atomic_write(path, data, private=private, durable=True)


def _private_dir(path: Path) -> None:
    """A folder only its owner can list or enter (it holds keys and tokens)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)  # an existing folder, or one the umask made narrower


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def generate(folder: Path, clients: int, hosts: list[str] | None = None, *, force: bool = False) -> None:
    """Write a fresh CA, server certificate and ``clients`` tokens into ``folder``.

    An existing CA is replaced only with ``force``: a new one invalidates every certificate and
    token handed out before.
    """
    if clients < 1:
        raise ConfigError(f"--clients {clients}: must be ≥ 1")
    if not force and ((folder / "ca.pem").exists() or (folder / "ca.key").exists()):
        raise ConfigError(
            f"{folder} already holds a CA; pass --force to replace it (every certificate and token "
            "it issued stops working) or choose another folder"
        )
    _private_dir(folder)
    _private_dir(folder / "clients")
    for old in (folder / "clients").glob("*.token"):  # tokens of a replaced CA must not linger
        old.unlink()
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vatra federated CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names = ["localhost", "127.0.0.1", "::1", *(hosts or [])]
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in dict.fromkeys(names)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write(folder / "ca.pem", ca_cert.public_bytes(pem))
    _write(folder / "ca.key", _key_pem(ca_key), private=True)
    _write(folder / "server.pem", srv_cert.public_bytes(pem))
    _write(folder / "server.key", _key_pem(srv_key), private=True)
    hashes_by_id = {}
    for c in range(clients):
        token = secrets.token_urlsafe(32)
        _write(folder / "clients" / f"{c}.token", token.encode(), private=True)
        hashes_by_id[str(c)] = token_hash(token)
    _write(folder / "tokens.json", json.dumps(hashes_by_id, indent=1).encode(), private=True)
    _write(
        folder / ".gitignore",
        b"# written by vatra fl certs: keys and tokens are secrets, never commit them\n*\n",
    )


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _need(path: Path) -> bytes:
    if not path.is_file():
        raise ConfigError(f"{path}: missing; create the folder with 'vatra fl certs DIR --clients N'")
    return path.read_bytes()


class ServerCredentials:
    """What the server loads: its key pair and the token hashes."""

    def __init__(self, folder: Path) -> None:
        self.key = _need(folder / "server.key")
        self.cert = _need(folder / "server.pem")
        self.tokens: dict[int, str] = {
            int(k): v for k, v in json.loads(_need(folder / "tokens.json")).items()
        }

    def check(self, client_id: int, token: str) -> bool:
        expected = self.tokens.get(client_id)
        return expected is not None and hmac.compare_digest(expected, token_hash(token))


def client_credentials(folder: Path, client_id: int) -> tuple[bytes, str]:
    """(CA certificate, this client's token)."""
    return _need(folder / "ca.pem"), _need(folder / "clients" / f"{client_id}.token").decode().strip()
