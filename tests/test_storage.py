"""bertjax.runtime.storage's reading of what a request is, without a store: which requests finalize a
resumable upload (those are checked, not blindly repeated, after an ambiguous answer), and
which errors are transient."""

import pytest

from bertjax.runtime import storage

UPLOAD = "https://storage.googleapis.com/upload/storage/v1/b/bkt/o?uploadType=resumable&upload_id=7"


@pytest.mark.parametrize(
    "content_range, final",
    [
        ("bytes 0-99/100", (0, 100)),  # the whole object in one chunk
        ("bytes 256-299/300", (256, 300)),  # the last chunk of several
        ("bytes */0", (0, 0)),  # an empty object (e.g. a preparation's claim)
        ("bytes */300", (300, 300)),  # no bytes: finalizes what was sent before
        ("bytes 0-255/*", None),  # a middle chunk: the size is not known yet
        ("bytes 0-255/300", None),  # a middle chunk of a known size
    ],
)
def test_the_final_chunk_of_a_resumable_upload(content_range, final):
    assert storage._final_chunk("POST", UPLOAD, {"Content-Range": content_range}) == final


def test_only_resumable_upload_posts_are_final_chunks():
    headers = {"Content-Range": "bytes 0-99/100"}
    assert storage._final_chunk("PUT", UPLOAD, headers) is None
    assert storage._final_chunk("POST", UPLOAD.split("&upload_id", maxsplit=1)[0], headers) is None
    assert storage._final_chunk("POST", UPLOAD, None) is None


def test_transient_errors_without_a_gcs_client():
    assert storage.transient(TimeoutError()).startswith("no answer for")
    assert storage.transient(ConnectionResetError("reset")).startswith("connection failed")
    assert storage.transient(FileNotFoundError("gone")) is None


def _failing(failures: int, error: Exception) -> tuple[list, object]:
    """An operation that fails with `error` `failures` times, then returns "done"."""
    calls = []

    async def operation():
        calls.append(1)
        if len(calls) <= failures:
            raise error
        return "done"

    return calls, operation


def test_the_retry_loop_retries_transient_failures_until_its_time_is_up(monkeypatch):
    """The loop itself (issue 43: a loop that gave up at once was caught only by the gcs
    stage): transient failures are retried, the others are not, and an outage ends after
    the retry time with StorageUnavailable naming the request and the cause."""
    import asyncio

    monkeypatch.setattr(storage, "FIRST_DELAY", 0.01)
    monkeypatch.setenv(storage.RETRY_ENV, "30")
    calls, operation = _failing(3, ConnectionResetError("reset"))
    assert asyncio.run(storage.call_async(operation, "gs://b/o")) == "done"
    assert len(calls) == 4
    calls, operation = _failing(3, FileNotFoundError("gone"))
    with pytest.raises(FileNotFoundError):
        asyncio.run(storage.call_async(operation, "gs://b/o"))
    assert len(calls) == 1
    monkeypatch.setenv(storage.RETRY_ENV, "0.3")
    calls, operation = _failing(10**6, ConnectionResetError("reset"))
    with pytest.raises(
        storage.StorageUnavailable,
        match=r"^gs://b/o: connection failed "
        r"\(ConnectionResetError: reset\), still after retrying for 0 s",
    ):
        asyncio.run(storage.call_async(operation, "gs://b/o"))
    assert len(calls) > 3
