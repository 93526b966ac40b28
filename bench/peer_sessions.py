"""Notebook sessions for bench_peers.py, built from generated data (no downloads).

Each session is a list of notebook cells that fill about ``mib`` MiB of kernel memory
with state a user would want back, a ``mutate`` cell that changes 5 % of that memory,
and a ``check`` cell that prints a fingerprint of the state without changing it: the
state restored by a peer is correct when its fingerprint equals the original's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Session:
    name: str
    cells: list[str]
    mutate: str
    check: str


def analysis(mib: int, workdir: str) -> Session:
    """A pandas / scikit-learn analysis: a table of measurements, derived features, a
    group-by summary and a fitted model."""
    # 8 float64 columns and one int64 column: 72 bytes a row.
    rows = max(1000, mib * 1024 * 1024 // 72)
    return Session(
        "analysis",
        [
            "import numpy as np, pandas as pd\n"
            "from sklearn.cluster import MiniBatchKMeans\n"
            "from sklearn.linear_model import Ridge\n"
            "rng = np.random.default_rng(13)",
            f"n = {rows}\n"
            "df = pd.DataFrame(rng.standard_normal((n, 8)), columns=list('abcdefgh'))\n"
            "df['store'] = rng.integers(0, 500, n)",
            "df['h'] = df['a'] * 0.5 + df['b'] ** 2 - df['c'].abs()\n"
            "summary = df.groupby('store').agg(['mean', 'std'])",
            "sample = df.sample(min(n, 200_000), random_state=1)\n"
            "model = Ridge().fit(sample[list('abcdefg')], sample['h'])\n"
            "clusters = MiniBatchKMeans(8, random_state=1, n_init=1).fit(sample[list('abcd')])",
        ],
        "df.iloc[: n // 20, :8] += 1.0",
        "print(df.shape, round(float(df['a'].sum()), 3), round(float(summary.iloc[0, 0]), 6),"
        " np.round(model.coef_, 6).tolist()[:2], clusters.cluster_centers_.shape)",
    )


def simulation(mib: int, workdir: str) -> Session:
    """A numpy simulation: explicit heat diffusion on a 2-D grid, a few hundred steps
    of particles in that field, and the history of the mean temperature."""
    side = max(64, int((mib * 1024 * 1024 / 8 / 2) ** 0.5))
    return Session(
        "simulation",
        [
            "import numpy as np\nrng = np.random.default_rng(7)",
            f"side = {side}\n"
            "grid = rng.random((side, side))\n"
            "nxt = np.empty_like(grid)\n"
            "history = []",
            "for step in range(10):\n"
            "    nxt[1:-1, 1:-1] = grid[1:-1, 1:-1] + 0.2 * (grid[:-2, 1:-1] + grid[2:, 1:-1]"
            " + grid[1:-1, :-2] + grid[1:-1, 2:] - 4 * grid[1:-1, 1:-1])\n"
            "    grid, nxt = nxt, grid\n"
            "    history.append(float(grid.mean()))",
            "particles = rng.random((100_000, 2)) * (side - 1)\n"
            "for step in range(50):\n"
            "    ij = particles.astype(np.int64)\n"
            "    particles += 0.1 * (grid[ij[:, 0], ij[:, 1]][:, None] - 0.5)\n"
            "    np.clip(particles, 0, side - 1, out=particles)",
        ],
        "grid[: side // 20] += 1.0",
        "print(grid.shape, round(float(grid.sum()), 3), round(float(particles.sum()), 3),"
        " len(history), round(history[-1], 9))",
    )


def unpicklable(mib: int, workdir: str) -> Session:
    """What pickling cannot save: a running thread, an open file with its position, a
    generator half way, an sqlite connection with its tables, a lock, C-extension handles
    (an incremental sha256, a zlib stream, an anonymous mmap), next to a numpy array."""
    return Session(
        "unpicklable",
        [
            "import numpy as np, threading, time, sqlite3, hashlib, zlib, mmap, inspect",
            f"data = np.random.default_rng(3).random({mib} * 1024 * 1024 // 8)",
            "ticks = [0]\nlock = threading.Lock()\n"
            "def _tick():\n"
            "    while True:\n"
            "        with lock:\n"
            "            ticks[0] += 1\n"
            "        time.sleep(0.01)\n"
            "ticker = threading.Thread(target=_tick, daemon=True)\nticker.start()",
            f"log = open({workdir!r} + '/unpicklable.log', 'w+')\n"
            "log.write('measurement\\n' * 1000)\nlog.flush()\n"
            "def counter():\n"
            "    i = 0\n"
            "    while True:\n"
            "        yield i\n"
            "        i += 1\n"
            "gen = counter()\n"
            "for _ in range(1234):\n"
            "    next(gen)",
            "db = sqlite3.connect(':memory:', check_same_thread=False)\n"
            "db.execute('create table t (k integer primary key, v real)')\n"
            "db.executemany('insert into t values (?, ?)', ((i, i * 0.5) for i in range(50_000)))\n"
            "sha = hashlib.sha256(data[:1000].tobytes())\n"
            "zs = zlib.compressobj()\nzhead = zs.compress(b'x' * 100_000)\n"
            "buf = mmap.mmap(-1, 1 << 20)\nbuf[:11] = b'hello world'",
        ],
        "data[: len(data) // 20] += 1.0",
        "print(round(float(data.sum()), 3), ticker.is_alive(), log.closed, log.tell(),"
        " inspect.getgeneratorlocals(gen)['i'], db.execute('select count(*), sum(v) from t')"
        ".fetchone(), sha.copy().hexdigest()[:16], len(zs.copy().flush()), buf[:11])",
    )


SESSIONS = {"analysis": analysis, "simulation": simulation, "unpicklable": unpicklable}
