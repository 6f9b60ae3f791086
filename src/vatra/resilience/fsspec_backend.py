"""Store backend over any fsspec filesystem: a local directory (default) or ``s3://bucket/prefix``."""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import fsspec

from vatra._extras import MissingExtra
from vatra._io import TEMP_MARK, atomic_write, fsync_dir
from vatra.resilience._base import MissingKey, StoreBackend, StoreError

STORE_PREFIXES = ("objects/", "versions/", "tags/", ".deleted/")  # the folders a store writes


def _makedirs(path: Path) -> None:
    """``mkdir -p`` that also fsyncs the parent of every folder it creates."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        fsync_dir(folder.parent)


class FsspecBackend(StoreBackend):
    """Keys are paths under ``url``: a local directory, or any fsspec URL (``s3://bucket/prefix``).

    Local writes are durable and atomic: the bytes go to a temporary name in the target folder,
    are fsynced, renamed into place, and the folder is fsynced; a failed write removes its
    temporary file. So a crash or a full disk leaves the old object or the new one, never a
    partial one under its content address. Remote writes rely on the object store's atomic PUT.
    """

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **(options or {}))
        except ImportError as err:
            scheme = self.url.split("://", 1)[0]
            if scheme in ("s3", "s3a"):
                raise MissingExtra(
                    f"store.url {url!r} needs the package 's3fs', which is not installed: "
                    "pip install 'vatra[s3]'"
                ) from None
            raise StoreError(f"store.url {url!r}: {err}") from None
        except (ValueError, TypeError) as err:
            raise StoreError(f"store.url {url!r}: {err}") from None
        self.local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )
        # What a failing medium raises: OSError locally; a remote client's own errors too (botocore's
        # EndpointConnectionError is no OSError), so an unreachable endpoint is one StoreError line.
        self._fails: tuple[type[Exception], ...] = (OSError,) if self.local else (Exception,)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _error(self, action: str, key: str, err: Exception) -> StoreError:
        """One line; a full disk names the store's folder, the thing to free space on."""
        if not isinstance(err, OSError):
            return StoreError(f"{action} {self.url}/{key}: {type(err).__name__}: {err}")
        if err.errno == errno.ENOSPC:
            return StoreError(
                f"{action} {self.url}/{key}: no space left on the device holding {self.url}; "
                "free space there and run again (the versions already stored are intact)"
            )
        return StoreError(f"{action} {self.url}/{key}: {err.strerror or err}")

    def _write_local(self, target: Path, fill: Callable[[BinaryIO], object]) -> None:
        """``fill`` a temporary file beside ``target``, fsync it, rename it into place, fsync the folder."""
        _makedirs(target.parent)
        atomic_write(target, fill, durable=True)

    def put(self, key: str, data: bytes) -> None:
        try:
            if self.local:
                self._write_local(Path(self._path(key)), lambda f: f.write(data))
            else:
                self.fs.pipe_file(self._path(key), data)  # S3 PUT is atomic per object
        except self._fails as err:
            raise self._error("write", key, err) from None

    def put_file(self, key: str, path: Path) -> None:
        """Local: fsync and rename into place (no second copy of the bytes); remote: upload.

        Across filesystems a rename is impossible: the file is copied to a temporary name beside
        the target and renamed from there, then the source is removed.
        """
        target = Path(self._path(key))
        try:
            if not self.local:
                self.fs.put_file(str(path), self._path(key))
                return
            with path.open("rb") as f:
                os.fsync(f.fileno())  # the bytes must be on disk before their name is
            _makedirs(target.parent)
            try:
                os.rename(path, target)
            except OSError as err:
                if err.errno != errno.EXDEV:
                    raise
                with path.open("rb") as src:
                    self._write_local(target, lambda f: shutil.copyfileobj(src, f, 8 << 20))
                path.unlink()
            else:
                fsync_dir(target.parent)
        except self._fails as err:
            raise self._error("write", key, err) from None

    def _fresh(self, path: str) -> str:
        """``path``, with a remote filesystem's cached listing of it dropped: s3fs answers
        ``exists`` and ``cat_file`` from a listing an earlier ``find`` cached, which cannot know
        what other ranks or hosts uploaded since."""
        if not self.local:
            self.fs.invalidate_cache(path)
        return path

    def get(self, key: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._fresh(self._path(key))))
        except FileNotFoundError:
            raise MissingKey(f"{self.url}/{key}: missing") from None
        except self._fails as err:
            raise self._error("read", key, err) from None

    def exists(self, key: str) -> bool:
        try:
            return bool(self.fs.exists(self._fresh(self._path(key))))
        except self._fails as err:
            raise self._error("stat", key, err) from None

    def create(self, key: str, data: bytes) -> bool:
        """Locally: the bytes go to a fsynced temporary file that is hard-linked to the key (``link``
        fails when the name exists, atomically, even across processes). On S3: a conditional PUT
        (``If-None-Match: *``), which S3 answers 412 when the key exists. Other filesystems refuse."""
        if self.local:
            target = Path(self._path(key))
            tmp = target.with_name(f"{target.name}{TEMP_MARK}{os.urandom(4).hex()}")
            try:
                _makedirs(target.parent)
                atomic_write(tmp, data, durable=True)
                try:
                    os.link(tmp, target)
                except FileExistsError:
                    return False
                fsync_dir(target.parent)
                return True
            except self._fails as err:
                raise self._error("write", key, err) from None
            finally:
                tmp.unlink(missing_ok=True)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if not {"s3", "s3a"} & set(protocols):
            return super().create(key, data)
        try:
            self.fs.pipe_file(self._path(key), data, mode="create")
            return True
        except FileExistsError:
            return False
        except self._fails as err:
            raise self._error("write", key, err) from None

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass
        except self._fails as err:
            raise self._error("delete", key, err) from None

    def _find(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, temporary files included."""
        base = self._path(prefix.rstrip("/"))
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        except self._fails as err:
            raise self._error("list", prefix, err) from None
        cut = len(self.root.rstrip("/")) + 1
        return sorted(p[cut:] if p.startswith(self.root.rstrip("/")) else p for p in found)

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self._find(prefix) if TEMP_MARK not in k]

    def sweep(self, older_than_s: float) -> list[str]:
        """Remove temporary files of local writes that died (none exist on a remote store)."""
        if not self.local:
            return []
        removed = []
        cutoff = time.time() - older_than_s
        for prefix in STORE_PREFIXES:
            for key in self._find(prefix):
                path = Path(self._path(key))
                try:
                    if TEMP_MARK in key and path.stat().st_mtime < cutoff:
                        path.unlink()
                        removed.append(key)
                except FileNotFoundError:
                    continue  # its writer finished or removed it meanwhile
                except self._fails as err:
                    raise self._error("delete", key, err) from None
        return removed

    def describe(self) -> str:
        return self.url
