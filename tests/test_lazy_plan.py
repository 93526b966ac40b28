"""Whether a restore goes lazily (core.lazypages.lazy_plan), decided once per restore: by
the server for every restore it asks of a wrapper, by the wrapper for its own (a suspended
kernel coming back). No processes. The restores themselves: tests/test_lazy_restore.py
(the wrapper following the request), tests/test_server_extension.py and
tests/test_image_cache.py (the server deciding)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_ext.core.lazypages import LAZY_MIN_BYTES, Into, LazyPlan, LazySettings, lazy_plan
from jupyter_ext.core.manifest import IMAGES_DIR, FileEntry, Manifest
from jupyter_ext.core.protocol.control import RestoreRequest

ON = LazySettings(enabled=True)


def manifest(pages: int, *, gpu: bool = False, parent_pages: int = 0) -> Manifest:
    """A snapshot of a kernel holding ``pages`` bytes of memory (``parent_pages`` more in
    the level below, as an incremental snapshot's chain), with CUDA state if ``gpu``."""
    files = [
        FileEntry(f"{IMAGES_DIR}/pages-1.img", pages, "0" * 64),
        FileEntry(f"{IMAGES_DIR}/core-1.img", 10 << 30, "1" * 64),  # not memory
    ]
    if parent_pages:
        files.append(FileEntry(f"{IMAGES_DIR}/parent/pages-1.img", parent_pages, "2" * 64))
    return Manifest(
        id="s",
        lineage="l",
        sequence=1,
        created="2026-12-05T00:00:00Z",
        trigger="manual",
        runtime_dir="/run/x",
        runtime_dir_key="x",
        stdio_pipe="pipe:[1]",
        gpu={"ns_pids": [1]} if gpu else {},
        files=files,
    )


BIG = manifest(LAZY_MIN_BYTES)
SMALL = manifest(LAZY_MIN_BYTES - 1)


@pytest.mark.parametrize("snapshot", [BIG, SMALL])
def test_from_the_store_into_a_new_kernel_is_lazy_whatever_its_size(snapshot: Manifest) -> None:
    plan = lazy_plan(ON, snapshot, into=Into.NEW_KERNEL, in_store=True, supported=True)
    assert plan is LazyPlan.FROM_STORE
    assert plan.lazy


@pytest.mark.parametrize("into", [Into.IN_PLACE, Into.SIDE_KERNEL])
def test_from_the_store_elsewhere_is_downloaded_then_lazy_only_if_big(into: Into) -> None:
    """In place a damaged chunk must fail the restore before the running kernel is
    touched, and a side kernel would end midway: downloaded first, then local images."""
    assert lazy_plan(ON, BIG, into=into, in_store=True, supported=True) is LazyPlan.LOCAL
    assert lazy_plan(ON, SMALL, into=into, in_store=True, supported=True) is LazyPlan.FULL


def test_lazy_from_the_store_turned_off_downloads_first() -> None:
    settings = LazySettings(enabled=True, from_store=False)
    plan = lazy_plan(settings, BIG, into=Into.NEW_KERNEL, in_store=True, supported=True)
    assert plan is LazyPlan.LOCAL
    plan = lazy_plan(settings, SMALL, into=Into.NEW_KERNEL, in_store=True, supported=True)
    assert plan is LazyPlan.FULL


@pytest.mark.parametrize("into", list(Into))
def test_local_images_are_lazy_from_the_minimum_size_on(into: Into) -> None:
    """The image cache, the work directory, a suspended kernel: in full below the
    minimum (reading the pages files costs less than setting up lazy pages)."""
    assert lazy_plan(ON, BIG, into=into, in_store=False, supported=True) is LazyPlan.LOCAL
    assert lazy_plan(ON, SMALL, into=into, in_store=False, supported=True) is LazyPlan.FULL
    zero = LazySettings(enabled=True, min_bytes=0)
    assert lazy_plan(zero, SMALL, into=into, in_store=False, supported=True) is LazyPlan.LOCAL


def test_the_memory_of_every_level_of_a_chain_counts() -> None:
    chained = manifest(LAZY_MIN_BYTES // 2, parent_pages=LAZY_MIN_BYTES // 2)
    plan = lazy_plan(ON, chained, into=Into.IN_PLACE, in_store=False, supported=True)
    assert plan is LazyPlan.LOCAL


@pytest.mark.parametrize("in_store", [True, False])
@pytest.mark.parametrize("into", list(Into))
def test_never_lazy_when_off_unsupported_or_with_cuda_state(into: Into, in_store: bool) -> None:
    off = LazySettings(enabled=False, min_bytes=0)
    assert lazy_plan(off, BIG, into=into, in_store=in_store, supported=True) is LazyPlan.FULL
    assert lazy_plan(ON, BIG, into=into, in_store=in_store, supported=False) is LazyPlan.FULL
    gpu = manifest(LAZY_MIN_BYTES, gpu=True)
    assert lazy_plan(ON, gpu, into=into, in_store=in_store, supported=True) is LazyPlan.FULL
    assert not LazyPlan.FULL.lazy


def test_the_decision_travels_in_the_restore_request() -> None:
    """The wrapper follows what the requester said; a request that says nothing is a
    full restore."""
    told = RestoreRequest.from_json(RestoreRequest(Path("/snap"), lazy=True).to_json())
    assert told.lazy
    assert not RestoreRequest.from_json({"source": "/snap"}).lazy
    assert "lazy" not in RestoreRequest(Path("/snap")).to_json()


def test_the_wrappers_settings_travel_in_their_environment() -> None:
    """The server sets them for each snapshot kernel; its wrapper reads them back for its
    own restores. Unset: the traits' defaults."""
    settings = LazySettings(enabled=False, min_bytes=12345, from_store=True)
    assert LazySettings.from_env(settings.to_env()) == settings
    assert LazySettings.from_env({}) == LazySettings(enabled=True, min_bytes=LAZY_MIN_BYTES)
