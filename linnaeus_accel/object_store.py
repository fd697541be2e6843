"""The object stores a bucket URL names (``ENV.OUTPUT.BUCKET.URL``), behind one small interface.

``FsspecStore`` covers s3:// (s3fs: AWS and every S3-compatible store), gs:// (gcsfs) and file://
(a mounted shared directory); ``B2Store`` covers b2:// through b2sdk, which B2 accounts used before
URLs existed. Keys are relative to the URL's bucket and prefix, '/'-separated.

Credentials and endpoints come only from each library's own chain (for s3: AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws; for b2: B2_APPLICATION_KEY_ID and
B2_APPLICATION_KEY): nothing here reads, stores or formats them.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

KEY_ID_VAR = "B2_APPLICATION_KEY_ID"
KEY_VAR = "B2_APPLICATION_KEY"
# A file:// store writes each file under this name first and renames it: a reader on another node
# never sees half a file under its real name (NFS renames atomically). Listings skip these names.
_PARTIAL = ".linnaeus-partial-"
# b2sdk errors no wait fixes (b2sdk retries the transient ones itself, then raises them to us).
_B2_PERMANENT = frozenset(
    [
        "InvalidUploadSource",
        "AccessDenied",
        "NotAllowedByAppKeyError",
        "FileNotPresent",
        "NonExistentBucket",
        "BucketIdNotFound",
        "BadRequest",
        "RestrictedBucket",
        "CapExceeded",
    ]
)
# OSErrors a wait can fix: a store's 5xx and throttling (s3fs maps them to EIO, EREMOTEIO, EBUSY),
# an NFS server restarting (ESTALE, ETIMEDOUT), a connection dropped.
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("EIO", "EREMOTEIO", "EBUSY", "EAGAIN", "ETIMEDOUT", "ESTALE", "ECONNRESET", "ECONNABORTED")
    if hasattr(errno, name)
)


# The URL schemes a bucket may have, each a store below.
SCHEMES: tuple[str, ...] = ("s3", "gs", "file", "b2")


def split_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, prefix) of a bucket URL; for file://, the bucket is empty and the prefix is
    the absolute directory. ValueError, in words, for a URL that names no usable bucket."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        schemes = ", ".join(f"{s}://" for s in SCHEMES)
        raise ValueError(f"{url!r} is not a bucket URL: it must start with one of {schemes}")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} has a query or fragment: a bucket URL is <scheme>://<bucket>/<prefix>")
    if scheme == "file":
        path = parts.path.rstrip("/")
        if parts.netloc not in ("", "localhost") or not path.startswith("/"):
            raise ValueError(f"{url!r} names no absolute directory: write file:///abs/path (three slashes)")
        return scheme, "", path
    if "@" in parts.netloc or ":" in parts.netloc:
        # Credentials in a URL end up in config.yaml and logs; endpoints have their own variables.
        raise ValueError(
            f"{scheme}:// URLs hold only <bucket>/<prefix>: credentials and endpoints come from the environment"
        )
    if not parts.netloc:
        raise ValueError(f"{url!r} names no bucket: write {scheme}://<bucket>/<prefix>")
    return scheme, parts.netloc, parts.path.strip("/")


class RemoteSyncError(RuntimeError):
    """A bucket operation failed for good (after retries), or the bucket cannot be used."""


class ObjectStore(Protocol):
    """Flat keys under one root. ``get_*`` raise FileNotFoundError for a missing key."""

    @property
    def describe(self) -> str:
        """The store's URL, for messages."""

    def list(self, prefix: str) -> dict[str, int]:
        """Every key under the folder ``prefix`` ('' is the whole store), recursively, with its size."""

    def put_file(self, local: Path, key: str) -> None: ...
    def get_file(self, key: str, local: Path) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...

    def delete(self, key: str) -> None:
        """Remove the key (every version, where the store keeps versions); a missing key is fine."""

    def exists(self, key: str) -> bool: ...

    def retryable(self, error: BaseException) -> bool:
        """Whether waiting may fix ``error`` (network, 5xx, throttling), not (missing, refused)."""


