"""The paged KV cache's blocks and its prefix cache, keyed by chained block hashes.

Only what the accounting needs is kept: how many blocks hold nothing, which hashes are cached, how
many running requests share each cached block, and the order idle cached blocks are evicted in.
Block ids and contents are not modelled: a chained hash stands for a block's whole prefix.

Each cached hash has exactly one block. A request that computes a block whose hash another block
already caches keeps its copy private (uncached), so the cached set changes only when a hash first
appears or its block is reused, and every change is reported as a ``KvChange``.

With a host tier (``host_blocks`` > 0), an evicted block's contents go to host memory instead of
being lost: an LRU of hashes there, whose own evictions are lost for good. A request that finds
its prefix continued there loads those blocks into fresh GPU blocks instead of computing them;
the host copy stays (the tiers are inclusive), so evicting the block again costs no copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from heapq import heappop, heappush

from services.engine.protocol import BlocksRemoved, BlocksStored, KvChange

# A block-table entry: the hash of a cached block the request shares, or None for a block only
# the request itself uses (partly filled, not yet computed, or a duplicate of a cached one).
BlockRef = int | None


class BlockPool:
    def __init__(self, num_blocks: int, host_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.host_blocks = host_blocks
        # Hashes whose contents host memory holds, least recently used first.
        self._host: OrderedDict[int, None] = OrderedDict()
        self._empty = num_blocks
        # Cached hash -> running requests holding its block; an idle block's is its stamp instead,
        # negative: -1 - its place in `_order`.
        self._refs: dict[int, int] = {}
        # Idle cached blocks, least recently released first (the eviction order), from index
        # `_next` on, place `_base` + index; with stale entries of blocks taken since, or gone
        # idle again later (their stamp is another place), skipped. A list and stamps cost less
        # per block than an OrderedDict's node, and a usual eviction or release is a few calls.
        self._order: list[int] = []
        self._base = 0
        self._next = 0
        self._num_idle = 0
        # Places of the stale entries from `_next` on, a heap: an eviction takes the entries
        # between them whole, with no check of each.
        self._stale: list[int] = []
        self._changes: list[KvChange] = []

    @property
    def num_used(self) -> int:
        """Blocks held by running requests; idle cached blocks count as free, as in vLLM."""
        return self.num_blocks - self._empty - self._num_idle

    @property
    def num_free(self) -> int:
        return self._empty + self._num_idle

    def cached_hashes(self) -> set[int]:
        return set(self._refs)

    def count_hits(self, hashes: Sequence[int], limit: int) -> tuple[int, int]:
        """How many leading ``hashes`` (at most ``limit``) are cached, and how many of those are
        idle (they stop counting as free once a request takes them)."""
        refs = self._refs
        hits = idle = 0
        while hits < limit:
            held = refs.get(hashes[hits])
            if held is None:
                break
            if held < 0:
                idle += 1
            hits += 1
        return hits, idle

    def count_host(self, hashes: Sequence[int], start: int, limit: int) -> int:
        """How many of ``hashes`` from ``start`` (up to ``limit``) host memory holds in a row."""
        host = self._host
        end = start
        while end < limit and hashes[end] in host:
            end += 1
        return end - start

    def touch_host(self, hashes: Sequence[int]) -> None:
        """``hashes`` (in host memory) are being loaded: evicted there after everything older."""
        host = self._host
        for h in hashes:
            if h in host:
                host.move_to_end(h)

    def take_cached(self, hashes: Sequence[int]) -> None:
        """Share the cached blocks of ``hashes`` (all cached) with one more request."""
        refs = self._refs
        for h in hashes:
            held = refs[h]
            if held < 0:  # its entry in the eviction order goes stale
                self._num_idle -= 1
                heappush(self._stale, -1 - held)
                held = 0
            refs[h] = held + 1

    def allocate(self, n: int) -> bool:
        """Take ``n`` blocks, empty ones first, then evicting idle cached blocks oldest first;
        False (and nothing taken) if fewer than ``n`` are free."""
        if n > self._empty + self._num_idle:
            return False
        from_empty = min(n, self._empty)
        self._empty -= from_empty
        if n > from_empty:
            evicted = self._evict(n - from_empty)
            self._changes.append(BlocksRemoved(tuple(evicted)))
            if self.host_blocks:
                self._offload(evicted)
        return True

    def _evict(self, n: int) -> list[int]:
        """Uncache the ``n`` idle blocks released longest ago and return their hashes; a hook for
        a pool that also tracks where each block's contents live."""
        refs, order, stale, base = self._refs, self._order, self._stale, self._base
        end = self._next + n
        if stale and stale[0] < base + end:
            evicted: list[int] = []
            end -= n
            while len(evicted) < n:  # the entries between stale ones, skipping those
                take = n - len(evicted)
                if stale and stale[0] - base < end + take:
                    take = heappop(stale) - base - end
                    evicted += order[end : end + take]
                    end += 1
                else:
                    evicted += order[end : end + take]
                end += take
        else:
            evicted = order[self._next : end]
        for h in evicted:  # a loop: map(refs.__delitem__) pays a method wrapper's call per block
            del refs[h]
        self._next = end
        self._num_idle -= n
        if end > 1024 and 2 * end > len(order):  # the evicted head is half of it: dropped
            del order[:end]
            self._base += end
            self._next = 0
        return evicted

    def _go_idle(self, hashes: Sequence[int]) -> None:
        """``hashes`` (cached, distinct, none idle) become idle, in order: evicted after every
        block idle now."""
        order = self._order
        stamp = -1 - self._base - len(order)
        self._refs.update(zip(hashes, range(stamp, stamp - len(hashes), -1), strict=True))
        order.extend(hashes)
        self._num_idle += len(hashes)
        if len(order) - self._next > 2 * self._num_idle + 4096:
            self._compact()

    def _compact(self) -> None:
        """Drop ``_order``'s stale entries, which outnumber the idle blocks by 4096 (a live
        worker whose cache never fills evicts none), and number the rest afresh."""
        refs, order, start, first = self._refs, self._order, self._next, -1 - self._base
        live = [h for k, h in enumerate(order[start:], start) if refs.get(h) == first - k]
        self._order, self._base, self._next, self._stale = live, 0, 0, []
        refs.update(zip(live, range(-1, -1 - len(live), -1), strict=True))

    def _offload(self, hashes: list[int]) -> None:
        host = self._host
        added = []
        for h in hashes:
            if h in host:
                host.move_to_end(h)
            else:
                host[h] = None
                added.append(h)
        dropped = [host.popitem(last=False)[0] for _ in range(len(host) - self.host_blocks)]
        if added:
            self._changes.append(BlocksStored(tuple(added), None, "host"))
        if dropped:
            self._changes.append(BlocksRemoved(tuple(dropped), "host"))
        self._host_changed(added, dropped)

    def _host_changed(self, added: list[int], dropped: list[int]) -> None:
        """Hook: the just-evicted ``added`` hashes went to host memory, then ``dropped`` left it
        (some of ``added`` among them when more arrived than it holds); for a pool whose host
        tier keeps real contents. Accounting alone keeps none."""

    def cache(self, parent: int | None, hashes: Sequence[int]) -> list[bool]:
        """Offer a request's just-computed private blocks to the cache: ``hashes`` are consecutive
        blocks, the first the child of ``parent``. True where the request's block became the
        cached (and shared) one; False where the hash was cached already and it stays private."""
        refs = self._refs
        fresh = dict.fromkeys(hashes, 1)
        if len(fresh) == len(hashes) and refs.keys().isdisjoint(fresh):
            # The usual case, none cached yet, at once: all become cached, as one run.
            if fresh:
                refs.update(fresh)
                self._changes.append(BlocksStored(tuple(hashes), parent))
            return [True] * len(fresh)
        became_cached = []
        run: list[int] = []
        run_parent = prev = parent
        for h in hashes:
            if h in refs:
                if run:
                    self._changes.append(BlocksStored(tuple(run), run_parent))
                    run = []
                became_cached.append(False)
            else:
                if not run:
                    run_parent = prev
                refs[h] = 1
                run.append(h)
                became_cached.append(True)
            prev = h
        if run:
            self._changes.append(BlocksStored(tuple(run), run_parent))
        return became_cached

    def import_cached(self, parent: int | None, hashes: Sequence[int]) -> int:
        """Cache consecutive blocks computed elsewhere (a prefill worker's hand-off) as idle and
        most recently used, as far as free blocks allow; how many leading ``hashes`` are cached
        afterwards. ``parent`` is the hash before the first block."""
        refs = self._refs
        for h in hashes:
            held = refs.get(h, 0)
            if held < 0:  # touched: evicted after everything older
                self._num_idle -= 1
                heappush(self._stale, -1 - held)
                self._go_idle((h,))
        missing = [h for h in hashes if h not in refs]
        # Evicting must not take the blocks just touched, so they do not count as room.
        touched = len(hashes) - len(missing) - sum(1 for h in hashes if refs.get(h, 0) > 0)
        room = min(len(missing), self._empty + self._num_idle - touched)
        if room > 0:
            self.allocate(room)
        taking = set(missing[:room])
        run: list[int] = []
        run_parent = prev = parent
        done = 0
        for h in hashes:
            if h in taking:
                if not run:
                    run_parent = prev
                if h not in refs:  # not a repeat of one taken just before
                    self._go_idle((h,))
                run.append(h)
            elif h in refs:
                if run:
                    self._changes.append(BlocksStored(tuple(run), run_parent))
                    run = []
            else:
                break
            prev = h
            done += 1
        if run:
            self._changes.append(BlocksStored(tuple(run), run_parent))
        return done

    def release(self, table: Sequence[BlockRef]) -> None:
        """Give back a request's blocks. Its last block is released first, so a prefix's tail is
        evicted before its head, as vLLM frees a request's blocks in reverse."""
        refs = self._refs
        self._empty += table.count(None)
        shared = [ref for ref in reversed(table) if ref is not None]
        if list(map(refs.__getitem__, shared)).count(1) != len(shared):
            # Not the usual case, where no other request holds any and all go idle at once.
            idle = []
            for ref in shared:
                held = refs[ref] - 1
                if held:
                    refs[ref] = held
                else:
                    idle.append(ref)
            shared = idle
        self._go_idle(shared)

    @property
    def num_changes(self) -> int:
        """Changes made since the last drain."""
        return len(self._changes)

    def drain_changes(self) -> list[KvChange]:
        changes, self._changes = self._changes, []
        return changes
