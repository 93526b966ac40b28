"""The server extension's options: every trait of :class:`SnapshotSettings`, set as
``c.SnapshotExtensionApp.<name>`` (traitlets reads a class's config section for every
configurable class in its MRO, so the app's own name still reaches these). Apart from the
app's logic so that each stays short; ``configdoc.py`` renders them into
docs/configuration.md."""

from __future__ import annotations

import getpass
import os
from pathlib import Path
from typing import Any

from jupyter_core.paths import jupyter_data_dir
from jupyter_server.extension.application import ExtensionApp
from traitlets import Bool, Enum, Float, Int, TraitError, TraitType, Unicode, default, validate

from .core.chunking import ChunkParams
from .core.isolation.pidspace import PID_FLOOR
from .core.lazypages import LAZY_MIN_BYTES
from .core.store import KEY_SOURCES, STORE_KINDS, StoreSpec


def data_dir() -> Path:
    """Where the product keeps its files by default: <Jupyter data dir>/kernel_snapshots."""
    return Path(jupyter_data_dir()) / "kernel_snapshots"


def default_owner() -> str:
    """Whose snapshots a server (or a command beside it) keeps by default: the JupyterHub
    user of this single-user server, else the system user."""
    return os.environ.get("JUPYTERHUB_USER") or getpass.getuser()


def default_key_file() -> Path:
    """The "file" key source's default: beside the store, never in it (0700 directory)."""
    return data_dir() / "store.key"


def options() -> dict[str, TraitType[Any, Any]]:
    """Every option of the app, by name: the traits :class:`SnapshotSettings` declares and
    those it takes from :class:`CellCheckpointTraits` (not ExtensionApp's own)."""
    return {
        **CellCheckpointTraits.class_own_traits(config=True),
        **SnapshotSettings.class_own_traits(config=True),
    }


class CellCheckpointTraits(ExtensionApp):
    """The cell checkpoint options of :class:`SnapshotSettings` (docs/undo.md), a class of
    their own so that each stays short."""

    cell_checkpoints = Enum(
        ["auto", "on", "off"],
        "auto",
        config=True,
        help="""Cell checkpoints, for undo (docs/undo.md): after each cell, the kernel is
        snapshotted into work_dir/checkpoints (never uploaded), copying what the cell changed.
        "auto": for kernels whose memory is tracked (track_memory), not GPU kernels nor those
        with pinned memory (the panel says why); "on": every kernel; "off". Default: "auto".""",
    )
    cell_checkpoints_keep = Int(
        20, config=True, help="Cell checkpoints kept per kernel (the newest). Default: 20."
    )
    cell_checkpoints_max_bytes = Int(
        -1,
        config=True,
        help="""One kernel's cell checkpoints' byte budget (shared files count once): the
        oldest go past it. Default: -1, a tenth of the work directory's disk.""",
    )
    cell_checkpoint_max_change_bytes = Int(
        8 << 30, config=True, help="A cell checkpoint copying more is skipped. Default: 8 GiB."
    )
    cell_checkpoint_max_pause_share = Float(
        0.02,
        min=0.0,
        max=1.0,
        config=True,
        help="""Of a kernel's wall time, at most this share stalled by its cell checkpoints
        (requests wait while a checkpoint freezes the kernel, and it is frozen during each
        pre-copy round): after one that stalled it S seconds, the next starts no sooner
        than S / share - S seconds later, or E / share - E where it is expected to stall
        E > S (it would copy much more: a cell made new memory); then at the first idle
        after a cell, or after 5 s of quiet, and the cells run meanwhile share it (an undo
        takes them back together). At the default a checkpoint stalling 60 ms spaces the
        next by 3 s; cells further apart each get their own. 0: a checkpoint after every
        cell. Default: 0.02.""",
    )


