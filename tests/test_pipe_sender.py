"""PipeSender: what the engine-core client sends its engine's process never waits for the process to read."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from pagellm.engine.core_process import PipeSender


def test_sends_do_not_wait_for_the_reader_and_keep_their_order():
    ours, theirs = multiprocessing.Pipe()
    sender = PipeSender(ours, "test-sender")
    large = ("add", b"x" * (16 << 20))  # far past a pipe's buffer: a direct send would wait for a reader
    caller = threading.Thread(target=lambda: [sender.send(m) for m in [large, ("abort", "r1"), ("stop",)]], daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "send waited for the other end to read"
    assert theirs.recv() == large  # read only now, after every send returned
    assert theirs.recv() == ("abort", "r1") and theirs.recv() == ("stop",)
    sender.close()


def test_a_gone_reader_drops_messages_and_close_returns():
    ours, theirs = multiprocessing.Pipe()
    sender = PipeSender(ours, "test-sender")
    theirs.close()
    sender.send(("add", b"x" * (16 << 20)))
    sender.send(("abort", "r1"))
    sender.close()  # the thread saw the broken pipe, dropped both and ended


def test_a_message_that_cannot_be_pickled_fails_in_the_caller():
    ours, theirs = multiprocessing.Pipe()
    sender = PipeSender(ours, "test-sender")
    with pytest.raises(Exception, match="pickle"):
        sender.send(("add", lambda: None))
    sender.send(("abort", "r1"))  # the thread still sends what follows
    assert theirs.recv() == ("abort", "r1")
    sender.close()
