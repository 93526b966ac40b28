"""Resume in seconds: snapshot until durable and restore until a cell's first output,
through the REST API, beside the ceilings of the parts it uses, in one run.

For each kernel size (numpy random floats: they neither compress nor deduplicate):

- ours, through the REST API of a real jupyter_server with this extension, three ways:
  ``local`` (the local store, image cache off: the restore reads the store), ``s3`` (moto
  on 127.0.0.1, image cache off) and ``cache`` (local store, image cache on: a restore
  on the same machine). Snapshot: ``POST /api/snapshots`` until the job is done (the
  snapshot is durable); restore: ``POST /api/snapshots/<id>/restore`` into a new kernel
  until the first output of ``print`` in it. The job's phases are timed as polled.
  A second snapshot of the idle kernel gives the share of new bytes.
- the ceilings, on the same kernel size: bare ``criu dump`` of a plain ipykernel (and the
  same plus an ``fsync`` of its images: the price of durability on this disk), bare
  ``criu restore`` until a cell's first output, and boto3 PUT / GET of the same images as
  16 MiB objects with 8 threads to the same S3 server.

A restore from a store into a new kernel is lazy (the default): the kernel answers while
its memory still arrives; "all memory in" is when the last page was there (the kernel's
status). ``local`` and ``s3`` download first (``lazy_restore_from_store`` off);
``local-lazy`` and ``s3-lazy`` are the same stores with the default.

Every store is encrypted (the default, issue #33); ``--plain`` adds twins of the S3 ways
with encryption off (``s3-plain``, ``s3-lazy-plain``, each a prefix of its own) and the raw
AES-256-GCM throughput of this machine (the product's own sealing of 16 KiB chunks, one
thread and all cores): goal, S3 durable and S3 restore to first output within 5 % of the
unencrypted ones of the same run. ``--ways s3,s3-lazy`` runs only those ways (and their
twins).

Goals (issue #16): S3 durable <= 2.5x raw PUT; S3 restore <= 2.5x raw GET (or under 2 s
lazily); local durable <= 3x bare dump; same-machine restore <= 1.3x bare restore;
second snapshot of an idle kernel <= 2 % new bytes.

    sudo nice -n 5 .venv/bin/python bench/bench_resume.py --sizes 256,1024,4096 --json out.json
    sudo nice -n 5 .venv/bin/python bench/bench_resume.py --sizes 256,1024 --ways s3,s3-lazy --plain
    sudo nice -n 5 .venv/bin/python bench/bench_resume.py --sizes 256,1024 --ways s3,s3-lazy \
        --plain --repeat 5 --no-ceilings    # the encryption goal, medians of 5 interleaved runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import (
    MIB,
    QUIET,
    BareKernel,
    Deadline,
    MotoServer,
    Server,
    criu_dump,
    criu_restore,
    extension_config,
)

from jupyter_ext.core.criu import Criu
from jupyter_ext.core.humanize import human_bytes

OBJECT = 16 * MIB
BUCKET = "bench-resume"
ALLOCATE = "import numpy as np\ndata = np.random.default_rng(7).random({n})\nprint(data[:3].sum())"


def ours(server: Server, mib: int, timeout: float) -> dict[str, Any]:
    """Snapshot until durable, a second one, restore into a new kernel until first output."""
    deadline = Deadline(timeout)
    kernel = server.start_session(f"k{mib}-{time.monotonic_ns()}.ipynb", "python3-snapshot")
    server.execute(kernel, ALLOCATE.format(n=mib * MIB // 8), deadline.left())
    snap = server.run_job("api/snapshots", {"kernel_id": kernel}, deadline)
    first = snap.result
    second = server.run_job("api/snapshots", {"kernel_id": kernel}, deadline).result
    server.end_sessions()
    started = time.monotonic()
    restore_run = server.run_job(f"api/snapshots/{second['id']}/restore", {}, deadline)
    restored = restore_run.result
    ready = server.execute(restored["kernel_id"], "print('ready')", deadline.left())
    restore = time.monotonic() - started - ready["elapsed"] + ready["first_output"]
    # A lazy restore goes on after that first output: when had the kernel all its memory?
    while True:
        status = server.api("GET", f"api/snapshots/kernels/{restored['kernel_id']}")
        lazy = status.get("lazy_restore") or {}
        if lazy.get("state") != "transferring":
            break
        deadline.left()
        time.sleep(0.02)
    all_in = time.monotonic() - started
    server.end_sessions()
    return {
        "durable": snap.seconds,
        "pause": first.get("pause_seconds"),
        "image_bytes": first.get("total_bytes"),
        "stored_bytes": first.get("stored_bytes"),
        "second_new_share": second["new_bytes"] / max(second["stored_bytes"], 1),
        "restore": restore,
        "all_memory_in": all_in,
        "lazy": lazy,
        "snapshot_phases": snap.phases,
        "restore_phases": restore_run.phases,
    }


def s3_client(url: str) -> Any:
    """boto3's S3 client for the moto server at ``url``, 16 connections."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        config=Config(max_pool_connections=16),
    )


