"""Transient Cloud Storage errors, retried for a bounded time by every client bertjax uses.

A 408, 429 or 5xx answer, a reset or refused connection, a body cut short and a stalled
transfer are transient: the request is retried with exponential backoff (0.5 s doubling to
30 s, jittered) until `retry_seconds()` have passed since its first failure (default
DEFAULT_RETRY_SECONDS; `BERTJAX_STORAGE_RETRY_SECONDS` sets it). After that the operation
fails with `StorageUnavailable`, an OSError whose message is one line naming the object,
the last status and how long it was retried.

`install()` puts the policy into both clients: gcsfs (every gs:// read, write and listing of
bertjax.runtime.files, and Orbax's own metadata files through etils epath, which uses the fsspec
registry) gets a file system class whose requests retry this way instead of gcsfs's fixed
6 tries (about 31 s); tensorstore (Orbax's arrays) gets a `gcs_request_retries` context
whose retries add up to the same time (its default is 32 retries of up to 32 s each: about
15 minutes in which a run could neither finish nor fail).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, BinaryIO, TypeVar

T = TypeVar("T")
RETRY_ENV = "BERTJAX_STORAGE_RETRY_SECONDS"
# Google's own storage client gives up on a retried request after 120 s (google-cloud-storage
# DEFAULT_RETRY): past that an outage is no longer a blip, and a run that waits longer only
# delays its relaunch.
DEFAULT_RETRY_SECONDS = 120.0
STALL_SECONDS = 60.0  # no byte read for this long: the request is abandoned (and retried)
FIRST_DELAY, MAX_DELAY = 0.5, 30.0


class StorageUnavailable(OSError):
    """A storage request still failed transiently after retrying for the allowed time."""

    def __init__(self, what: str, cause: str, seconds: float) -> None:
        super().__init__(
            f"{what}: {cause}, still after retrying for {seconds:.0f} s "
            f"(the storage is unavailable; {RETRY_ENV} sets how long to retry)"
        )
        self.what, self.cause, self.seconds = what, cause, seconds


def retry_seconds() -> float:
    """How long a transiently failing request is retried (`BERTJAX_STORAGE_RETRY_SECONDS`)."""
    value = os.environ.get(RETRY_ENV, "")
    try:
        return max(0.0, float(value)) if value.strip() else DEFAULT_RETRY_SECONDS
    except ValueError:
        raise ValueError(f"{RETRY_ENV}={value!r} is not a number of seconds") from None


def transient(error: BaseException) -> str | None:  # noqa: PLR0911 (one return per kind of transient error)
    """What made `error` transient ("HTTP 503 ...", "connection reset", ...); None if it is
    not (a 404, a 403, a bad request: retrying would not help)."""
    if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
        return f"no answer for {STALL_SECONDS:.0f} s"
    connection_errors: tuple[type, ...] = (ConnectionError,)
    if "gcsfs" in sys.modules:  # (otherwise no gs:// request was made: none of its errors)
        import aiohttp
        import requests
        from gcsfs import retry as gcs_retry

        if isinstance(error, gcs_retry.HttpError):
            return f"HTTP {error.code} ({error.message})" if gcs_retry.is_retriable(error) else None
        if isinstance(error, requests.exceptions.ProxyError):  # (gcsfs's account of a 502)
            return "HTTP 502 (bad gateway)"
        if isinstance(error, aiohttp.ClientResponseError):
            return (
                f"HTTP {error.status}"
                if error.status in (408, 429) or error.status >= 500
                else None
            )
        if isinstance(error, aiohttp.ClientPayloadError):
            return "the answer was cut short"
        connection_errors += (
            aiohttp.ClientError,
            gcs_retry.ChecksumError,
            requests.exceptions.ConnectionError,
        )
    if isinstance(error, connection_errors):
        return f"connection failed ({type(error).__name__}: {error})"
    return None


# How tensorstore (Orbax's arrays) reports a request that failed after its retries.
_TENSORSTORE_UNAVAILABLE = (
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED: HTTP",
    "HTTP response code: 5",
    "HTTP response code: 429",
)


def unavailable(error: BaseException | None) -> bool:
    """Whether `error` (or an error it was raised from) is a storage request that failed
    transiently: no proof that what it read is damaged or absent."""
    seen = 0
    while error is not None and seen < 20:
        if (
            isinstance(error, StorageUnavailable)
            or transient(error) is not None
            or any(text in str(error) for text in _TENSORSTORE_UNAVAILABLE)
        ):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _delay(attempt: int, remaining: float) -> float:
    return min(FIRST_DELAY * 2**attempt * (0.5 + random.random() / 2), MAX_DELAY, remaining)


async def call_async(operation: Callable[[], Awaitable[T]], what: str) -> T:
    """`await operation()`, retried while it fails transiently (see the module docstring)."""
    first_failure, attempt = None, 0
    while True:
        try:
            return await operation()
        except Exception as e:  # (classified below)
            cause = transient(e)
            if cause is None:
                raise
            first_failure = first_failure or time.monotonic()
            remaining = retry_seconds() - (time.monotonic() - first_failure)
            if remaining <= 0:
                raise StorageUnavailable(what, cause, time.monotonic() - first_failure) from e
            await asyncio.sleep(_delay(attempt, remaining))
            attempt += 1


def _object(url: str, params: dict[str, Any]) -> tuple[str, str]:
    """`(bucket, key)` of a JSON API URL (an upload's `name` parameter); key "" if none."""
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)
    if "/b/" not in path:
        return "", ""
    query = dict(urllib.parse.parse_qsl(parts.query))
    bucket, _, rest = path.split("/b/", 1)[1].partition("/")
    return bucket, params.get("name") or query.get("name") or (
        rest[2:] if rest.startswith("o/") else ""
    )


