"""Continuous-batching scheduler: who gets a slot, which prompt tokens are prefilled this step, who decodes.

Each engine step runs at most one prefill chunk (paced by the engine loop, see
continuous.py) and then one decode step over
every sequence that has finished its prompt. A prefill chunk holds the next
prompt tokens of admitted sequences (partially prefilled ones first, then new
arrivals in FIFO order), left-padded to a common width, with rows x width at
most `max_num_batched_tokens`; a long prompt is split over several steps.
So a request joins the running batch at the next step, decoding sequences
advance every step, and a finished sequence frees its slot at once.

A request with a session reuses that session's slot (see slots.py); the
tokens whose K/V are already there are counted in `prefill_tokens_saved`.

Shared prompts (`share_prompts`): a request whose whole prompt is that of a running one (the n samples
of a GRPO group) copies that request's prompt K/V into its own slot, all but the last token, and
prefills only that token, once those K/V are written; until then it holds its slot and waits. The copied
tokens are counted in `prefill_tokens_shared`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from verl_agent.engine.sequence import Seq, SeqState
from verl_agent.engine.slots import SlotTable

Chunk = tuple[Seq, int, int]  # (sequence, first prompt position, end position) written this step


class Scheduler:
    def __init__(self, n_slots: int, max_num_batched_tokens: int, share_prompts: bool = True) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.table = SlotTable(n_slots)
        self.budget = max_num_batched_tokens
        self.waiting: deque[Seq] = deque()
        self.waiting_tokens = 0  # sum of est_prefill over `waiting`
        self.running: dict[int, Seq] = {}  # slot -> sequence in PREFILL or DECODE
        self._release_when_done: set[str] = set()
        self.last_chunk_full = False  # the last chunk stopped at the token budget with more prompt tokens ready
        self.share_prompts = share_prompts
        self._donors: dict[tuple[int, ...], Seq] = {}  # a prompt -> the running request other ones copy it from
        self.copies: list[tuple[int, int, int]] = []  # (from slot, to slot, tokens) to copy before the next chunk
        self.counters = {"prefill_tokens_saved": 0, "sessions_reused": 0, "sessions_reset": 0,
                         "prefill_tokens_shared": 0}  # fmt: skip

    def add(self, seq: Seq) -> None:
        entry = self.table.peek_session(seq.session) if seq.session is not None else None
        reusable = _reusable(seq.prompt, entry.tokens, entry.n_cached) if entry is not None else 0
        seq.est_prefill = len(seq.prompt) - reusable  # an estimate: the session may be evicted before admission
        self.waiting_tokens += seq.est_prefill
        self.waiting.append(seq)

    def ready_tokens(self) -> int:
        """Prompt tokens waiting to be prefilled (estimated for sessions), partially prefilled ones included."""
        partial = sum(len(s.prompt) - s.n_cached for s in self.running.values() if s.state is SeqState.PREFILL)
        return self.waiting_tokens + partial

    def wants_prefill(self) -> bool:
        return bool(self.waiting) or any(s.state is SeqState.PREFILL for s in self.running.values())

    def prefill_ready(self) -> bool:
        """Whether `schedule_prefill` would carve a chunk now: a partial prompt, or a waiting request and a slot
        it can take (a cancelled one is counted too)."""
        partial = any(s.state is SeqState.PREFILL for s in self.running.values())
        return partial or (bool(self.waiting) and self.table.has_room)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, session: str) -> None:
        if self.table.release(session):
            return
        if session in self.table.busy_sessions or any(s.session == session for s in self.waiting):
            self._release_when_done.add(session)  # freed when its request ends

    def schedule_prefill(self) -> list[Chunk]:
        """Admit what fits and carve this step's prefill chunk."""
        chunks: list[Chunk] = []
        width = 0
        self.last_chunk_full = False
        for seq in self._prefill_candidates():
            cap = self.budget // (len(chunks) + 1)
            if chunks and width > cap:  # this one stays admitted, first in the next chunk
                self.last_chunk_full = True
                break
            start = seq.n_cached
            end = start + min(len(seq.prompt) - start, cap if chunks else self.budget)
            chunks.append((seq, start, end))
            width = max(width, end - start)
            self.last_chunk_full |= end < len(seq.prompt)  # a prompt split over chunks
        return chunks

    def schedule_shared(self) -> list[Chunk]:
        """A chunk for the requests whose donor's prompt K/V are now written (a group's first sample was just
        prefilled): their copies are queued and each prefills its last prompt token, in the same engine step
        as the donor, so a group's samples decode together."""
        chunks: list[Chunk] = []
        for seq in list(self.running.values()):
            donor = seq.donor
            if len(chunks) >= self.budget or donor is None or seq.state is not SeqState.PREFILL:
                continue
            if self.running.get(donor.slot) is donor and donor.n_cached >= len(seq.prompt) - 1:
                self._copied(seq)
                chunks.append((seq, seq.n_cached, len(seq.prompt)))
        return chunks

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The prompt K/V copies the chunk just scheduled needs first (`copy_prefix`'s pairs)."""
        copies, self.copies = self.copies, []
        return copies

    def _prefill_candidates(self) -> Iterator[Seq]:
        yield from [s for s in self.running.values() if s.state is SeqState.PREFILL and self._copied(s)]
        while self.waiting:
            seq = self.waiting[0]
            if seq.future.done():  # cancelled while waiting
                self.waiting_tokens -= self.waiting.popleft().est_prefill
                self._forget_release(seq.session)
                continue
            if not self._admit(seq):
                return
            self.waiting_tokens -= self.waiting.popleft().est_prefill
            if self._copied(seq):
                yield seq

    def _forget_release(self, session: str | None) -> None:
        """A dropped request's session has nothing left to wait for unless another request of it is in flight."""
        if session not in self._release_when_done or session in self.table.busy_sessions:
            return
        if not any(s.session == session for s in self.waiting):
            self._release_when_done.discard(session)

    def _admit(self, seq: Seq) -> bool:
        if seq.session is not None and seq.session in self.table.busy_sessions:
            seq.session = None  # two requests of one session at once: the second one runs without reuse
        entry = self.table.claim_session(seq.session) if seq.session is not None else None
        if entry is not None:
            seq.slot = entry.slot
            seq.n_cached = _reusable(seq.prompt, entry.tokens, entry.n_cached)
            self.counters["prefill_tokens_saved"] += seq.n_cached
            if seq.prompt[: len(entry.tokens)] == entry.tokens:
                self.counters["sessions_reused"] += 1
            else:  # a rewritten history: only the prefix it shares with the session's keeps its K/V
                self.counters["sessions_reset"] += 1
        else:
            slot = self.table.take_free()
            if slot is None:
                return False
            seq.slot = slot
            if seq.session is not None:
                self.table.busy_sessions.add(seq.session)
        seq.state = SeqState.PREFILL
        self.running[seq.slot] = seq
        if self.share_prompts and seq.n_cached == 0 and len(seq.prompt) > 1:
            donor = self._donors.setdefault(tuple(seq.prompt), seq)
            seq.donor = donor if donor is not seq else None
        return True

    def _copied(self, seq: Seq) -> bool:
        """Whether `seq` may be prefilled now: it has no donor, or its donor's slot holds the prompt's K/V
        (then the copy is queued and `seq` prefills the last prompt token only). False while the donor is
        still prefilling. A donor that ended first hands over to the first of its followers asked here."""
        donor = seq.donor
        if donor is None:
            return True
        if self.running.get(donor.slot) is not donor:  # ended (failed, cancelled, or done) before the copy
            heir = self._donors.setdefault(tuple(seq.prompt), seq)
            seq.donor = None if heir is seq else heir
            return self._copied(seq)
        n = len(seq.prompt) - 1
        if donor.n_cached < n:
            return False
        seq.donor = None
        self.copies.append((donor.slot, seq.slot, n))
        seq.n_cached = n
        self.counters["prefill_tokens_shared"] += n
        return True

    def compact(self, bucket: Callable[[int], int]) -> list[tuple[int, int]]:
        """Move running sequences into the lowest slots, so that a decode step covers `bucket(len(running))`
        rows rather than up to the highest slot an idle session left them in. Returns the (from, to) slot
        pairs whose K/V the caller must swap; whatever held `to` (free or an idle session) now holds `from`."""
        target = self._compact_target(bucket)
        movers = [s for s in self.running.values() if s.slot >= target]
        if not movers:
            return []
        holes = [j for j in range(target) if j not in self.running]
        swaps = []
        for seq, hole in zip(movers, holes):
            self.table.move(hole, seq.slot)
            del self.running[seq.slot]
            swaps.append((seq.slot, hole))
            seq.slot = hole
            self.running[hole] = seq
        return swaps

    def needs_compaction(self, bucket: Callable[[int], int]) -> bool:
        """Whether `compact` would move a sequence now."""
        target = self._compact_target(bucket)
        return any(slot >= target for slot in self.running)

    def _compact_target(self, bucket: Callable[[int], int]) -> int:
        return bucket(len(self.running)) if self.running else 0

    def decoding(self) -> list[Seq]:
        return [s for s in self.running.values() if s.state is SeqState.DECODE]

    def finish(self, seq: Seq, keep_session: bool = True) -> None:
        """Free the sequence's slot, or park it for the session's next turn."""
        if seq.slot < 0:
            return
        if self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
        key = tuple(seq.prompt)
        if self._donors.get(key) is seq:
            del self._donors[key]
        session = seq.session
        if session is not None and keep_session and session not in self._release_when_done:
            tokens = seq.prompt + seq.out_ids
            self.table.park(session, seq.slot, tokens, len(tokens) - 1)
        else:
            self.table.free(seq.slot, session)
            self._release_when_done.discard(session or "")
        seq.slot = -1

    def drain(self) -> list[Seq]:
        """Remove and return every waiting and running sequence (engine shutdown or a failed step)."""
        seqs = list(self.waiting) + list(self.running.values())
        self.waiting.clear()
        self.waiting_tokens = 0
        for seq in list(self.running.values()):
            self.finish(seq, keep_session=False)
        self._release_when_done.clear()  # every request is gone: no session waits for one
        self.copies.clear()
        return seqs


def _reusable(prompt: list[int], tokens: list[int], n_cached: int) -> int:
    """Prompt tokens whose K/V a session's slot already holds: the prefix `prompt` shares with the session's
    last prompt + response (`tokens`, of which `n_cached` have K/V), less one so that a prompt equal to that
    prefix still prefills a token to sample from. Attention is causal, so a shared prefix's K/V stay valid."""
    n = min(len(prompt) - 1, n_cached)
    if prompt[:n] == tokens[:n]:
        return max(n, 0)
    return next(i for i in range(n) if prompt[i] != tokens[i])
