"""Whether this process was frozen (stopped with SIGSTOP, its host suspended) long enough for
the other processes of a multi-process run to give up on it: a thread that sleeps `TICK_S` at
a time notices sleeps that lasted much longer (`watch`, `recent`). A process that wakes to
find the others gone then says it was frozen, instead of blaming them
(bertjax.runtime.peers)."""

from __future__ import annotations

import threading
import time

TICK_S = 0.5  # how often the clock thread looks
AFTER_S = 30.0  # how long after a freeze (beyond the heartbeat timeout) it is still news
_state: dict[str, tuple[float, float] | float | None] = {"tick": None, "stall": None}


def watch(heartbeat_s: float) -> None:
    """Starts the clock thread: from now on a freeze of half `heartbeat_s` or more (the
    others give up after `heartbeat_s` without a heartbeat) is recorded."""
    _state["tick"] = time.monotonic()
    threading.Thread(target=_tick, args=(heartbeat_s,), name="bertjax-clock", daemon=True).start()


def _tick(heartbeat_s: float) -> None:
    while True:
        time.sleep(TICK_S)
        _look(heartbeat_s)


def _look(heartbeat_s: float) -> None:
    """Records the time since the last look as a freeze, if it is half `heartbeat_s` or more."""
    now, last = time.monotonic(), _state["tick"]
    assert isinstance(last, float)
    if now - last >= heartbeat_s / 2:
        _state["stall"] = (now - last, now)
    _state["tick"] = now


def recent(heartbeat_s: float) -> float | None:
    """How long this process was last frozen, if for half `heartbeat_s` or more and ending
    less than `heartbeat_s` and `AFTER_S` ago (its peers may have given up on it); None
    otherwise, or if `watch` has not started."""
    if _state["tick"] is None:
        return None
    _look(heartbeat_s)  # (the clock thread may not have looked since it woke)
    stall = _state["stall"]
    if not isinstance(stall, tuple) or time.monotonic() - stall[1] > heartbeat_s + AFTER_S:
        return None
    return stall[0]
