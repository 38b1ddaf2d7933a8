"""Who owns which KV slot: free slots, running requests, and idle sessions kept for their next turn.

A session (a trajectory id) that finishes a turn keeps its slot and remembers
the tokens whose K/V are in it. Its next request reuses the slot: when the new
prompt extends the remembered prompt + response token for token, only the new
tokens are prefilled; otherwise the slot is re-prefilled from scratch. Idle
sessions are evicted least-recently-used when a request needs a slot and none
is free; `release` frees a session's slot when its trajectory ends.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class IdleSession:
    slot: int
    tokens: list[int]  # prompt + response of the session's last turn
    n_cached: int  # leading tokens whose K/V are in the slot (all but the last sampled one)


class SlotTable:
    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self._free = list(range(n_slots))  # a heap: lowest slots first keeps decode rows packed at the front
        self._idle: OrderedDict[str, IdleSession] = OrderedDict()  # least recently used first
        self.busy_sessions: set[str] = set()
        self.evicted = 0

    def claim_session(self, session: str) -> IdleSession | None:
        """Take the session's idle slot (None if it has none); the session is busy until `park`/`free`."""
        entry = self._idle.pop(session, None)
        if entry is not None:
            self.busy_sessions.add(session)
        return entry

    def peek_session(self, session: str) -> IdleSession | None:
        """The session's idle entry, without claiming it."""
        return self._idle.get(session)

    def take_free(self) -> int | None:
        """A free slot, evicting the least recently used idle session if needed; None when all are running."""
        if not self._free and self._idle:
            _, entry = self._idle.popitem(last=False)
            self.evicted += 1
            return entry.slot
        return heapq.heappop(self._free) if self._free else None

    def park(self, session: str, slot: int, tokens: list[int], n_cached: int) -> None:
        """Keep `slot`'s K/V for the session's next turn."""
        self.busy_sessions.discard(session)
        old = self._idle.pop(session, None)
        if old is not None and old.slot != slot:
            heapq.heappush(self._free, old.slot)
        self._idle[session] = IdleSession(slot, tokens, n_cached)

    def free(self, slot: int, session: str | None = None) -> None:
        if session is not None:
            self.busy_sessions.discard(session)
        heapq.heappush(self._free, slot)

    def release(self, session: str) -> bool:
        """Free an idle session's slot; returns False if the session is not idle (unknown or running)."""
        entry = self._idle.pop(session, None)
        if entry is None:
            return False
        heapq.heappush(self._free, entry.slot)
        return True

    def move(self, slot: int, to: int) -> None:
        """Whatever holds `slot` (free, or an idle session) holds `to` instead (its K/V are swapped by the caller)."""
        if slot in self._free:
            self._free.remove(slot)
            self._free.append(to)
            heapq.heapify(self._free)
            return
        entry = next(e for e in self._idle.values() if e.slot == slot)
        entry.slot = to

    def drop_idle(self) -> None:
        """Forget every idle session (after a weight update their K/V belong to the old policy)."""
        while self._idle:
            _, entry = self._idle.popitem()
            heapq.heappush(self._free, entry.slot)

    @property
    def has_room(self) -> bool:
        """Whether `take_free` would find a slot (free, or an idle session's to evict)."""
        return bool(self._free or self._idle)

    @property
    def n_idle(self) -> int:
        return len(self._idle)
