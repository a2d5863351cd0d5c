"""The copy of each part off its node, over a gloo group of the tier's own (apart from training's and the
checkpoint writer's), every wait bounded by the group's timeout (checkpoint.memory_timeout_s).

Who sends to whom (`partners`): each rank sends its part to the rank of its place on the next node (modulo that
node's size), nodes in the order of their first rank, and receives from every rank that sends to it. With the
same number of workers on every node that is one part each way; with uneven nodes (Ray fills each node before the
next: 6 workers on 4-GPU nodes are 4 + 2) a rank of a smaller node receives several, so every part still has a copy
off its node. One node: nothing is sent.

Files are sent from and received into their mapped pages (raysft.checkpoint.memory.files), so a copy costs no
buffer of its size in the process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from raysft.checkpoint.memory.files import commit, map_file, map_new, temporary
from raysft.distributed.layout import ranks_by_node

CHUNK = 64 << 20  # bytes per send: a bounded rate sleeps between them, and each one's wait is bounded


def partners(nodes: Sequence[Hashable], rank: int) -> tuple[int | None, list[int]]:
    """(the rank `rank` sends its part to, the ranks it receives parts from), given every rank's node
    (ParallelDims.nodes); (None, []) on one node."""
    ranks_of = ranks_by_node(nodes)
    order = list(ranks_of)
    if len(order) == 1:
        return None, []

    def send_to(r: int) -> int:
        nxt = ranks_of[order[(order.index(nodes[r]) + 1) % len(order)]]
        return nxt[ranks_of[nodes[r]].index(r) % len(nxt)]

    return send_to(rank), [r for r in range(len(nodes)) if send_to(r) == rank]


class Transport:
    """This rank's side of the copies: `exchange` after each snapshot, `fetch` at a resume. Collective over the
    tier's group, which the constructor makes (every rank)."""

    def __init__(self, nodes: Sequence[Hashable], rank: int, timeout_s: float, copy_mb_per_s: float = 0.0,
                 send_copies: bool = True):
        self.nodes, self.rank, self.copy_mb_per_s = nodes, rank, copy_mb_per_s
        self.timeout = timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        self.send_to, self.recv_from = partners(nodes, rank) if send_copies else (None, [])

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (CPU, the same shape on every rank), over the tier's group."""
        out = [torch.empty_like(tensor) for _ in self.nodes]
        dist.all_gather(out, tensor, group=self.group)
        return out

    def all_gather_object(self, value) -> list:
        """Every rank's `value` (this run's own processes' objects), over the tier's group."""
        out: list = [None] * len(self.nodes)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def exchange(self, path: Path | None, target_of: Callable[[int], Path]) -> None:
        """Send this rank's file (None: it could not be written) to `send_to`, and keep each `recv_from` rank's under
        `target_of(rank)`, at copy_mb_per_s if set. Every rank runs the same exchange for the same step (snapshots
        are agreed collectively), so sends and receives pair up; a side with nothing to send, or no room to
        receive, says so first, and the exchange ends on both sides without it. Raises the first error met (after
        the exchange: the partners must not wait for this rank)."""
        if self.send_to is None:
            return
        error = None
        try:
            data = map_file(path) if path is not None else None
        except OSError as e:  # gone or unreadable since it was written: sent as nothing, raised after
            data, error = None, e
        size = torch.tensor([-1 if data is None else data.numel()])
        data = torch.empty(0, dtype=torch.uint8) if data is None else data
        incoming = {r: torch.zeros(1, dtype=torch.int64) for r in self.recv_from}
        self._run([(size, self.send_to)], incoming.items())
        received = {}
        for r, n in incoming.items():
            if n.item() >= 0 and error is None:
                try:
                    received[r] = map_new(target_of(r), int(n.item()))
                except OSError as e:
                    error = e
        accepted = torch.zeros(1, dtype=torch.int64)  # the other way round: each receiver tells its senders
        self._run([(torch.tensor([int(r in received)]), r) for r in self.recv_from], [(self.send_to, accepted)])
        data = data if accepted.item() else data[:0]
        longest = max([data.numel(), *(t.numel() for t in received.values())])
        for start in range(0, longest, CHUNK):
            began = time.monotonic()
            self._run([(data[start:start + CHUNK], self.send_to)],
                      [(r, t[start:start + CHUNK]) for r, t in received.items()])
            if self.copy_mb_per_s:
                sent = min(CHUNK, max(0, data.numel() - start))
                time.sleep(max(0.0, sent / (self.copy_mb_per_s * 1e6) - (time.monotonic() - began)))
        del data
        for r in list(received):
            del received[r]
            commit(target_of(r))
        if error is not None:
            raise error

    def fetch(self, step: int, moves: list[tuple[int, int, Path, Path]]) -> str:
        """At a resume, collective: each (rank, holder, file on the holder's node, where the rank keeps it) of `moves`
        sends the holder's file to the rank (kept on its node, for a fault to come; every rank passes the same
        moves, and only the holder and the rank read their paths), in chunks of CHUNK bytes, each send's wait
        bounded. Returns "" once every file has landed, else why not, the same on every rank: a holder whose file
        is gone or unreadable, a rank with no room left. A broken exchange (a wait past the timeout) raises."""
        outgoing, errors_here = [], []
        for rank, holder, held, _ in moves:
            if holder == self.rank:
                try:
                    outgoing.append((map_file(held), rank))
                except OSError as e:  # gone since it was listed, or unreadable: the rank is told by a size of -1
                    errors_here.append(f"rank {self.rank} could not read {held} to send it: {type(e).__name__}: {e}")
                    outgoing.append((None, rank))
        incoming = [(holder, target) for rank, holder, _, target in moves if rank == self.rank]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in incoming]
        self._run([(torch.tensor([-1 if d is None else d.numel()]), r) for d, r in outgoing],
                  [(holder, n) for (holder, _), n in zip(incoming, sizes, strict=True)])
        into = []
        for (_, target), n in zip(incoming, sizes, strict=True):
            if n.item() < 0 or errors_here:
                break
            try:
                into.append(map_new(target, int(n)))
            except OSError as e:
                errors_here.append(f"rank {self.rank} has no room for its part of step {step}: {type(e).__name__}: {e}")
                break
        errors: list = [None] * len(self.nodes)
        dist.all_gather_object(errors, "; ".join(errors_here) or None, group=self.group)
        if any(errors):  # a holder's size of -1 comes with its error, so every rank sees one
            del into
            for _, target in incoming:
                temporary(target).unlink(missing_ok=True)
            return "; ".join(e for e in errors if e)
        sends = [(d, r) for d, r in outgoing if d is not None]
        longest = max([0, *(d.numel() for d, _ in sends), *(t.numel() for t in into)])
        for start in range(0, longest, CHUNK):
            self._run([(d[start:start + CHUNK], r) for d, r in sends],
                      [(holder, t[start:start + CHUNK]) for (holder, _), t in zip(incoming, into, strict=True)])
        del into, outgoing, sends
        for _, target in incoming:
            commit(target)
        dist.barrier(self.group)  # every file landed: a rank may read one its node's first rank received
        return ""

    def _run(self, sends, recvs) -> None:
        """Post every send ((tensor, to) pairs) and receive ((from, tensor) pairs) at once, then wait for them, each
        for at most the group's timeout: blocking sends would wait for each other in a ring."""
        ops = [dist.P2POp(dist.isend, t.contiguous(), to, self.group) for t, to in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, frm, self.group) for frm, t in recvs if t.numel()]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait(self.timeout)