def open_store(url: str, timeout_s: float | None = None) -> ObjectStore:
    """The store a bucket URL names (``split_url``). ``timeout_s``: how long one s3:// request may
    wait to connect or for the next bytes (``ENV.OUTPUT.BUCKET.TIMEOUT_S``; None: botocore's 60 s)."""
    scheme, bucket, prefix = split_url(url)
    if scheme == "b2":
        return B2Store.from_environment(bucket, prefix)
    return FsspecStore(scheme, bucket, prefix, fs=_filesystem(scheme, timeout_s))


class FsspecStore:
    """s3://, gs:// and file:// through fsspec, the interface Lightning and torchtitan take too."""

    def __init__(self, scheme: str, bucket: str, prefix: str, fs: Any = None) -> None:
        self.scheme = scheme
        self._root = prefix if scheme == "file" else f"{bucket}/{prefix}".rstrip("/")
        self.describe = f"{scheme}://{self._root}"
        self._local = scheme == "file"
        self._fs = fs if fs is not None else _filesystem(scheme)

    def __repr__(self) -> str:
        return f"FsspecStore({self.describe!r})"

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}" if key else self._root

    def list(self, prefix: str) -> dict[str, int]:
        if self._local and not os.path.isdir(self._root):  # an unmounted share: not an empty bucket
            if os.path.exists(self._root):
                raise NotADirectoryError(errno.ENOTDIR, "a file, not a directory", self._root)
            raise FileNotFoundError(errno.ENOENT, "no such directory", self._root)
        found = self._fs.find(self._path(prefix.strip("/")), detail=True)
        return {
            path[len(self._root) + 1 :]: int(info.get("size") or 0)
            for path, info in found.items()
            if not path.rpartition("/")[2].startswith(_PARTIAL)
        }

    def put_file(self, local: Path, key: str) -> None:
        self._write(key, lambda path: self._fs.put_file(str(local), path))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write(key, lambda path: self._fs.pipe_file(path, data))

    def get_file(self, key: str, local: Path) -> None:
        self._fs.get_file(self._path(key), str(local))

    def get_bytes(self, key: str) -> bytes:
        return bytes(self._fs.cat_file(self._path(key)))

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self._path(key))
        if self._local:  # empty step directories would pile up on a share
            parent = Path(self._path(key)).parent
            while parent != Path(self._root) and parent.is_relative_to(self._root):
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def exists(self, key: str) -> bool:
        return bool(self._fs.exists(self._path(key)))

    def retryable(self, error: BaseException) -> bool:
        if isinstance(
            error,
            FileNotFoundError | PermissionError | FileExistsError | IsADirectoryError | NotADirectoryError,
        ):
            return False
        if isinstance(error, TimeoutError | ConnectionError):
            return True
        if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
            return True
        if self.scheme == "s3":
            from botocore.exceptions import ConnectionError as EndpointUnreachable
            from s3fs.core import S3_RETRYABLE_ERRORS

            return isinstance(error, (EndpointUnreachable, *S3_RETRYABLE_ERRORS))
        if self.scheme == "gs":
            from gcsfs.retry import is_retriable

            return bool(is_retriable(error))
        return False

    def _write(self, key: str, write: Callable[[str], object]) -> None:
        final = self._path(key)
        if not self._local:
            write(final)
            return
        head, _, name = final.rpartition("/")
        tmp = f"{head}/{_PARTIAL}{uuid.uuid4().hex[:8]}-{name}"
        for attempt in range(3):
            try:
                os.makedirs(head, exist_ok=True)
                write(tmp)
                os.replace(tmp, final)
                return
            except FileNotFoundError:
                # Another machine's delete removed the directory, empty, between its creation and
                # this write (a share where several machines write one step): create it again.
                Path(tmp).unlink(missing_ok=True)
                if attempt == 2:
                    raise
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise


def _filesystem(scheme: str, timeout_s: float | None = None) -> Any:
    extra = {"s3": "s3", "gs": "gcs"}.get(scheme)
    try:
        import fsspec

        if scheme == "file":
            return fsspec.filesystem("file", auto_mkdir=True)
        options: dict[str, Any] = {}
        if scheme == "s3" and timeout_s is not None:
            # botocore's defaults (60 s each, retried) let an endpoint that accepts connections and
            # never answers hold a transfer for minutes: each request fails after this long instead.
            options["config_kwargs"] = {"connect_timeout": timeout_s, "read_timeout": timeout_s}
        # No listing cache, no shared instance: other processes and nodes write the same bucket.
        return fsspec.filesystem(scheme, skip_instance_cache=True, use_listings_cache=False, **options)
    except ImportError:
        raise RemoteSyncError(
            f"{scheme}:// buckets need the {extra} extra: pip install 'linnaeus-accel[{extra}]'"
        ) from None


