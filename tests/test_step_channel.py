"""The shared-memory step channel: messages arrive whole and in order across processes (several slots each, the
ring wrapping many times), a writer whose readers stop reading times out instead of overwriting, and the segment
lives exactly as long as its writer, whichever process tracked it."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from pagellm.distributed.step_channel import SLOT_BYTES, SLOTS, ShmChannel

MESSAGES = [("launch", i, list(range(i * 997 % 5000))) for i in range(3 * SLOTS)] + [
    ("big", bytes(range(256)) * (3 * SLOT_BYTES // 256 + 7)),  # four slots
    ("empty", ()),
]


def echo_reader(name: str, reader: int, count: int, results) -> None:
    channel = ShmChannel(2, name, reader=reader)
    results.put((reader, [channel.recv() for _ in range(count)]))
    channel.close()


def test_every_reader_gets_every_message_in_order():
    writer = ShmChannel(2)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    readers = [context.Process(target=echo_reader, args=(writer.name, r, len(MESSAGES), results)) for r in (0, 1)]
    for proc in readers:
        proc.start()
    try:
        for message in MESSAGES:
            writer.send(message, timeout_s=60)
        received = dict(results.get(timeout=60) for _ in readers)
    finally:
        for proc in readers:
            proc.join(timeout=10)
        writer.close()
    assert received == {0: MESSAGES, 1: MESSAGES}


def test_a_writer_never_overwrites_an_unread_slot():
    writer = ShmChannel(1)
    reader = ShmChannel(1, writer.name, reader=0)
    for i in range(SLOTS):
        writer.send(i, timeout_s=1)
    with pytest.raises(TimeoutError, match="the other ranks to read"):
        writer.send(SLOTS, timeout_s=0.2)
    assert reader.recv() == 0
    writer.send(SLOTS, timeout_s=1)  # a slot is free again
    assert [reader.recv() for _ in range(SLOTS)] == list(range(1, SLOTS + 1))
    reader.close()
    writer.close()


def test_the_segment_outlives_readers_and_not_its_writer():
    """A reader in a process with its own resource tracker (a torchrun rank) leaves the segment when it exits."""
    writer = ShmChannel(2)
    path = f"/dev/shm/{writer.name}"
    writer.send("hello")
    script = (
        "import sys; from pagellm.distributed.step_channel import ShmChannel\n"
        "c = ShmChannel(2, sys.argv[1], reader=0, shares_tracker=False); print(c.recv())"
    )
    out = subprocess.run([sys.executable, "-c", script, writer.name], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "hello" and "leaked" not in out.stderr
    assert os.path.exists(path)
    second = ShmChannel(2, writer.name, reader=1)
    assert second.recv() == "hello"
    second.close()
    writer.close()
    assert not os.path.exists(path)
