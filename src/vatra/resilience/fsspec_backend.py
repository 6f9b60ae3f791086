"""Store backend over any fsspec filesystem: a local directory (default) or ``s3://bucket/prefix``."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import fsspec

from vatra._extras import MissingExtra
from vatra.resilience._base import StoreBackend, StoreError


class FsspecBackend(StoreBackend):
    """Keys are paths under ``url``. Local writes go to a temporary name and are renamed into place."""

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

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            if self.local:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                self.fs.pipe_file(tmp, data)
                self.fs.mv(tmp, path)  # rename: readers never see a partial object
            else:
                self.fs.pipe_file(path, data)  # S3 PUT is atomic per object
        except OSError as err:
            raise StoreError(f"write {self.url}/{key}: {err}") from None

    def put_file(self, key: str, path: Path) -> None:
        """Local: rename into place (no second copy of the bytes); remote: upload."""
        target = self._path(key)
        try:
            if self.local:
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                shutil.move(path, target)  # a rename on the same filesystem
            else:
                self.fs.put_file(str(path), target)
        except OSError as err:
            raise StoreError(f"write {self.url}/{key}: {err}") from None

    def get(self, key: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._path(key)))
        except FileNotFoundError:
            raise StoreError(f"{self.url}/{key}: missing") from None
        except OSError as err:
            raise StoreError(f"read {self.url}/{key}: {err}") from None

    def exists(self, key: str) -> bool:
        try:
            return bool(self.fs.exists(self._path(key)))
        except OSError as err:
            raise StoreError(f"stat {self.url}/{key}: {err}") from None

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as err:
            raise StoreError(f"delete {self.url}/{key}: {err}") from None

    def keys(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/"))
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        except OSError as err:
            raise StoreError(f"list {self.url}/{prefix}: {err}") from None
        cut = len(self.root.rstrip("/")) + 1
        keys = [p[cut:] if p.startswith(self.root.rstrip("/")) else p for p in found]
        return sorted(k for k in keys if ".tmp-" not in k)

    def describe(self) -> str:
        return self.url
