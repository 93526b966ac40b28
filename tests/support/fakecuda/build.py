"""Build the stand-in libcuda and the test GPU program with gcc, and drive the program.

``build_fakecuda(dir)`` compiles ``fakecuda.c`` into ``dir/libcuda.so.1``;
``build_gpuprog(dir)`` compiles ``gpuprog.c``; ``write_fake_tool(dir, libcuda)`` writes a
``cuda-checkpoint`` that speaks NVIDIA's command line over the stand-in;
:class:`GpuProgram` runs the GPU program and talks to it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]


class BuildError(RuntimeError):
    pass


def _gcc(args: list[str]) -> None:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise BuildError("gcc is needed to build the stand-in libcuda (apt-get install gcc)")
    done = subprocess.run([gcc, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BuildError(f"gcc {' '.join(args)} failed:\n{done.stdout}{done.stderr}")


def build_fakecuda(outdir: Path) -> Path:
    """Compile the stand-in into ``outdir/libcuda.so.1`` and return its path."""
    outdir.mkdir(parents=True, exist_ok=True)
    lib = outdir / "libcuda.so.1"
    _gcc(
        ["-shared", "-fPIC", "-O2", "-Wall", "-o", str(lib), str(HERE / "fakecuda.c"), "-lpthread"]
    )
    return lib


def build_gpuprog(outdir: Path) -> Path:
    """Compile the test GPU program (it dlopens whichever libcuda it is given)."""
    outdir.mkdir(parents=True, exist_ok=True)
    prog = outdir / "gpuprog"
    _gcc(["-O2", "-Wall", "-o", str(prog), str(HERE / "gpuprog.c"), "-ldl"])
    return prog


def write_fake_tool(outdir: Path, libcuda: Path, *, toggle_only: bool = False) -> Path:
    """A ``cuda-checkpoint`` executable that drives ``libcuda`` (see cuda_checkpoint.py)."""
    outdir.mkdir(parents=True, exist_ok=True)
    tool = outdir / "cuda-checkpoint"
    env = f"FAKECUDA_LIBCUDA={libcuda} "
    if toggle_only:
        env += "FAKECUDA_TOOL_TOGGLE_ONLY=1 "
    tool.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH={REPO_ROOT} {env}exec {sys.executable} {HERE / "cuda_checkpoint.py"} "$@"\n'
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return tool


class GpuProgram:
    """The test GPU program as a child process: ``send("check")`` -> ``"ok 0"``."""

    def __init__(
        self,
        prog: Path,
        libcuda: str | Path,
        *,
        mebibytes: int = 4,
        env: dict[str, str] | None = None,
        ready_timeout: float = 60.0,
    ) -> None:
        self.process = subprocess.Popen(
            [str(prog), str(libcuda), str(mebibytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.pid = self.process.pid
        line = self._readline(ready_timeout)
        if not line.startswith("ready "):
            self.kill()
            raise RuntimeError(f"the GPU program did not start: {line!r}")

    def _readline(self, timeout: float) -> str:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        fd = self.process.stdout.fileno()
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the GPU program within {timeout} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1)
                if not chunk:
                    return buf.decode().strip() or "<exited>"
                buf += chunk
        return buf.decode().strip()

    def send(self, command: str, timeout: float = 30.0) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command.encode() + b"\n")
        self.process.stdin.flush()
        return self._readline(timeout)

    def stop(self) -> None:
        """SIGSTOP, and wait until every thread is stopped (delivery is asynchronous)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = []
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                text = (task / "stat").read_text()
                states.append(text.rsplit(")", 1)[1].split()[0])
            if all(state in ("T", "t") for state in states):
                return
            time.sleep(0.005)
        raise TimeoutError(f"process {self.pid} did not stop")

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