def ceilings(work: Path, criu: Criu, s3: Any, mib: int, timeout: float) -> dict[str, Any]:
    """Bare CRIU dump / restore of the same kernel size, and raw S3 PUT / GET of its images."""
    deadline = Deadline(timeout)
    kernel = BareKernel(work)
    restored_pid = None
    images = work / "images"
    try:
        kernel.run(ALLOCATE.format(n=mib * MIB // 8), deadline.left())
        kernel.disconnect()
        started = time.monotonic()
        criu_dump(criu, kernel.pid, images, None, deadline)
        dump = time.monotonic() - started
        files = [p for p in images.iterdir() if p.is_file()]
        for path in files:  # durable: as the store makes its packs
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        dump_durable = time.monotonic() - started
        kernel.kill()
        subprocess.run(["sync"], check=True)
        started = time.monotonic()
        restored_pid = criu_restore(criu, images, work / "restored.pid", deadline, verbose=False)
        kernel.connect()
        sent = time.monotonic()
        ready = kernel.run("print('ready')", deadline.left())
        restore = sent - started + ready["first_output"]
        put, get, total = raw_s3(s3, files)
        return {
            "dump": dump,
            "dump_durable": dump_durable,
            "restore": restore,
            "raw_put": put,
            "raw_get": get,
            "image_bytes": total,
        }
    finally:
        kernel.kill()
        if restored_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(restored_pid, 9)
        shutil.rmtree(images, ignore_errors=True)


def raw_s3(s3: Any, files: list[Path]) -> tuple[float, float, int]:
    """boto3 PUT, then GET, of the files' bytes as 16 MiB objects, 8 at a time."""
    pieces = [(path, offset) for path in files for offset in range(0, path.stat().st_size, OBJECT)]

    def put(item: tuple[int, tuple[Path, int]]) -> int:
        index, (path, offset) = item
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read(OBJECT)
        s3.put_object(Bucket=BUCKET, Key=f"raw/{index}", Body=data)
        return len(data)

    def get(index: int) -> int:
        body = s3.get_object(Bucket=BUCKET, Key=f"raw/{index}")["Body"].read()
        return len(body)

    with ThreadPoolExecutor(8) as pool:
        started = time.monotonic()
        total = sum(pool.map(put, enumerate(pieces)))
        put_seconds = time.monotonic() - started
        started = time.monotonic()
        sum(pool.map(get, range(len(pieces))))
        get_seconds = time.monotonic() - started
    s3.delete_objects(
        Bucket=BUCKET, Delete={"Objects": [{"Key": f"raw/{i}"} for i in range(len(pieces))]}
    )
    return put_seconds, get_seconds, total


def servers(work: Path, moto: MotoServer, ways: set[str], plain: bool) -> dict[str, Server]:
    root = work / "notebooks"
    configs = {
        "local": {"local_store_dir": str(work / "store-local"), "image_cache_max_bytes": 0},
        "s3": {
            "store": "s3",
            "s3_bucket": BUCKET,
            "s3_endpoint_url": moto.url,
            "s3_region": "us-east-1",
            "image_cache_max_bytes": 0,
        },
        "cache": {"local_store_dir": str(work / "store-cache")},
    }
    # "local" and "s3" download first; the same stores again restoring lazily from the
    # store (lazy_restore_from_store, the default).
    for name in ("local", "s3"):
        configs[f"{name}-lazy"] = {  # a store of its own: nothing deduplicated across
            **configs[name],
            **(
                {"local_store_dir": str(work / "store-local-lazy")}
                if name == "local"
                else {"s3_prefix": "lazy"}
            ),
        }
        configs[name]["lazy_restore_from_store"] = False
    if plain:  # unencrypted twins, each with a prefix of its own
        for name in ("s3", "s3-lazy"):
            configs[f"{name}-plain"] = {
                **configs[name],
                "s3_prefix": f"{name}-plain",
                "encryption_key_source": "none",
            }
    configs = {  # each unencrypted twin right after its way: the load of the moment is shared
        name: configs[name]
        for name in sorted(configs, key=lambda n: list(configs).index(n.removesuffix("-plain")))
        if not ways or name in ways or name.removesuffix("-plain") in ways
    }
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    made = {}
    for name, extra in configs.items():
        config = extension_config(work / f"snapwork-{name}", **QUIET, **extra)
        made[name] = Server(work / f"server-{name}", root, config, env=env)
    return made


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's numbers, its times replaced by the medians over ``runs`` (each
    run kept under "runs")."""
    merged = dict(runs[0])
    for key in ("durable", "restore", "all_memory_in"):
        values = [run[key] for run in runs if run.get(key) is not None]
        merged[key] = statistics.median(values) if values else None
    merged["runs"] = [{k: run[k] for k in ("durable", "restore", "all_memory_in")} for run in runs]
    return merged


def ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def seconds(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "-"


def aes_gcm_throughput(chunk: int = 16 << 10, total: int = 256 * MIB) -> dict[str, float]:
    """MB/s of the store's own sealing (sealing.Sealer: nonce, AES-256-GCM, tag) of random
    chunks, on one thread and on every core: the ceiling of what encryption can cost."""
    from jupyter_ext.core.store.sealing import Sealer

    sealer = Sealer(os.urandom(32))
    data = memoryview(os.urandom(total))
    context = b"jks-chunk\0" + b"0" * 64

    def seal(part: range) -> None:
        for offset in part:
            sealer.seal(data[offset : offset + chunk], context)

    offsets = range(0, total, chunk)
    started = time.perf_counter()
    seal(offsets)
    one = total / (time.perf_counter() - started) / 1e6
    cores = os.cpu_count() or 1
    started = time.perf_counter()
    with ThreadPoolExecutor(cores) as pool:
        list(pool.map(seal, [offsets[i::cores] for i in range(cores)]))
    every = total / (time.perf_counter() - started) / 1e6
    return {"one_thread_mb_s": one, "all_cores_mb_s": every, "cores": cores}


def encryption_table(rows: list[dict[str, Any]], aes: dict[str, float]) -> str:
    lines = [
        f"AES-256-GCM (sealing 16 KiB chunks): {aes['one_thread_mb_s']:.0f} MB/s on one thread,"
        f" {aes['all_cores_mb_s']:.0f} MB/s on {aes['cores']:.0f} cores.",
        "",
        "| kernel | S3 durable encrypted | unencrypted | ratio | S3 restore (download first) "
        "encrypted | unencrypted | ratio | S3 restore lazily encrypted | unencrypted | ratio |",
        "|" + "---|" * 10,
    ]
    for row in rows:
        cells = [human_bytes(row["mib"] * MIB)]
        for name, key in (("s3", "durable"), ("s3", "restore"), ("s3-lazy", "restore")):
            enc = (row.get(name) or {}).get(key)
            plain = (row.get(f"{name}-plain") or {}).get(key)
            cells += [seconds(enc), seconds(plain), ratio(enc, plain)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each run's ratio (encrypted / unencrypted), in the order run:", ""]
    for row in rows:
        for name, key in (("s3", "durable"), ("s3", "restore"), ("s3-lazy", "restore")):
            enc, plain = row.get(name) or {}, row.get(f"{name}-plain") or {}
            pairs = zip(enc.get("runs", []), plain.get("runs", []), strict=False)
            each = [ratio(e[key], p[key]) for e, p in pairs]
            if each:
                label = f"{human_bytes(row['mib'] * MIB)} {name} {key}"
                lines.append(f"- {label}: {', '.join(each)}")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    needed = ("local", "s3", "cache", "local-lazy", "s3-lazy", "ceilings")
    if not all(name in rows[0] for name in needed):
        return ""  # a run of some ways only: the encryption table says it
    lines = [
        "| kernel | images | local durable | bare dump | +fsync | ratio (dump / +fsync) "
        "| S3 durable | raw PUT | ratio | local restore | S3 restore | raw GET | ratio "
        "| S3 all memory in | cache restore | bare restore | ratio | 2nd snapshot new |",
        "|" + "---|" * 18,
    ]
    for row in rows:
        c, local, s3, cache = row["ceilings"], row["local"], row["s3"], row["cache"]
        lines.append(
            f"| {human_bytes(row['mib'] * MIB)} | {human_bytes(c['image_bytes'])} "
            f"| {seconds(local['durable'])} | {seconds(c['dump'])} | {seconds(c['dump_durable'])} "
            f"| {ratio(local['durable'], c['dump'])} "
            f"/ {ratio(local['durable'], c['dump_durable'])} "
            f"| {seconds(s3['durable'])} | {seconds(c['raw_put'])} "
            f"| {ratio(s3['durable'], c['raw_put'])} "
            f"| {seconds(local['restore'])} | {seconds(s3['restore'])} | {seconds(c['raw_get'])} "
            f"| {ratio(s3['restore'], c['raw_get'])} "
            f"| {seconds(s3['all_memory_in'])} "
            f"| {seconds(cache['restore'])} | {seconds(c['restore'])} "
            f"| {ratio(cache['restore'], c['restore'])} "
            f"| {local['second_new_share']:.2%} |"
        )
    lines += [
        "",
        "Restore into a new kernel, first output / all memory in:",
        "",
        "| kernel | local, download first | local, lazy from the store | S3, download first "
        "| S3, lazy from the store | S3 raw GET | S3 ratio (download / lazy) |",
        "|" + "---|" * 7,
    ]
    for row in rows:
        ways = [row[name] for name in ("local", "local-lazy", "s3", "s3-lazy")]
        lines.append(
            f"| {human_bytes(row['mib'] * MIB)} | "
            + " | ".join(f"{seconds(w['restore'])} / {seconds(w['all_memory_in'])}" for w in ways)
            + f" | {seconds(row['ceilings']['raw_get'])} "
            f"| {ratio(row['s3']['restore'], row['ceilings']['raw_get'])} "
            f"/ {ratio(row['s3-lazy']['restore'], row['ceilings']['raw_get'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,4096", help="MiB of kernel memory")
    parser.add_argument("--json", type=Path, help="also write every number here")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per size")
    parser.add_argument("--ways", default="", help="only these ways (comma-separated)")
    parser.add_argument("--plain", action="store_true", help="unencrypted twins of the S3 ways")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each way, interleaved; medians reported"
    )
    parser.add_argument(
        "--no-ceilings", action="store_true", help="skip bare CRIU and raw S3 (ways only)"
    )
    args = parser.parse_args(argv)
    ways = {w for w in args.ways.split(",") if w}
    work = Path(tempfile.mkdtemp(prefix="bench-resume-", dir="/var/tmp"))
    criu = Criu.locate()
    moto = MotoServer(work / "moto.log")
    made: dict[str, Server] = {}
    rows = []
    aes = None
    try:
        s3 = s3_client(moto.url)
        s3.create_bucket(Bucket=BUCKET)
        made = servers(work, moto, ways, args.plain)
        aes = aes_gcm_throughput() if args.plain else None
        for mib in (int(s) for s in args.sizes.split(",")):
            row: dict[str, Any] = {"mib": mib}
            if not args.no_ceilings:
                row["ceilings"] = ceilings(work, criu, s3, mib, args.timeout)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in made}
            for repeat in range(args.repeat):
                # Interleaved, the order flipped each time: a noisy machine, moto's
                # growing memory and a warming page cache weigh on every way alike.
                names = list(made) if repeat % 2 == 0 else list(reversed(made))
                for name in names:
                    runs[name].append(ours(made[name], mib, args.timeout))
            for name, each in runs.items():
                row[name] = medians(each)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for server in made.values():
            with contextlib.suppress(Exception):
                server.stop()
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(markdown(rows))
    if aes is not None:
        print(encryption_table(rows, aes))
    if args.json:
        doc = {"date": time.strftime("%F %T"), "rows": rows, "aes_gcm": aes}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
