"""The decisions of memory tracking (jupyter_ext/core/memtrack/plan.py) and the chain's
bookkeeping (core/criu/chain.py, core/lazypages/chain.py), without processes."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from jupyter_ext.core.criu.chain import ChainStats, chain_stats, level_files_of, parent_entries
from jupyter_ext.core.errors import SnapshotCorruptError
from jupyter_ext.core.lazypages.chain import ChainPages, Piece, encode_pagemap, flatten, resolve
from jupyter_ext.core.lazypages.pagemap import (
    IMG_COMMON_MAGIC,
    PAGE_SIZE,
    PAGEMAP_MAGIC,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    parse_pagemap,
)
from jupyter_ext.core.lazypages.sources import DirectoryPages
from jupyter_ext.core.manifest import FileEntry, Manifest
from jupyter_ext.core.memtrack import plan, writeback
from jupyter_ext.core.memtrack.digests import (
    HUGE_PAGE,
    PageDigests,
    compare,
    digests_of_dump,
    page_digests,
)
from jupyter_ext.core.memtrack.plan import Situation, another_round, plan_dump
from jupyter_ext.core.memtrack.writeback import SLACK_BYTES, unthrottled_bytes

MIB = 1 << 20
CHAIN = ChainStats(levels=3, pages_bytes=300 * MIB, top_bytes=10 * MIB)
TRACKED = Situation(
    tracking="userfaultfd",
    tracked_since="a" * 32,
    parent_id="a" * 32,
    parent_chain=CHAIN,
    memory_bytes=290 * MIB,
)


def test_a_tracked_kernel_with_its_parent_here_is_incremental() -> None:
    got = plan_dump(TRACKED)
    assert (got.mode, got.parent_id, got.reason, got.track, got.precopy) == (
        "incremental",
        "a" * 32,
        "",
        True,
        True,
    )


@pytest.mark.parametrize(
    ("change", "reason", "track"),
    [
        ({"tracking": None, "unavailable": "no way here"}, "no way here", False),
        ({"gpu": True}, plan.GPU, False),
        ({"pinned_bytes": 4096}, "4.0 KiB of the kernel's memory is pinned", False),
        ({"tracked_since": None}, plan.FIRST, True),
        ({"tracked_since": None, "untracked_reason": plan.AFTER_RESTORE}, plan.AFTER_RESTORE, True),
        ({"parent_id": "b" * 32}, plan.PARENT_GONE, True),
        ({"parent_id": None, "parent_chain": None}, plan.PARENT_GONE, True),
        ({"parent_chain": ChainStats(16, 10 * MIB, MIB)}, "its chain of 16 levels", True),
        ({"parent_chain": ChainStats(3, 600 * MIB, MIB)}, "its chain holds 600.0 MiB", True),
    ],
)
def test_each_full_copy_has_its_reason(change: dict[str, object], reason: str, track: bool) -> None:
    fields = {**TRACKED.__dict__, **change}
    got = plan_dump(Situation(**fields))  # type: ignore[arg-type]
    assert got.mode == "full"
    assert got.reason.startswith(reason)
    assert got.track is track
    assert got.precopy is track


def test_a_suspend_copies_no_ahead_and_keeps_no_tracking_it_does_not_need() -> None:
    suspend = Situation(**{**TRACKED.__dict__, "keeps_running": False})
    assert (plan_dump(suspend).mode, plan_dump(suspend).precopy) == ("incremental", False)
    first = Situation(**{**TRACKED.__dict__, "keeps_running": False, "tracked_since": None})
    assert (plan_dump(first).track, plan_dump(first).precopy) == (False, False)


def test_precopy_rounds_stop_when_little_is_left_or_they_do_not_converge() -> None:
    big = 10 * plan.PRECOPY_MIN_BYTES
    assert another_round(0, big, None)
    assert not another_round(0, plan.PRECOPY_MIN_BYTES, None)
    assert another_round(1, big // 2, big)
    assert another_round(1, int(big * plan.PRECOPY_CONVERGING), big)
    assert not another_round(1, int(big * plan.PRECOPY_CONVERGING) + 1, big)  # writes too fast
    assert another_round(plan.MAX_PRECOPY_ROUNDS - 1, big // 2, big)
    assert not another_round(plan.MAX_PRECOPY_ROUNDS, big, big * 4)
    # After a round, less is worth another: scattered pages cost the freeze most.
    left = plan.PRECOPY_MIN_BYTES
    assert another_round(1, left, 4 * left)
    assert not another_round(1, plan.PRECOPY_AGAIN_BYTES, 4 * left)


def entry(path: str, size: int, chunks: bool = True) -> FileEntry:
    listed = [("0" * 64, size)] if chunks else None
    return FileEntry(path, size, "f" * 64, listed)


def manifest_with(*files: FileEntry) -> Manifest:
    return Manifest(
        id="c" * 32,
        lineage="l",
        sequence=1,
        created="",
        trigger="manual",
        runtime_dir="",
        runtime_dir_key="",
        stdio_pipe="",
        files=list(files),
    )


def test_a_childs_chain_lists_the_parents_level_files_with_their_chunks() -> None:
    parent = manifest_with(
        entry("images/core-1.img", 10, chunks=False),
        entry("images/inventory.img", 5, chunks=False),
        entry("images/pagemap-1.img", 20, chunks=False),
        entry("images/pages-1.img", 4096),
        entry("images/parent/pages-1.img", 8192),
        entry("images/parent/pagemap-1.img", 20, chunks=False),
        entry("manifest-extra.json", 1, chunks=False),
    )
    assert sorted(level_files_of(parent)) == [
        "inventory.img",
        "pagemap-1.img",
        "pages-1.img",
        "parent/pagemap-1.img",
        "parent/pages-1.img",
    ]
    listed = parent_entries(parent, "images/parent/parent")
    assert listed["images/parent/parent/parent/pages-1.img"].chunks == [("0" * 64, 8192)]
    assert "images/parent/parent/core-1.img" not in listed
    stats = chain_stats(parent)
    assert stats == ChainStats(levels=2, pages_bytes=4096 + 8192, top_bytes=4096)


def pagemap_image(pages_id: int, entries: list[tuple[int, int, int]]) -> bytes:
    """A pagemap image of (vaddr, pages, flags) entries, as CRIU writes them."""
    from jupyter_ext.core.criu.images import put_varint

    def message(fields: list[tuple[int, int]]) -> bytes:
        body = b"".join(put_varint(n << 3) + put_varint(v) for n, v in fields)
        return struct.pack("<I", len(body)) + body

    out = struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + message([(1, pages_id)])
    for vaddr, pages, flags in entries:
        out += message([(1, vaddr), (2, pages), (4, flags), (5, pages)])
    return out


def level(directory: Path, entries: list[tuple[int, int, int]], fill: int) -> None:
    """A level: its pagemap, and its pages file (each present page: the byte ``fill``
    then its address's page number)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pagemap-1.img").write_bytes(pagemap_image(1, entries))
    data = b""
    for vaddr, pages, flags in entries:
        if flags & PE_PRESENT:
            for n in range(pages):
                page = vaddr // PAGE_SIZE + n
                data += (bytes([fill]) + page.to_bytes(4, "little")).ljust(PAGE_SIZE, b"\0")
    (directory / "pages-1.img").write_bytes(data)


def test_a_chain_resolves_and_flattens_to_the_newest_level_of_each_page(tmp_path: Path) -> None:
    """Three levels: each page comes from the newest level that has it, a run the top
    leaves to its parent may span levels, and the flat pagemap and pages file say the
    same as the chain."""
    images = tmp_path / "images"
    v = 0x10000 * PAGE_SIZE
    level(images / "parent" / "parent", [(v, 8, PE_PRESENT | PE_LAZY)], fill=1)
    level(
        images / "parent",
        [
            (v, 2, PE_PARENT),
            (v + 2 * PAGE_SIZE, 2, PE_PRESENT | PE_LAZY),
            (v + 4 * PAGE_SIZE, 4, PE_PARENT),
        ],
        fill=2,
    )
    level(
        images,
        [(v, 3, PE_PARENT), (v + 3 * PAGE_SIZE, 1, PE_PRESENT), (v + 4 * PAGE_SIZE, 4, PE_PARENT)],
        fill=3,
    )
    (images / "core-1.img").write_bytes(b"core")
    pieces = resolve(images)[1]
    assert [(p.vaddr - v) // PAGE_SIZE for p in pieces] == [0, 2, 3, 4]
    assert [p.file for p in pieces] == [
        "parent/parent/pages-1.img",
        "parent/pages-1.img",
        "pages-1.img",
        "parent/parent/pages-1.img",
    ]
    flat = tmp_path / "flat"
    pages = flatten(images, flat, DirectoryPages(images))
    assert (flat / "core-1.img").read_bytes() == b"core"
    merged = parse_pagemap((flat / "pagemap-1.img").read_bytes())
    assert merged.size == 8 * PAGE_SIZE == (flat / "pages-1.img").stat().st_size
    data = pages.read("pages-1.img", 0, 8 * PAGE_SIZE)
    fills = [data[n * PAGE_SIZE] for n in range(8)]
    numbers = [
        int.from_bytes(data[n * PAGE_SIZE + 1 : n * PAGE_SIZE + 5], "little") for n in range(8)
    ]
    assert fills == [1, 1, 2, 3, 1, 1, 1, 1]
    assert numbers == [v // PAGE_SIZE + n for n in range(8)]
    lazy = [e.lazy for e in merged.entries for _ in range(e.nr_pages)]
    assert lazy == [True, True, True, False, True, True, True, True]


def _runs(owned: list[bool], present: int) -> list[tuple[int, int, int]]:
    """Pagemap entries over pages 0..n: runs of pages this level holds (``present``
    flags) or leaves to its parent, as CRIU writes them (sorted, neighbours merged)."""
    v = 0x40000 * PAGE_SIZE
    entries: list[tuple[int, int, int]] = []
    for n, own in enumerate(owned):
        flags = present if own else PE_PARENT
        if entries and entries[-1][2] == flags:
            vaddr, pages, _ = entries[-1]
            entries[-1] = (vaddr, pages + 1, flags)
        else:
            entries.append((v + n * PAGE_SIZE, 1, flags))
    return entries


def test_a_long_fragmented_chain_flattens_to_the_newest_level_of_every_page(
    tmp_path: Path,
) -> None:
    """Four levels over 600 pages, each later level holding a random scattering of them
    (as cells that change 1 % each leave them): every page of the flat file is the newest
    level's, read whole and in odd slices (the runs are searched, not scanned)."""
    import random

    rng = random.Random(43)
    count, images = 600, tmp_path / "images"
    holders = [0] * count  # the newest level holding each page (0: the oldest)
    for depth in range(4):  # the oldest first
        directory = images.joinpath(*["parent"] * (3 - depth))
        owned = [depth == 0 or rng.random() < 0.3 for _ in range(count)]
        holders = [depth if own else held for own, held in zip(owned, holders, strict=True)]
        level(directory, _runs(owned, PE_PRESENT | PE_LAZY), fill=depth + 1)
    assert len(parse_pagemap((images / "pagemap-1.img").read_bytes()).entries) > 100
    pages = flatten(images, tmp_path / "flat", DirectoryPages(images))
    data = pages.read("pages-1.img", 0, count * PAGE_SIZE)
    assert [data[n * PAGE_SIZE] for n in range(count)] == [h + 1 for h in holders]
    for _ in range(50):
        start = rng.randrange(count * PAGE_SIZE)
        length = rng.randrange(1, count * PAGE_SIZE - start + 1)
        assert pages.read("pages-1.img", start, length) == data[start : start + length]


def test_a_chain_missing_a_parent_page_is_refused_as_damaged(tmp_path: Path) -> None:
    images = tmp_path / "images"
    v = 0x20000 * PAGE_SIZE
    level(images / "parent", [(v, 2, PE_PRESENT)], fill=1)
    level(images, [(v, 4, PE_PARENT)], fill=2)
    with pytest.raises(SnapshotCorruptError, match="lacks the pages at"):
        resolve(images)


def test_flat_pages_read_across_runs_and_refuse_what_is_not_there(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"A" * 10)
    (tmp_path / "b").write_bytes(b"B" * 10)
    from jupyter_ext.core.lazypages.chain import _Run

    pages = ChainPages(DirectoryPages(tmp_path), {"p": [_Run(0, 4, "a", 2), _Run(4, 6, "b", 0)]})
    assert pages.read("p", 2, 6) == b"AABBBB"
    with pytest.raises(OSError, match="nothing in the chain"):
        pages.read("p", 8, 4)
    with pytest.raises(OSError, match="not a pages file"):
        pages.read("q", 0, 1)


def test_encode_pagemap_merges_neighbours_of_the_same_kind() -> None:
    v = 0x30000 * PAGE_SIZE
    pieces = [
        Piece(v, 1, True, "x", 0),
        Piece(v + PAGE_SIZE, 2, True, "y", 0),
        Piece(v + 3 * PAGE_SIZE, 1, False, "y", 0),
        Piece(v + 9 * PAGE_SIZE, 1, False, "x", 0),
    ]
    decoded = parse_pagemap(encode_pagemap(7, pieces))
    assert decoded.pages_id == 7
    assert [(e.vaddr, e.nr_pages, e.lazy) for e in decoded.entries] == [
        (v, 3, True),
        (v + 3 * PAGE_SIZE, 1, False),
        (v + 9 * PAGE_SIZE, 1, False),
    ]


def test_precopy_rounds_copy_at_most_half_the_memory_again() -> None:
    memory = 40 * plan.PRECOPY_MIN_BYTES
    budget = int(memory * plan.PRECOPY_AGAIN_SHARE)
    pending = memory // 8  # converging, more than a freeze should copy
    assert another_round(1, pending, 4 * pending, 0, memory)
    assert another_round(2, pending, 4 * pending, budget - pending, memory)
    stop = plan.precopy_stop(2, pending, 4 * pending, budget - pending + 1, memory)
    assert stop.startswith("another round would copy more than 50% of the kernel's")
    # The first round copies what changed however much it is; an unknown size stops none.
    assert another_round(0, memory, None, 0, memory)
    assert another_round(2, pending, 4 * pending, 2 * memory, 0)


def test_precopy_says_why_it_stopped() -> None:
    big = 10 * plan.PRECOPY_MIN_BYTES
    assert plan.precopy_stop(0, big, None) == ""
    assert "left to copy while frozen" in plan.precopy_stop(1, MIB, big)
    rounds = plan.MAX_PRECOPY_ROUNDS
    assert f"writes faster than {rounds} rounds copy" in plan.precopy_stop(rounds, big, big * 4)
    assert "about as fast as a round copies" in plan.precopy_stop(1, big, big)


# --------------------------------------------------------------- the dirty-page room


def _kernels_free_run_room() -> tuple[int, int]:
    """The machine's free-run ceiling and its dirty and writeback bytes, as the kernel
    reports them in /proc/vmstat."""
    pages = {
        name: int(value)
        for name, value in (line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    }
    ceiling = (pages["nr_dirty_threshold"] + pages["nr_dirty_background_threshold"]) // 2
    return ceiling * PAGE_SIZE, (pages["nr_dirty"] + pages["nr_writeback"]) * PAGE_SIZE


def test_the_machines_room_is_the_kernels_free_run_ceiling_less_its_dirty_pages(
    tmp_path: Path,
) -> None:
    """core/memtrack/writeback.py on this machine (no cgroup v2 limit: an empty cgroup
    tree): the room is the kernel's own ceiling less the dirty and writeback pages. The
    machine's other writers move those numbers, so the room is read between two equal
    readings of /proc/vmstat."""
    for _ in range(100):
        before = _kernels_free_run_room()
        room = unthrottled_bytes(cgroup_root=tmp_path)
        if _kernels_free_run_room() == before:
            ceiling, dirty = before
            assert room == ceiling - dirty - SLACK_BYTES
            return
    pytest.fail("/proc/vmstat changed during each of 100 readings")


def test_the_cgroup_formula_agrees_with_the_kernels_for_the_machine() -> None:
    """The ceiling worked out for a cgroup (``domain_dirty_limits`` as Python), given this
    machine's free and file pages, is the kernel's own within 5 % (the kernel also keeps
    its reserve pages out; /proc/meminfo does not say how many)."""
    proc = Path("/proc")
    info = writeback._meminfo(proc)
    dirtyable = info["MemFree"] + info["Active(file)"] + info["Inactive(file)"]
    ours = writeback._free_run_ceiling(proc, dirtyable, dirtyable)
    kernels, _ = _kernels_free_run_room()
    assert abs(ours - kernels) < kernels * 5 // 100, (ours, kernels)


def test_a_cgroups_memory_limit_bounds_the_room(tmp_path: Path) -> None:
    """cgroup v2 (a pod with a memory limit): the room is the cgroup's, from its file
    pages plus its headroom under the tightest ``memory.max`` of it and its ancestors,
    less its own dirty and writeback pages, when that is less than the machine's. (A
    tree of the kernel's files as Linux writes them: this machine mounts cgroup v1.)"""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "sys" / "vm").mkdir(parents=True)
    (proc / "meminfo").write_text(
        "MemTotal: 24000000 kB\nMemFree: 16000000 kB\nActive(file): 2000000 kB\n"
        "Inactive(file): 2000000 kB\nDirty: 1000 kB\nWriteback: 0 kB\n"
    )
    (proc / "vmstat").write_text(
        "nr_dirty 250\nnr_writeback 0\nnr_dirty_threshold 1000000\n"
        "nr_dirty_background_threshold 500000\n"
    )
    for name, value in [("dirty_ratio", 20), ("dirty_background_ratio", 10)]:
        (proc / "sys" / "vm" / name).write_text(f"{value}\n")
    for name in ("dirty_bytes", "dirty_background_bytes"):
        (proc / "sys" / "vm" / name).write_text("0\n")
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1/ctr\n")
    pod, ctr = cgroups / "kubepods" / "pod1", cgroups / "kubepods" / "pod1" / "ctr"
    ctr.mkdir(parents=True)
    (pod / "memory.max").write_text(f"{8 << 30}\n")
    (pod / "memory.current").write_text(f"{6 << 30}\n")
    (ctr / "memory.max").write_text("max\n")
    (ctr / "memory.stat").write_text(
        f"anon {5 << 30}\nfile {1 << 30}\nfile_dirty {100 * MIB}\nfile_writeback 0\n"
    )
    machine = (750000 - 250) * PAGE_SIZE - SLACK_BYTES
    # The pod: 1 GiB of file pages + 2 GiB under its limit; free run at 15 % of that.
    pod_room = (3 << 30) * 15 // 100 - 100 * MIB - SLACK_BYTES
    assert unthrottled_bytes(proc, cgroups) == pod_room < machine
    (pod / "memory.max").write_text("max\n")
    assert unthrottled_bytes(proc, cgroups) == machine
    # What is written takes from the room page for page, until it is on disk.
    (proc / "vmstat").write_text(
        "nr_dirty 250\nnr_writeback 65536\nnr_dirty_threshold 1000000\n"
        "nr_dirty_background_threshold 500000\n"
    )
    assert unthrottled_bytes(proc, cgroups) == machine - (256 << 20)


def test_a_dumps_digests_take_each_page_from_the_newest_level_that_holds_it(
    tmp_path: Path,
) -> None:
    """What the next dump compares the kernel's memory with (core/memtrack/digests.py):
    each page's digest from the newest of the dump's levels whose pages file holds it, a
    page left to the parent snapshot from the parent's digests; where the parent has no
    digest for such a page there are none at all (the next dump copies everything)."""
    v = 0x10000 * PAGE_SIZE
    top, rounds = tmp_path / "images", tmp_path / "precopy-1"
    level(rounds, [(v, 2, PE_PARENT), (v + 2 * PAGE_SIZE, 6, PE_PRESENT)], fill=2)
    level(
        top,
        [(v, 3, PE_PARENT), (v + 3 * PAGE_SIZE, 1, PE_PRESENT), (v + 4 * PAGE_SIZE, 4, PE_PARENT)],
        fill=3,
    )
    parent_pages = [bytes([1]) * PAGE_SIZE, bytes([9]) * PAGE_SIZE]
    before = PageDigests.of([(v, page_digests(memoryview(b"".join(parent_pages))))])
    got = digests_of_dump([top, rounds], 1, before)
    assert got is not None
    assert got.starts == [v]
    assert got.pages == 8

    def page(fill: int, n: int) -> bytes:
        return (bytes([fill]) + (v // PAGE_SIZE + n).to_bytes(4, "little")).ljust(PAGE_SIZE, b"\0")

    truth = [*parent_pages, page(2, 2), page(3, 3), *(page(2, n) for n in range(4, 8))]
    assert (got.runs[0] == page_digests(memoryview(b"".join(truth)))).all()
    assert digests_of_dump([top, rounds], 1, None) is None
    assert digests_of_dump([top, rounds], 1, PageDigests.of([(v, before.runs[0][:1])])) is None


def test_a_dumps_digests_over_scattered_levels_are_each_pages_newest(tmp_path: Path) -> None:
    """A kernel that writes all the time leaves pre-copy levels of scattered runs (tens of
    thousands; the walk opens each pages file once and finds each run by bisection, not
    by a scan from the start): three levels over 900 pages, each holding a random
    scattering, the rest left to the parent snapshot. Every page's digest is that of the
    newest level holding it, or the parent's."""
    import random

    rng = random.Random(36)
    count = 900
    v = 0x40000 * PAGE_SIZE  # where _runs puts page 0
    holders = [0] * count  # the newest level holding each page (0: the parent snapshot)
    directories = []
    for depth in range(1, 4):  # the oldest first
        owned = [rng.random() < 0.4 for _ in range(count)]
        holders = [depth if own else held for own, held in zip(owned, holders, strict=True)]
        directory = tmp_path / f"level-{depth}"
        level(directory, _runs(owned, PE_PRESENT), fill=depth)
        directories.insert(0, directory)  # the dump's own first

    def page(fill: int, n: int) -> bytes:
        return (bytes([fill]) + (v // PAGE_SIZE + n).to_bytes(4, "little")).ljust(PAGE_SIZE, b"\0")

    parent = page_digests(memoryview(b"".join(page(99, n) for n in range(count))))
    assert len(parse_pagemap((directories[0] / "pagemap-1.img").read_bytes()).entries) > 200
    got = digests_of_dump(directories, 1, PageDigests.of([(v, parent)]))
    assert got is not None
    assert got.starts == [v]
    truth = b"".join(page(held or 99, n) for n, held in enumerate(holders))
    assert (got.runs[0] == page_digests(memoryview(truth))).all()


def test_pages_are_unchanged_only_where_the_snapshot_held_the_same() -> None:
    """Across the runs' edges, a page the snapshot lacks counts as changed."""
    pages = [bytes([n]) * PAGE_SIZE for n in range(10)]
    digests = page_digests(memoryview(b"".join(pages)))
    v = 0x20000 * PAGE_SIZE
    snapshot = PageDigests.of(
        [(v + 5 * PAGE_SIZE, digests[5:8]), (v, digests[:3]), (v + 3 * PAGE_SIZE, digests[3:4])]
    )
    assert snapshot.starts == [v, v + 5 * PAGE_SIZE]  # the touching runs joined
    now = pages.copy()
    now[6] = b"x" * PAGE_SIZE
    same = snapshot.unchanged(v + PAGE_SIZE, page_digests(memoryview(b"".join(now[1:9]))))
    assert same.tolist() == [True, True, True, False, True, False, True, False]


def test_a_block_that_still_holds_what_the_snapshot_held_is_compared_in_one_hash() -> None:
    """The comparison hashes each whole 2 MiB block once against the snapshot's block
    digest and trusts it (here the page digests say otherwise, so only the block's digest
    can have said "unchanged"); a block that differs is compared page by page, and a part
    of a block (the read starts mid-block) always is."""
    per_block = HUGE_PAGE // PAGE_SIZE
    v = 0x40000000
    memory = bytearray(os.urandom(3 * HUGE_PAGE))
    pages = page_digests(memoryview(bytes(memory)))
    wrong = pages.copy()
    wrong[:per_block] ^= 0xFF  # the first block's page digests disagree
    snapshot = PageDigests.of([(v, wrong)], {v: xxhash.xxh3_128_digest(bytes(memory[:HUGE_PAGE]))})
    memory[HUGE_PAGE + 5 * PAGE_SIZE] ^= 1  # one page of the second block changed
    found: dict[int, bytes] = {}
    start = v + 3 * PAGE_SIZE  # a read from the third page on
    same = compare(snapshot, start, memoryview(bytes(memory))[3 * PAGE_SIZE :], found)
    assert not same[: per_block - 3].any()  # the first block's tail: its page digests
    assert same[per_block - 3 :].sum() == 2 * per_block - 1
    assert not same[per_block - 3 + 5]
    assert set(found) == {v + 2 * HUGE_PAGE}  # the third, unchanged whole
    same = compare(snapshot, v, memoryview(bytes(memory)), found)
    assert same[:per_block].all()  # the block digest said so
    assert v in found


def test_a_dumps_block_digests_are_those_of_whole_blocks_it_holds_or_found_unchanged(
    tmp_path: Path,
) -> None:
    """Block digests of a dump: each block one pages file holds whole; a block the
    comparison found unchanged whole, unless the dump copied one of its pages; none for a
    block whose pages come from two levels."""
    per_block = HUGE_PAGE // PAGE_SIZE
    v = 0x40000000
    top, rounds = tmp_path / "images", tmp_path / "precopy-1"
    level(
        rounds,
        [
            (v, per_block, PE_PARENT),
            (v + HUGE_PAGE, per_block // 2, PE_PRESENT),
            (v + HUGE_PAGE + HUGE_PAGE // 2, per_block // 2 + per_block, PE_PARENT),
        ],
        fill=2,
    )
    level(
        top,
        [(v, per_block, PE_PRESENT), (v + HUGE_PAGE, 2 * per_block, PE_PARENT)],
        fill=3,
    )
    before = PageDigests.of([(v, np.zeros((3 * per_block, 16), np.uint8))])
    claimed = {block: b"x" * 16 for block in (v, v + HUGE_PAGE, v + 2 * HUGE_PAGE)}
    got = digests_of_dump([top, rounds], 1, before, claimed)
    assert got is not None
    first = b"".join(
        (bytes([3]) + (v // PAGE_SIZE + n).to_bytes(4, "little")).ljust(PAGE_SIZE, b"\0")
        for n in range(per_block)
    )
    assert got.blocks == {v: xxhash.xxh3_128_digest(first), v + 2 * HUGE_PAGE: b"x" * 16}
