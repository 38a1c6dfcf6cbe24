"""How rank 0 sends each call (a pickled step's host batch) to the other tensor-parallel ranks.

- `ShmChannel`, when every rank is on rank 0's host: a ring of slots in one POSIX shared-memory segment, with one
  writer (rank 0) and a reader per other rank. A message is pickled into one or more consecutive slots; each slot
  carries the number of the entry it holds, written after its payload, and each reader publishes how many entries
  it has consumed, so the writer reuses a slot only once every reader is past it. Entry numbers only grow, so a
  reader cannot mistake an old slot for a new one. A send is a memcpy and a store; a reader polls, spinning while
  messages come often and sleeping a little longer each time the wait goes on (an idle server costs no core).
  Waiting never times out on the reader's side: an idle engine sends nothing for as long as it likes, and a rank
  whose parent dies is killed with it (`die_with_parent`).
- `GlooChannel`, across hosts: `broadcast_object_list` over the gloo group. Gloo times out a receive that waits
  longer than the group's timeout, so the executor sends a no-op when it has been quiet for a while.

Stores and loads are aligned 8-byte NumPy element accesses, each one instruction, which x86-64 keeps whole and in
program order: a reader that sees an entry number sees the payload written before it. Python has no memory fence
to give weaker orders (AArch64's) the same guarantee, so elsewhere the ranks use gloo (`shared_memory_is_ordered`).
"""

from __future__ import annotations

import pickle
import platform
import time
import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Protocol

import numpy as np
import torch.distributed as dist

SLOTS = 16
SLOT_BYTES = 256 * 1024  # a 256-row decode step at 2,048 tokens of context pickles to ~141 KiB; more spans slots
HEADER_WORDS = 3  # entry number, payload bytes in this slot, bytes of the whole message
ACK_STRIDE = 8  # int64 words between two readers' counters: one 64-byte cache line each
SPIN_S = 0.05  # after a message, poll without sleeping this long: steps come every few milliseconds
MAX_SLEEP_S = 0.002


def shared_memory_is_ordered() -> bool:
    """Whether this CPU orders plain stores as the ring needs (x86-64's total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class StepChannel(Protocol):
    def send(self, message: Any) -> None: ...

    def recv(self) -> Any: ...

    def close(self) -> None: ...


class ShmChannel:
    """One writer and `num_readers` readers over a shared-memory ring. The writer creates the segment (`name`
    None); reader `reader` (0 .. num_readers - 1) attaches to it by name. `shares_tracker`: the reader was started
    by the writer's process (multiprocessing spawn), whose resource tracker removes the segment should the writer
    die without closing it."""

    def __init__(
        self, num_readers: int, name: str | None = None, reader: int | None = None, shares_tracker: bool = True
    ) -> None:
        self.num_readers, self.reader = num_readers, reader
        self._slot_words = HEADER_WORDS + SLOT_BYTES // 8
        acks_words = num_readers * ACK_STRIDE
        size = 8 * (acks_words + SLOTS * self._slot_words)
        if name is None:  # a new segment reads as zeros: no entry written, none consumed
            self._shm = shared_memory.SharedMemory(name=f"pagellm-{uuid.uuid4().hex[:16]}", create=True, size=size)
        else:
            self._shm = _attach(name, shares_tracker)
        self.name = self._shm.name
        words = np.ndarray((size // 8,), dtype=np.int64, buffer=self._shm.buf)
        self._acks = words[:acks_words:ACK_STRIDE]
        self._slots = words[acks_words:].reshape(SLOTS, self._slot_words)
        self._payload = self._slots[:, HEADER_WORDS:].view(np.uint8)
        # Entries written (writer) or consumed (reader) so far.
        self._entries = 0 if reader is None else int(self._acks[reader])
        self._last_message = time.monotonic()

    def send(self, message: Any, timeout_s: float | None = None) -> None:
        """Write `message` into the ring; waits (up to timeout_s) while the readers are a whole ring behind."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        total = len(data)
        for start in range(0, max(total, 1), SLOT_BYTES):
            chunk = data[start : start + SLOT_BYTES]
            entry = self._entries + 1
            slot = (entry - 1) % SLOTS
            self._wait(lambda e=entry: int(self._acks.min()) >= e - SLOTS, timeout_s, "the other ranks to read")
            self._payload[slot, : len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            self._slots[slot, 1], self._slots[slot, 2] = len(chunk), total
            self._slots[slot, 0] = entry  # last: announces the payload
            self._entries = entry

    def recv(self) -> Any:
        """The next message, waiting for it as long as it takes."""
        parts, total = [], None
        while total is None or sum(map(len, parts)) < total:
            entry = self._entries + 1
            slot = (entry - 1) % SLOTS
            self._wait(lambda e=entry, s=slot: int(self._slots[s, 0]) == e, None, "rank 0's next call")
            length, total = int(self._slots[slot, 1]), int(self._slots[slot, 2])
            parts.append(self._payload[slot, :length].tobytes())
            self._acks[self.reader] = self._entries = entry
        return pickle.loads(b"".join(parts))

    def _wait(self, ready, timeout_s: float | None, what: str) -> None:
        if ready():
            self._last_message = time.monotonic()
            return
        sleep, started = 0.0, time.monotonic()
        while not ready():
            now = time.monotonic()
            if timeout_s is not None and now - started > timeout_s:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
            if now - self._last_message > SPIN_S:
                sleep = min(MAX_SLEEP_S, max(sleep * 2, 1e-5))
            time.sleep(sleep)  # 0 while spinning: a yield, so a rank sharing the core runs
        self._last_message = time.monotonic()

    def close(self) -> None:
        """Detach; the writer also removes the segment."""
        self._acks = self._slots = self._payload = None
        self._shm.close()
        if self.reader is None:
            self._shm.unlink()


class GlooChannel:
    """The gloo group's broadcast from rank 0 (ranks on several hosts)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, message: Any) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def recv(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        pass


def _attach(name: str, shares_tracker: bool) -> shared_memory.SharedMemory:
    """Open rank 0's segment. Before Python 3.13 (track=False) attaching registers the segment with this process's
    resource tracker too: a tracker of its own would remove it when this rank exits, so it is unregistered there;
    a tracker shared with rank 0 holds it once either way."""
    shm = shared_memory.SharedMemory(name=name)
    if not shares_tracker:
        resource_tracker.unregister(shm._name, "shared_memory")  # the registered name, with its leading slash
    return shm