def _final_chunk(method: str, url: str, headers: dict | None) -> tuple[int, int] | None:
    """`(first byte, total size)` of a resumable upload's last chunk request, else None."""
    found = (headers or {}).get("Content-Range", "")
    if method != "POST" or "upload_id=" not in url or "/" not in found:
        return None
    first_last, _, total = found.removeprefix("bytes ").partition("/")
    if total == "*":
        return None
    if first_last == "*":  # (no bytes in this request: it finalizes the object at `total`)
        return int(total), int(total)
    if int(first_last.split("-")[1]) != int(total) - 1:
        return None
    return int(first_last.split("-")[0]), int(total)


def _crc32c(data: bytes | bytearray | memoryview | BinaryIO) -> str:
    """GCS's `crc32c` field (base64 of the big-endian CRC32C) of `data` (a buffer, or a stream
    read from its start)."""
    import base64

    import google_crc32c

    if not isinstance(data, (bytes, bytearray, memoryview)):
        data.seek(0)
        data = data.read()
    return base64.b64encode(google_crc32c.Checksum(bytes(data)).digest()).decode()


@functools.cache
def gcs_class() -> type:
    """gcsfs's file system with `call_async`'s retries in place of its own, and stalled
    transfers abandoned after STALL_SECONDS without a byte."""
    import aiohttp
    import gcsfs

    raw = gcsfs.GCSFileSystem._request.__wrapped__  # (without gcsfs's 6 fixed tries)

    class RetryingGCSFileSystem(gcsfs.GCSFileSystem):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault(
                "requests_timeout",
                aiohttp.ClientTimeout(sock_connect=STALL_SECONDS, sock_read=STALL_SECONDS),
            )
            super().__init__(*args, **kwargs)

        async def _request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            url = self._format_path(path, args)
            bucket, key = _object(url, kwargs)
            final = _final_chunk(method, url, kwargs.get("headers"))
            tries = []

            async def once() -> Any:
                tries.append(1)
                if final and len(tries) > 1:  # the last try may have committed the object
                    committed = await self._committed(bucket, key, final, kwargs.get("data"))
                    if committed:
                        return committed
                return await raw(self, method, path, *args, **kwargs)

            return await call_async(
                once, f"gs://{bucket}/{key}" if bucket else url.split("?", 1)[0]
            )

        async def _committed(self, bucket: str, key: str, final: tuple[int, int], data: Any) -> Any:
            """The object's record if an upload of it of size `final[1]` was committed (its
            crc32c matching `data` too when that chunk is the whole object), else None."""
            try:
                answer = await raw(self, "GET", "b/{}/o/{}", bucket, key)
            except FileNotFoundError:
                return None
            record = json.loads(answer[3])
            if int(record.get("size", -1)) != final[1] or (
                final[0] == 0 and record.get("crc32c") != _crc32c(data)
            ):
                return None
            return answer

    return RetryingGCSFileSystem


def tensorstore_retries(seconds: float) -> dict[str, Any]:
    """tensorstore's `gcs_request_retries` whose delays (1 s doubling to 32 s) add up to
    at least `seconds`."""
    retries, total = 0, 0.0
    while total < seconds:
        total += min(2**retries, 32)
        retries += 1
    return {"max_retries": max(retries, 1), "initial_delay": "1s", "max_delay": "32s"}


def install_gcsfs() -> None:
    """Makes `gcs_class()` fsspec's file system for `gs://` (bertjax.runtime.files and etils epath
    get it from the registry); a no-op without gcsfs."""
    try:
        import fsspec

        cls = gcs_class()
    except ImportError:
        return
    for protocol in ("gs", "gcs"):
        if fsspec.registry.get(protocol) is not cls:
            fsspec.register_implementation(protocol, cls, clobber=True)


def install_tensorstore() -> None:
    """Puts `tensorstore_retries(retry_seconds())` into the tensorstore contexts Orbax makes
    from now on (read again at each call)."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    retries = tensorstore_retries(retry_seconds())
    for context in (
        tensorstore_utils._BASE_TS_CONTEXT,  # (copied into each new context)
        tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT,
    ):
        context["gcs_request_retries"] = retries
