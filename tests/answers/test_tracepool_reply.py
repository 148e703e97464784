"""A worker's reply that cannot be read back counts as the worker failing (the pool then
traces that batch itself), as a silent worker does. ``plan`` sends back a trace's error as
its result (:class:`batchfit.speed.plan._Needs`), and an error whose constructor takes
more than its message does not unpickle."""

from __future__ import annotations

import os
import pickle

from batchfit.answers.tracepool import _LENGTH, _Worker
from batchfit.errors import InvalidInputError, MemoryBelowOverheadError


def reply_of(result: object) -> object:
    requests_read, requests = os.pipe()
    replies, replies_write = os.pipe()
    payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    os.write(replies_write, _LENGTH.pack(len(payload)) + payload)
    try:
        return _Worker(os.getpid(), requests, replies).receive(timeout_s=5)
    finally:
        for fd in (requests_read, requests, replies, replies_write):
            os.close(fd)


def test_an_error_that_does_not_unpickle_is_no_reply():
    # MemoryBelowOverheadError(message, needed, given): unpickling calls it with the message
    # only (before: TypeError out of the plan)
    assert reply_of(MemoryBelowOverheadError("below the overhead", 10, 5)) is None


def test_readable_replies_come_back():
    assert reply_of(123_456) == 123_456
    error = reply_of(InvalidInputError("no checkpointing"))
    assert isinstance(error, InvalidInputError) and str(error) == "no checkpointing"