class B2Store:
    """b2:// through b2sdk; ``bucket`` is an authorized ``b2sdk.v2.Bucket``."""

    def __init__(self, bucket: Any, prefix: str) -> None:
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self.describe = "/".join(p for p in ("b2:/", str(bucket.name), self._prefix) if p)

    @classmethod
    def from_environment(cls, bucket: str, prefix: str, *, api: Any = None) -> B2Store:
        """Authorize with ``B2_APPLICATION_KEY_ID`` / ``B2_APPLICATION_KEY``; ``api``: an unauthorized
        ``B2Api`` to use instead of a new one (tests pass one backed by b2sdk's simulator)."""
        try:
            from b2sdk.v2 import B2Api, InMemoryAccountInfo
            from b2sdk.v2.exception import B2Error
        except ImportError:
            raise RemoteSyncError(
                "b2:// buckets need the b2 extra: pip install 'linnaeus-accel[b2]'"
            ) from None
        key_id, key = os.environ.get(KEY_ID_VAR), os.environ.get(KEY_VAR)
        if not key_id or not key:
            missing = [name for name, value in ((KEY_ID_VAR, key_id), (KEY_VAR, key)) if not value]
            raise RemoteSyncError(
                f"b2:// buckets need B2 credentials in the environment: set {' and '.join(missing)}"
            )
        # In-memory account info: b2sdk's default (SqliteAccountInfo) would write the key to ~/.b2_account_info.
        api = api if api is not None else B2Api(InMemoryAccountInfo())
        try:
            api.authorize_account(realm="production", application_key_id=key_id, application_key=key)
        except B2Error as e:
            # `from None`: the chained exception carries nothing we need and we vouch for no third-party text.
            raise RemoteSyncError(
                f"B2 authorization with {KEY_ID_VAR}/{KEY_VAR} failed ({type(e).__name__})"
            ) from None
        try:
            return cls(api.get_bucket_by_name(bucket), prefix)
        except B2Error as e:
            raise RemoteSyncError(f"B2 bucket {bucket!r} is not usable: {type(e).__name__}: {e}") from None

    def __repr__(self) -> str:
        return f"B2Store({self.describe!r})"

    def _name(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def list(self, prefix: str) -> dict[str, int]:
        skip = len(self._prefix) + 1 if self._prefix else 0
        folder = self._name(prefix.strip("/"))
        return {
            str(v.file_name)[skip:]: int(v.size or 0)
            for v, _ in self._bucket.ls(folder, latest_only=True, recursive=True)
        }

    def put_file(self, local: Path, key: str) -> None:
        self._bucket.upload_local_file(str(local), self._name(key))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._bucket.upload_bytes(data, self._name(key))

    def get_file(self, key: str, local: Path) -> None:
        self._download(key).save_to(str(local))

    def get_bytes(self, key: str) -> bytes:
        out = io.BytesIO()
        self._download(key).save(out)
        return out.getvalue()

    def delete(self, key: str) -> None:
        name = self._name(key)
        for v in list(self._bucket.list_file_versions(name)):
            self._bucket.delete_file_version(v.id_, v.file_name)

    def exists(self, key: str) -> bool:
        return any(True for _ in self._bucket.list_file_versions(self._name(key), fetch_count=1))

    def retryable(self, error: BaseException) -> bool:
        from b2sdk.v2 import exception as b2

        # InvalidUploadSource: a local file that vanished (local retention) or cannot be read.
        permanent = tuple(getattr(b2, name) for name in _B2_PERMANENT)
        if isinstance(error, b2.Unauthorized) and not isinstance(error, b2.InvalidAuthToken):
            return False
        return isinstance(error, b2.B2Error) and not isinstance(error, permanent)

    def _download(self, key: str) -> Any:
        from b2sdk.v2.exception import FileNotPresent

        try:
            return self._bucket.download_file_by_name(self._name(key))
        except FileNotPresent:
            raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.describe}/{key}") from None