class SnapshotSettings(CellCheckpointTraits):
    """The options of :class:`~jupyter_ext.app.SnapshotExtensionApp` (documented traits
    only; an ExtensionApp keeps them on the class, where jupyter_server reads them)."""

    owner = Unicode(
        config=True,
        help="""Whose snapshots this server keeps: the store prefix users/<owner> (a name of
        other characters than letters, digits, ".", "_", "-", or that begins with one of
        the last three, is escaped, so that no two names share a prefix: docs/storage.md).
        Default: the JupyterHub user of this single-user server ($JUPYTERHUB_USER), else
        the system user.""",
    )
    store = Unicode(
        "local",
        config=True,
        help="""Where snapshots are kept: "local" (a directory, see local_store_dir), "s3"
        (see the s3_* options) or "memory" (this process's memory, gone with it: for tests).
        Default: "local". Use "s3" to restore on another node.""",
    )
    local_store_dir = Unicode(
        config=True,
        help="""Directory of the local store. Default: <Jupyter data dir>/kernel_snapshots/store.
        Each user gets a sub-directory named after the server's identity.""",
    )
    local_store_group_access = Bool(
        False,
        config=True,
        help="""Share the local store with the members of its directory's group: its
        directories 2770 and files 0660 (0440 read-only), so that they can read, restore
        and delete each other's snapshots (a team's store on one machine). Default: False,
        owner-only (0700 / 0600 / 0400): a snapshot is the kernel's whole memory. The work
        directory is always owner-only.""",
    )
    s3_bucket = Unicode(
        "", config=True, help='S3 bucket of the s3 store. Default: "" (required for "s3").'
    )
    s3_prefix = Unicode(
        "kernel-snapshots",
        config=True,
        help="""Key prefix in the bucket. Default: "kernel-snapshots". The user's own prefix
        (users/<name>) is appended from the server's identity, never from a request.""",
    )
    s3_endpoint_url = Unicode(
        "",
        config=True,
        help="""Endpoint of an S3-compatible service (MinIO, Ceph, moto). Default: "" (AWS).
        Credentials come from the hub service (hub_service_url), else from boto3's standard
        chain (environment, files, instance role).""",
    )
    hub_service_url = Unicode(
        "",
        config=True,
        help="""URL of the product's JupyterHub service (python -m jupyter_ext.hubservice,
        docs/jupyterhub.md), e.g. "http://hub:10101/services/kernel-snapshots/". With the s3
        store, the server then holds no bucket credentials: the service signs each of its S3
        requests, and only those inside <s3_prefix>/users/<owner>/, after the hub told it
        whose token ($JUPYTERHUB_API_TOKEN) the server sent. Default: "" (credentials from
        boto3's standard chain; under a hub with one set for all users, any user's code can
        read and delete every user's snapshots: unsafe for multi-user hubs).""",
    )
    s3_region = Unicode("", config=True, help='S3 region. Default: "" (boto3 decides).')
    s3_server_side_encryption = Unicode(
        "",
        config=True,
        help="""Server-side encryption of every object the store writes: "AES256" (SSE-S3)
        or "aws:kms" (SSE-KMS, see s3_sse_kms_key_id). Default: "" (the bucket's default
        encryption, which on AWS is SSE-S3). Objects are always written private (no ACL
        grants; the bucket's policy decides who else may read them).""",
    )
    s3_sse_kms_key_id = Unicode(
        "",
        config=True,
        help="""KMS key (id, ARN or alias) for s3_server_side_encryption "aws:kms".
        Default: "" (the account's AWS-managed key aws/s3).""",
    )
    encryption_key_source = Unicode(
        "file",
        config=True,
        help="""Where the key that encrypts the store comes from (client-side encryption,
        AES-256-GCM: every pack chunk, record and claim; nobody who reads the store or the
        bucket without the key reads a snapshot). "file": a key file on this machine,
        made at first use (encryption_key_file); "env": $JUPYTER_SNAPSHOT_KEY (32 bytes,
        base64; older keys still accepted in $JUPYTER_SNAPSHOT_KEY_PREVIOUS,
        comma-separated), set by a spawner; "hub": the user's key from the product's hub
        service (hub_service_url; derived there from the hub's secret and the user's name,
        given only to this user's server); "none": no encryption, so that whoever may
        read the store or the bucket reads every snapshot (warned about at start and by
        'jupyter snapshot doctor'). A lost key makes every snapshot unreadable.
        Default: "file".""",
    )
    encryption_key_file = Unicode(
        config=True,
        help="""The key file of encryption_key_source "file" (mode 0600, made at first use;
        back it up: without it no snapshot can be read). Never inside the store.
        Default: <Jupyter data dir>/kernel_snapshots/store.key.""",
    )
    chunk_kib = Int(
        0,
        config=True,
        help="""Average size of the content-addressed chunks, in KiB (a power of two, >= 16),
        the same for every snapshot. Smaller chunks share more between successive snapshots
        of a kernel but mean more objects and requests. Default: 0, automatic: about 16384
        chunks per snapshot (16 KiB up to 256 MiB, doubling up to 1 MiB from 16 GiB), and a
        kernel keeps its chunk size while it stays within a factor of two; a second
        snapshot of an idle kernel then adds well under 2 % new bytes at any size.""",
    )
    pack_mib = Int(
        16,
        min=1,
        config=True,
        help="""Size of the pack objects that hold chunks in the store, in MiB. Chunks are
        written into packs as a snapshot is cut and read back with ranged reads, so a
        snapshot costs about one request per pack: 16 MiB (AWS's advice for ranged GETs)
        keeps a GiB under 100 requests. Default: 16.""",
    )
    work_dir = Unicode(
        config=True,
        help="""Fast local directory where kernels are dumped before upload and snapshots are
        downloaded before restore. Default: <Jupyter data dir>/kernel_snapshots/work.""",
    )
    image_cache_max_bytes = Int(
        -1,
        config=True,
        help="""Byte budget of the local image cache: the newest snapshot of each kernel stays
        unpacked in work_dir/image-cache, so that a restore on this machine reads no store
        and checks its files with one stat each (about a bare criu restore). Past the
        budget, or when less than 10 % of the disk (at most 2 GiB, and not less than the
        newest snapshot's size) would stay free, the oldest entries go. Default: -1, a
        quarter of the work directory's disk. 0 turns the cache off.""",
    )
    lazy_restore = Bool(
        True,
        config=True,
        help="""Restore kernels with CRIU's lazy pages: the kernel runs as soon as CRIU has
        rebuilt its processes, each page of memory it touches is served on demand and the
        rest streams in behind it, so the first cell answers within about a second at
        any size, its pages read from the local images (the image cache, or a download).
        A page that cannot be read stops the restored kernel (in place: the previous
        kernel is put back). Used where 'jupyter snapshot doctor' says "lazy restore" is
        supported (root), never for kernels with GPU state. Default: True.""",
    )
    lazy_restore_min_bytes = Int(
        LAZY_MIN_BYTES,
        config=True,
        help="""A kernel restored from images on this machine (the image cache, the work
        directory, a suspended kernel coming back) is restored lazily only from this much
        memory on; a smaller one is restored in full, which is faster: reading its memory
        from the page cache costs less than setting up lazy pages (bench/RESULTS.md).
        Restores lazily from the store are not affected. The server decides by it, and a
        wrapper for its suspended kernel coming back. Default: 768 MiB.""",
    )
    kernel_pid_floor = Int(
        PID_FLOOR,
        config=True,
        help="""Without root (no PID namespace per kernel), a kernel is restored with the
        process ids it had, so they must be free where it is restored. A fresh container
        (a JupyterHub pod) takes the same low ids for its own start every time, so a
        kernel started in a young pod would find its ids taken in the pod it is restored
        into. Before it starts a kernel, a wrapper whose PID namespace has not yet handed
        out this id moves the counter past it, plus a random gap of up to as much again
        (short-lived threads: about 0.5 s, once per pod). 0 turns this off. Default:
        4096.""",
    )
    lazy_restore_from_store = Bool(
        True,
        config=True,
        help="""With lazy_restore, a restore from the store into a new kernel downloads every
        image but the kernel's memory, starts the kernel, and downloads its memory as it
        runs: a page it touches that is not there yet is read from the store at once (every
        chunk checked against its sha256), so the first cell answers within about 1.5 s at
        any size (measured, bench/RESULTS.md). Restores in place never do (a damaged chunk
        must fail them before the running kernel is touched). Default: True; False
        downloads everything first.""",
    )
    track_memory = Bool(
        True,
        config=True,
        help="""Track each kernel's memory between its snapshots, so that a snapshot copies
        only what the kernel wrote since its previous one (still in this machine's image
        cache) and freezes the kernel only for that; a first snapshot (or one after a
        restore) copies the memory while the kernel runs, then freezes it for what changed
        meanwhile. Soft-dirty bits, or where Linux has none (arm64, these VMs) an
        asynchronous userfaultfd (Linux >= 6.7, the CRIU scripts/install-criu.sh builds).
        Each snapshot still restores on its own (docs/storage.md, "Snapshots cost what
        changed"). Default: True; False copies the whole memory, frozen, every time.""",
    )
    periodic_interval = Float(
        0.0,
        config=True,
        help="""Seconds between periodic snapshots of each snapshot kernel that ran something
        since its last snapshot. Default: 0, which turns periodic snapshots off. They bound
        what a node failure costs; culled kernels do not need them (cull_action suspends
        them), and suspended kernels are not snapshotted again. Before a reclaim (a spot
        instance's 30-second or 2-minute notice, a pod deleted) the snapshot taken at the
        stop (snapshot_before_shutdown) copies only what the kernel wrote since its last
        one (track_memory): measured from SIGTERM until durable in S3 (moto on the same 2
        CPUs, bench/RESULTS.md), a 4 GiB kernel with 2 % changed took 2.7 s (22 s untracked)
        and with 20 % changed 8.3 s (14.8 s): about 2 s, plus 0.25 s per GiB of the
        kernel (finding what changed, docs/storage.md), plus 7.5 s per GB changed. So
        choose the interval such that what a kernel writes in it stays below about 3.5 GB
        for a 30-second notice and 15 GB for a 2-minute one (at this S3 throughput,
        130 MB/s; scale with yours), less 1 GB per 30 GiB of the kernel: a kernel that
        rewrites at most that much between snapshots fits; one of N GiB that rewrites
        all of it every few minutes fits only if N is below those sizes.""",
    )
    long_cell_seconds = Float(
        60.0,
        config=True,
        help="""Snapshot a kernel after a cell that ran at least this many seconds (timed
        from its start to its reply; queued cells do not count their wait): that work is
        worth keeping. Default: 60. 0 turns these snapshots off.""",
    )
    long_cell_min_interval = Float(
        300.0,
        config=True,
        help="""At most one long-cell snapshot per kernel within this many seconds.
        Default: 300 (5 minutes).""",
    )
    keep_last = Int(
        10,
        config=True,
        help="""Snapshots kept per notebook (by sequence number; the newest is never deleted),
        before the older ones are thinned (keep_hourly_hours, keep_daily_days).
        Default: 10. 0 keeps all.""",
    )
    keep_hourly_hours = Int(
        24,
        config=True,
        help="""Beyond keep_last, keep the newest snapshot of each hour of the last this many
        hours (restic's --keep-within-hourly). Default: 24. 0: none.""",
    )
    keep_daily_days = Int(
        7,
        config=True,
        help="""Beyond those, keep the newest snapshot of each day of the last this many days
        (restic's --keep-within-daily). Default: 7. 0: none.""",
    )
    max_store_bytes = Int(
        0,
        config=True,
        help="""Byte budget of a user's store; older snapshots are deleted past it (never the
        newest of a notebook). Default: 0, no budget.""",
    )
    snapshot_before_shutdown = Bool(
        True,
        config=True,
        help="""Snapshot every running snapshot kernel when the server is asked to stop.
        Default: True.""",
    )
    shutdown_snapshot_timeout = Float(
        60.0,
        config=True,
        help="""Seconds the server waits for the snapshots taken at shutdown. Default: 60.""",
    )
    idle_suspend_after = Float(
        1800.0,
        config=True,
        help="""Seconds a kernel holding GPU memory may stay idle before it is suspended
        (snapshot, process ended, GPU freed); the next cell brings it back. Default: 1800
        (30 minutes). 0 turns idle suspend off. Shorter than jupyter_server's
        MappingKernelManager.cull_idle_timeout, it comes first and the culler then leaves
        the suspended kernel alone; longer (or off), the culler's suspend comes first
        (cull_action).""",
    )
    cull_action = Enum(
        ["suspend", "shutdown"],
        "suspend",
        config=True,
        help="""What jupyter_server's own kernel culler (MappingKernelManager.
        cull_idle_timeout, cull_interval, cull_connected, cull_busy) does to a snapshot
        kernel it finds idle. Default: "suspend": the kernel is suspended instead of
        shut down (as idle_suspend_after does: snapshot, process ended, memory, GPU and
        ports freed); it stays listed with its session, so an open tab's next cell, or
        the notebook opened again, brings it back with its state. A suspended kernel is
        never culled: it holds no process but its wrapper (a few MB) and its snapshot in
        work_dir/suspended, removed when the kernel is shut down or restarted or its
        server stops. A kernel that cannot be suspended (busy, with cull_busy) is
        snapshotted and then shut down; a kernel left without a snapshot is named in the
        log and an "unsaved" event.
        "shutdown": the culler shuts kernels down, their state lost (jupyter_server's own
        behaviour). Kernels other than snapshot kernels are always shut down. A shutdown
        the user asks for (DELETE /api/kernels/ID or /api/sessions/ID: Shut Down Kernel,
        closing a notebook with its kernel) is never turned into a suspend; one asked by
        someone else: admin_shutdown_action. With idle_suspend_after shorter than
        cull_idle_timeout, idle suspend comes first and the culler then finds the kernel
        suspended; periodic_interval snapshots are taken of running kernels only.
        jupyterhub-idle-culler stops whole servers, not kernels: suspended kernels make no
        activity that keeps a server alive, and a stopping server snapshots its running
        kernels (snapshot_before_shutdown). See docs/jupyterhub.md, "Kernel culling".""",
    )
    admin_shutdown_action = Enum(
        ["shutdown", "suspend"],
        "shutdown",
        config=True,
        help="""What a kernel shutdown asked through the REST API (DELETE /api/kernels/ID,
        DELETE /api/sessions/ID) by someone other than the server's owner does to a
        snapshot kernel: on JupyterHub a hub admin, a service, or a user the server is
        shared with, anyone whose hub name is not the owner setting (by default the
        server's $JUPYTERHUB_USER). Default: "shutdown": the kernel is shut down, its
        state lost (jupyter_server's behaviour). "suspend": the kernel is suspended
        instead, as cull_action "suspend" does with a culled one (a busy kernel is
        snapshotted, then shut down; an already suspended one stays as it is; its snapshot's
        trigger is "admin-shutdown"); the kernel and its session stay, and the owner's next
        cell brings the state back. The owner's own shutdowns always shut down. Without
        identities that tell users apart (jupyter_server's own token or password login:
        every login is the owner) it has no effect, and the server says so in its log.""",
    )
    restore_on_death = Bool(
        False,
        config=True,
        help="""When a snapshot kernel dies (killed, by the out-of-memory killer or anyone,
        or crashed; its wrapper too, and jupyter_client starts it again), restore its last
        snapshot into it at once instead of offering it in the notebook ("The kernel died
        (killed by the out-of-memory killer at 14.2 GiB). Restore its snapshot from 22:13,
        3 cells earlier?"); the notebook then says which cells were not restored. The
        REST status (GET /api/snapshots/kernels/ID, "death") says either way that it died,
        why, and the snapshot offered. Default: False (offered).""",
    )
    release_gpu_caches = Bool(
        True,
        config=True,
        help="""Before a GPU kernel's memory is checkpointed, ask the kernel to give back
        the GPU memory its frameworks cache but do not use (PyTorch's caching allocator,
        CuPy's memory pools), so snapshots do not carry it. Only frameworks the kernel has
        imported are touched; the kernel re-allocates on demand. Default: True.""",
    )
    suspend_cpu_kernels = Bool(
        False,
        config=True,
        help="""Also suspend idle kernels that hold no GPU memory. Default: False.""",
    )
    upload_retry_interval = Float(
        60.0,
        config=True,
        help="""Seconds between retries of uploads that failed. Default: 60.""",
    )
    policy_tick = Float(
        10.0,
        config=True,
        help="""Seconds between two looks at the kernels for periodic snapshots, idle suspend
        and upload retries. Default: 10.""",
    )

    @validate("chunk_kib")
    def _valid_chunk_kib(self, proposal: dict[str, Any]) -> int:
        kib = int(proposal["value"])
        if kib:
            try:
                ChunkParams.of_kib(kib)
            except ValueError as exc:
                raise TraitError(
                    f"SnapshotExtensionApp.chunk_kib must be 0 (automatic) or a power of two "
                    f"of at least 16, not {kib} ({exc})."
                ) from None
        return kib

    @default("owner")
    def _default_owner(self) -> str:
        return default_owner()

    @default("encryption_key_file")
    def _default_encryption_key_file(self) -> str:
        return str(default_key_file())

    @validate("store")
    def _valid_store(self, proposal: dict[str, Any]) -> str:
        if proposal["value"] not in STORE_KINDS:
            choices = ", ".join(f'"{n}"' for n in STORE_KINDS)
            raise TraitError(
                f"SnapshotExtensionApp.store must be one of {choices}, not {proposal['value']!r}."
            )
        return str(proposal["value"])

    @validate("encryption_key_source")
    def _valid_key_source(self, proposal: dict[str, Any]) -> str:
        name = str(proposal["value"])
        if name != "none" and name not in KEY_SOURCES:
            choices = ", ".join(f'"{n}"' for n in [*KEY_SOURCES, "none"])
            raise TraitError(
                f"SnapshotExtensionApp.encryption_key_source must be one of {choices}, "
                f"not {name!r}."
            )
        return name

    def option_values(self) -> dict[str, Any]:
        """Every option above by name: the settings a store is made from
        (:meth:`StoreSpec.from_settings`), as the CLI also reads them."""
        return {name: getattr(self, name) for name in SnapshotSettings.class_own_traits()}

    def store_spec(self) -> StoreSpec:
        """The owner's store: its prefix comes from the server's identity, not a request."""
        return StoreSpec.from_settings(self.option_values())

    @default("local_store_dir")
    def _default_local_store_dir(self) -> str:
        return str(data_dir() / "store")

    @default("work_dir")
    def _default_work_dir(self) -> str:
        return str(data_dir() / "work")
