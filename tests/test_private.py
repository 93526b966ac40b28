"""Snapshots are private: a snapshot is a kernel's whole memory, so nothing of the product's
is readable by another user, whatever the umask, and its sockets answer its own user only.

The unit tests run under any user; the two-user tests need root (they create two ordinary
users and run one's server and the other's attempts, as a shared host would).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import random
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import zmq

from jupyter_ext.core import private
from jupyter_ext.core.doctor import check_private
from jupyter_ext.core.lazypages import DirectoryPages, RangeServer
from jupyter_ext.core.private import GROUP_SHARED
from jupyter_ext.core.protocol.control import StatusArgs
from jupyter_ext.core.store import LocalStore, S3Encryption, S3Store, StoreError
from kernel_wrapper.channels import InnerChannels
from kernel_wrapper.control import ControlServer
from testkit.processes import MotoServer, ServerProcess

from .support.servers import follow, ws_execute
from .support.stores import make_snapshot, random_pages

OWNER = "jks-tester"
OTHER = "jks-other"
SECRET = "TOPSECRET-"


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes_under(root: Path) -> dict[str, int]:
    """Every path under ``root`` (itself too) with its permission bits."""
    found = {".": stat.S_IMODE(root.lstat().st_mode)}
    for path in root.rglob("*"):
        found[path.relative_to(root).as_posix()] = stat.S_IMODE(path.lstat().st_mode)
    return found


def assert_owner_only(root: Path) -> None:
    """Directories 0700, files 0600 or 0400 (read-only): nothing for group or others."""
    loose = {}
    for rel, mode in modes_under(root).items():
        path = root / rel
        wanted = {0o700} if path.is_dir() and not path.is_symlink() else {0o600, 0o400}
        if path.is_socket():
            wanted = {0o600, 0o700}
        if mode not in wanted:
            loose[rel] = oct(mode)
    assert not loose, f"not owner-only under {root}: {loose}"


# -- files ----------------------------------------------------------------------------------


def test_made_directories_and_files_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    with umask(0):
        private.make_dirs(tmp_path / "a" / "b" / "c")
        private.write_file(tmp_path / "a" / "b" / "c" / "f", b"x")
        private.make_dirs(tmp_path / "g" / "h", GROUP_SHARED)
        private.write_file(tmp_path / "g" / "h" / "f", "x", GROUP_SHARED.file)
    assert_owner_only(tmp_path / "a")
    assert modes_under(tmp_path / "g") == {".": 0o2770, "h": 0o2770, "h/f": 0o660}


def test_a_linked_copy_is_owner_only_while_it_is_made(tmp_path: Path) -> None:
    """The copy a suspend hands the store (hard links of the wrapper's images): every
    directory is 0700 from its mkdir on, which shutil.copytree only sets at its end (the
    CI failure this replaced), and the files are the same inodes."""
    source = tmp_path / "images"
    private.make_dirs(source / "pages" / "deep")
    private.write_file(source / "pages" / "deep" / "p.img", b"p")
    private.write_file(source / "core.img", b"c")
    os.symlink("core.img", source / "link")
    made: list[int] = []
    real_mkdir = Path.mkdir

    def mkdir(self: Path, mode: int = 0o777, *args: Any, **kwargs: Any) -> None:
        made.append(mode)
        real_mkdir(self, mode, *args, **kwargs)

    with umask(0), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "mkdir", mkdir)
        private.link_tree(source, tmp_path / "staging" / "copy")
    copy = tmp_path / "staging" / "copy"
    assert made
    assert set(made) == {0o700}
    assert os.readlink(copy / "link") == "core.img"  # a link has no mode of its own
    (copy / "link").unlink()
    assert_owner_only(copy)
    assert (copy / "pages" / "deep" / "p.img").stat().st_ino == (
        source / "pages" / "deep" / "p.img"
    ).stat().st_ino


def test_a_local_store_is_owner_only_under_umask_000(tmp_path: Path) -> None:
    """Records, packs, claims and adopted images, and a download: under the loosest umask
    nothing the store writes lets another user in."""
    store = LocalStore(tmp_path / "store", grace_seconds=0)
    with umask(0):
        source = make_snapshot(tmp_path / "work", random_pages(random.Random(1), 2048))
        stored = store.put(source)
        fetched = store.fetch(stored.manifest.id, tmp_path / "work" / "cache" / "one")
    store.close()
    assert_owner_only(tmp_path / "store")
    assert (tmp_path / "store" / "snapshots" / f"{stored.manifest.id}.json").exists()
    packs = list((tmp_path / "store").glob("packs/*/*"))
    assert packs
    assert {stat.S_IMODE(p.stat().st_mode) for p in packs} == {0o400}
    assert_owner_only(fetched)


def test_a_group_shared_store_lets_the_group_in_and_nobody_else(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", grace_seconds=0, modes=GROUP_SHARED)
    with umask(0):
        source = make_snapshot(tmp_path / "work", random_pages(random.Random(2), 256))
        store.put(source)
    store.close()
    found = modes_under(tmp_path / "store")
    dirs = {m for rel, m in found.items() if (tmp_path / "store" / rel).is_dir()}
    files = {m for rel, m in found.items() if (tmp_path / "store" / rel).is_file()}
    assert dirs == {0o2770}
    assert files == {0o440}


def test_tighten_mends_an_older_stores_modes_and_says_what_it_changed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (root / "packs" / "ab").mkdir(parents=True)
    (root / "packs" / "ab" / "pack").write_bytes(b"secret")
    (root / "snapshots").mkdir()
    (root / "snapshots" / "x.json").write_text("{}")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (root / "link").symlink_to("/etc/passwd")  # never followed, never changed

    changed = LocalStore(root).tighten()

    assert {c.path.relative_to(root).as_posix() for c in changed} == {
        ".",
        "packs",
        "packs/ab",
        "packs/ab/pack",
        "snapshots",
        "snapshots/x.json",
    }
    assert "0755 -> 0700" in changed[0].describe()
    assert stat.S_IMODE(Path("/etc/passwd").stat().st_mode) == 0o644
    (root / "link").unlink()
    assert_owner_only(root)
    assert LocalStore(root).tighten() == []


def test_doctor_names_what_others_can_read_and_a_parent_open_to_all(tmp_path: Path) -> None:
    mine = private.make_dirs(tmp_path / "mine" / "store")
    assert check_private([mine]).ok
    (mine / "pack").write_bytes(b"x")
    (mine / "pack").chmod(0o644)
    check = check_private([mine])
    assert not check.ok
    assert f"{mine / 'pack'} (0644 -> 0600)" in check.detail
    assert "chmod -R go=" in check.fix
    (mine / "pack").chmod(0o600)
    (tmp_path / "mine").chmod(0o777)  # anyone could move the store away and put theirs
    check = check_private([mine])
    assert not check.ok
    assert f"{tmp_path / 'mine'} is writable by all" in check.detail
    (tmp_path / "mine").chmod(0o1777)  # sticky, as /tmp: only the owner may rename
    assert check_private([mine]).ok


# -- S3 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("encryption", "expected"),
    [
        (S3Encryption(), None),
        (S3Encryption("AES256"), ("AES256", None)),
        (S3Encryption("aws:kms", "alias/snapshots"), ("aws:kms", "alias/snapshots")),
    ],
)
def test_s3_objects_are_private_and_encrypted_as_configured(
    moto: MotoServer,
    tmp_path: Path,
    encryption: S3Encryption,
    expected: tuple[str, str | None] | None,
) -> None:
    bucket = moto.ensure_bucket("private-snapshots")
    prefix = f"users/{os.urandom(4).hex()}"
    store = S3Store(
        bucket, prefix, endpoint_url=moto.url, region="us-east-1", encryption=encryption
    )
    source = make_snapshot(tmp_path, random_pages(random.Random(3), 256))
    store.put(source)
    client = store.client
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    assert any("/snapshots/" in k for k in keys)
    assert any("/packs/" in k for k in keys)
    for key in keys:
        grants = client.get_object_acl(Bucket=bucket, Key=key)["Grants"]
        assert [g["Permission"] for g in grants] == ["FULL_CONTROL"], (key, grants)
        assert grants[0]["Grantee"]["Type"] == "CanonicalUser"
        head = client.head_object(Bucket=bucket, Key=key)
        if expected is None:
            assert "SSEKMSKeyId" not in head
        else:
            assert head["ServerSideEncryption"] == expected[0], key
            assert (expected[1] is None) or expected[1] in head.get("SSEKMSKeyId", ""), head
    store.close()


@pytest.mark.parametrize(
    ("encryption", "said"),
    [
        (S3Encryption("rot13"), "Unknown S3 server-side encryption 'rot13'"),
        (S3Encryption("AES256", "key"), "KMS key id is set"),
    ],
)
def test_a_wrong_s3_encryption_setting_is_named(encryption: S3Encryption, said: str) -> None:
    client = boto3.session.Session().client("s3", region_name="us-east-1")
    with pytest.raises(StoreError, match=said) as caught:
        S3Store("bucket", client=client, encryption=encryption)
    assert "s3_server_side_encryption" in caught.value.hint


# -- sockets: another user is refused whatever the path's mode ------------------------------

needs_root = pytest.mark.needs_root("connects as another user (setpriv)")


def as_other_user(code: str, timeout: float = 30) -> str:
    """Run Python ``code`` as nobody; its stdout."""
    nobody = pwd.getpwnam("nobody")
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={nobody.pw_uid}",
            f"--regid={nobody.pw_gid}",
            "--clear-groups",
            sys.executable,
            "-c",
            textwrap.dedent(code),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        cwd="/",
    ).stdout


def control_probe(path: Path) -> str:
    """Python code that asks a wrapper's control socket for the kernel's status and prints
    the answer, or "closed unanswered"."""
    request = json.dumps({"op": "status", "args": {}})
    return f"""
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.connect({str(path)!r})
        try:
            s.sendall({request!r}.encode() + b"\\n")
            answer = s.recv(4096)
        except OSError:
            answer = b""
        print(answer.decode() if answer else "closed unanswered")
    """


def open_to_all(*paths: Path) -> None:
    """Modes that let anyone in (pytest's directories above too): only the peer checks
    are left to refuse."""
    for path in paths:
        path.chmod(0o777)
        for parent in path.parents:
            parent.chmod(parent.stat().st_mode | 0o001)


@needs_root
def test_the_control_socket_refuses_another_user(tmp_path: Path) -> None:
    async def status(_progress: Any, _args: StatusArgs) -> dict[str, str]:
        return {"state": "secret"}

    async def scenario() -> tuple[str, str]:
        server = ControlServer(tmp_path / "control", {"status": status})
        await server.start()
        open_to_all(tmp_path, tmp_path / "control")
        request = json.dumps({"op": "status", "args": {}})
        theirs = await asyncio.to_thread(as_other_user, control_probe(tmp_path / "control"))
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "control"))
        writer.write(request.encode() + b"\n")
        ours = (await reader.readline()).decode()
        writer.close()
        server.close()
        await asyncio.sleep(0.1)  # the listener's close runs on the loop
        return theirs, ours

    theirs, ours = asyncio.run(scenario())
    assert theirs.strip() == "closed unanswered"
    assert json.loads(ours) == {"ok": True, "result": {"state": "secret"}}


@needs_root
def test_the_page_server_refuses_another_user(tmp_path: Path) -> None:
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "pages-1.img").write_bytes(SECRET.encode() * 100)
    server = RangeServer(DirectoryPages(tmp_path / "pages"), tmp_path / "pages.sock")
    try:
        open_to_all(tmp_path, tmp_path / "pages.sock")
        code = f"""
            from pathlib import Path
            from jupyter_ext.core.lazypages import RemotePages
            pages = RemotePages(Path({str(tmp_path / "pages.sock")!r}))
            try:
                print(pages.read("pages-1.img", 0, 10))
            except OSError as exc:
                print("refused:", exc)
        """
        theirs = as_other_user(code)
        assert SECRET not in theirs
        assert theirs.startswith("refused:")  # reset or closed, never an answer
        ours = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True
        )
        assert ours.stdout.strip() == "b'TOPSECRET-'", ours
    finally:
        server.close()


@needs_root
def test_the_kernel_channels_refuse_another_user(tmp_path: Path) -> None:
    """The endpoints the inner kernel connects to: a process of another user that reaches
    one (a looser directory) is not connected (libzmq checks its SO_PEERCRED)."""
    channels = InnerChannels(tmp_path)
    try:
        open_to_all(tmp_path, *channels.paths)
        endpoint = f"ipc://{channels.paths[0]}"
        code = f"""
            import zmq, time
            s = zmq.Context().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 2000)
            s.connect({endpoint!r})
            s.send(b"from another user")
            time.sleep(1)
            print("sent")
        """
        assert as_other_user(code).strip() == "sent"
        shell = next(iter(channels.sockets.values()))
        assert not asyncio.run(_received(shell, 1.0))
        ours = zmq.Context.instance().socket(zmq.DEALER)
        ours.connect(endpoint)
        ours.send(b"from this user")
        assert asyncio.run(_received(shell, 10.0)) == [b"from this user"]
        ours.close(0)
    finally:
        channels.close()


async def _received(sock: Any, timeout: float) -> list[bytes] | None:
    if not await sock.poll(timeout * 1000):
        return None
    return list(await sock.recv_multipart())


# -- two users of one machine ---------------------------------------------------------------


def ensure_user(name: str, *groups: str) -> pwd.struct_passwd:
    """An ordinary user (made if missing, with a home of Debian's default mode)."""
    with contextlib.suppress(KeyError):
        user = pwd.getpwnam(name)
        for group in groups:
            subprocess.run(["usermod", "-aG", group, name], check=True)
        return user
    member = ["-G", ",".join(groups)] if groups else []
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", *member, name], check=True)
    return pwd.getpwnam(name)


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", user, "--", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.usefixtures("criu")
@pytest.mark.needs_root("makes two ordinary users and acts as each")
def test_another_user_reads_nothing_of_a_users_snapshots(tmp_path: Path) -> None:
    """User A's server (non-root mode, umask 000: the loosest) snapshots a kernel holding
    a secret, and suspends another; user B can list, read or open nothing of it, and a
    grep of A's whole tree for the secret finds nothing, not even through A's sockets."""
    ensure_user(OWNER, "jupyter-snapshots")
    ensure_user(OTHER)
    home = tmp_path / "a"
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    server = ServerProcess(
        home,
        notebooks,
        {"SnapshotExtensionApp": {"idle_suspend_after": 0, "snapshot_before_shutdown": False}},
        user=OWNER,
        umask=0,
    )
    try:
        for path in (home, *home.parents):  # as a home directory is: 0755
            path.chmod(path.stat().st_mode | 0o005)
        kernel = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        ws_execute(server, kernel, f"secret = {SECRET!r} * 1000")
        job = server.client.call("POST", "", body={"kernel_id": kernel})["job"]
        assert follow(server, job)["result"]["status"] == "complete"
        other = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
        ws_execute(server, other, f"also = {SECRET!r} * 1000")
        follow(server, server.client.call("POST", f"kernels/{other}/suspend", body={})["job"])

        products = home / "data" / "kernel_snapshots"
        assert_owner_only(products)
        images = [p for p in products.rglob("pages-*.img")]
        assert images, "the image cache holds the snapshot's memory"
        assert any(SECRET.encode() in p.read_bytes() for p in images)  # as root: it is there

        found = as_user(OTHER, "grep", "-rl", SECRET, str(home))
        assert found.stdout == "", found.stdout
        assert "Permission denied" in found.stderr
        for path in [products, *products.rglob("*")]:
            if path.is_dir():
                assert as_user(OTHER, "ls", str(path)).returncode != 0, path
            else:
                assert as_user(OTHER, "head", "-c1", str(path)).returncode != 0, path

        # A's sockets, even opened up to all: B is refused by their peer checks.
        runtime = home / "kernels"
        controls = list(runtime.glob("*/control"))
        assert controls
        for path in [runtime, *runtime.iterdir(), *controls]:
            path.chmod(0o777)
        probe = textwrap.dedent(control_probe(controls[0]))
        refused = as_user(OTHER, sys.executable, "-c", probe)
        assert refused.stdout.strip() == "closed unanswered", refused
        answered = as_user(OWNER, sys.executable, "-c", probe)
        assert '"ok": true' in answered.stdout, answered  # the same probe, as A: answered
    finally:
        server.stop()


@pytest.mark.usefixtures("criu")
@pytest.mark.needs_root("makes an ordinary user and an older version's store")
def test_a_server_tightens_a_store_an_older_version_left_open(tmp_path: Path) -> None:
    owner = ensure_user(OWNER, "jupyter-snapshots")
    home = tmp_path / "a"
    old = home / "data" / "kernel_snapshots"
    user_store = old / "store" / "users" / OWNER / "packs" / "ab"
    user_store.mkdir(parents=True)
    (user_store / "pack").write_bytes(SECRET.encode())
    (old / "work" / "image-cache").mkdir(parents=True)
    for path in [old, *old.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
        os.chown(path, owner.pw_uid, owner.pw_gid)
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    server = ServerProcess(
        home,
        notebooks,
        {"SnapshotExtensionApp": {"owner": OWNER, "snapshot_before_shutdown": False}},
        user=OWNER,
    )
    try:
        assert_owner_only(old / "store" / "users" / OWNER)
        assert_owner_only(old / "work")
        assert "other users could read are now owner-only" in server.log()
        assert f"{user_store / 'pack'} (0644 -> 0600)" in server.log()
    finally:
        server.stop()


class OpenPaths:
    """Every path under ``roots`` another user could read or enter, as seen by a look
    after each job and by a thread that looks all the time while jobs run (a folder made
    open and closed later, or removed at its job's end, is caught while it lives)."""

    def __init__(self, *roots: Path) -> None:
        self.roots = roots
        self.seen: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def look(self) -> dict[str, str]:
        found = {}
        for root in self.roots:
            for path in [root, *root.rglob("*")] if root.exists() else []:
                try:
                    st = path.lstat()
                except FileNotFoundError:
                    continue  # removed while looked at
                if stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    continue  # sockets check their peer (tests above); links have no mode
                wanted = {0o700} if stat.S_ISDIR(st.st_mode) else {0o600, 0o400}
                if stat.S_IMODE(st.st_mode) not in wanted:
                    found[str(path)] = oct(stat.S_IMODE(st.st_mode))
        return found

    def _watch(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):  # a path removed while it was looked at
                self.seen.update(self.look())

    def __enter__(self) -> OpenPaths:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.usefixtures("criu")
@pytest.mark.needs_root("restores a copy beside the running kernel: a PID namespace each")
def test_every_folder_a_job_makes_is_owner_only_from_the_start(tmp_path: Path) -> None:
    """A server under umask 022 (the common one): after a snapshot, a suspend and its
    resume, a restore in place and into a new kernel, variables taken back and a deletion,
    every folder under the store, the work directory, the wrappers' runtime directory and
    the product's data directory is 0700 and every file 0600 (0400 read-only), also
    those that live only while their job runs."""
    home = tmp_path / "home"
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    server = ServerProcess(
        home,
        notebooks,
        {"SnapshotExtensionApp": {"idle_suspend_after": 0, "snapshot_before_shutdown": False}},
        umask=0o022,
    )
    products = home / "data" / "kernel_snapshots"
    watcher = OpenPaths(products, home / "kernels")
    after: dict[str, dict[str, str]] = {}
    try:
        with watcher:
            kernel = server.api("POST", "api/kernels", {"name": "python3-snapshot"})["id"]
            ws_execute(server, kernel, "x = 42\nimport numpy\nbig = numpy.ones(1 << 20)")
            taken = follow(server, job(server, "", {"kernel_id": kernel}))
            snapshot_id = taken["result"]["id"]
            after["snapshot"] = watcher.look()
            follow(server, job(server, f"kernels/{kernel}/suspend", {}))
            after["suspend"] = watcher.look()
            follow(server, job(server, f"kernels/{kernel}/resume", {}))
            after["resume"] = watcher.look()
            body = {"kernel_id": kernel}
            follow(server, job(server, f"{snapshot_id}/restore", body))
            after["restore in place"] = watcher.look()
            body = {"path": "copy.ipynb"}
            follow(server, job(server, f"{snapshot_id}/restore", body))
            after["restore into a new kernel"] = watcher.look()
            body = {"kernel_id": kernel, "names": ["x"], "overwrite": True}
            follow(server, job(server, f"{snapshot_id}/variables", body))
            after["take-back"] = watcher.look()
            server.client.call("DELETE", snapshot_id)
            after["delete"] = watcher.look()
        assert any(products.rglob("*")), "the jobs made folders to look at"
        assert {job: paths for job, paths in after.items() if paths} == {}
        assert watcher.seen == {}, "open while a job ran"
    finally:
        server.stop()


def job(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a request that starts a job; the job."""
    started: dict[str, Any] = server.client.call("POST", path, body=body)["job"]
    return started
