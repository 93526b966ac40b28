"""What a snapshot holds: the cells run since the previous one and the largest variables.

The agent (kernel_wrapper.inkernel.agent) collects this inside the kernel just before a dump, from
its own thread, while the user's code may still run. So it must never run user code: an
object's ``__repr__``, ``__len__``, ``__sizeof__``, ``__class__`` or a property could block,
raise or change state. Only these are read:

* ``type(obj)`` (the C slot, never ``__class__``) and the type's ``__mro__``, ``__module__``
  and ``__qualname__`` through ``type``'s own descriptors (a metaclass cannot intercept);
* for builtins (list, dict, str, ...) whose exact type is known, C-level ``len`` and
  ``sys.getsizeof``; subclasses are read through the base type's slots only;
* for array types of frameworks the kernel has *already imported* (``sys.modules``: none
  is ever imported here), their shape, dtype, bytes and device: NumPy's through
  ``ndarray``'s own C descriptors (also for subclasses), the others only for their exact
  library types (a subclass could override ``shape`` or ``__torch_function__``);
* for anything else ``object.__sizeof__`` (the C base size, never an override).

The work is bounded twice: by a budget of units (one a variable, one a sampled element
or a column) that tests can set small to prove the bound, and by a wall-clock deadline
(50 ms by default; bench/bench_contents.py measures 100 000 variables). A namespace not
finished within either is still reported, marked ``partial`` with the reason.
"""

from __future__ import annotations

import functools
import gc
import heapq
import itertools
import sys
import time
import types
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

#: The largest variables listed per snapshot.
TOP_VARIABLES = 50
#: Units of work one summary may spend (a variable, a sampled element, a column).
BUDGET_UNITS = 400_000
#: Seconds one summary may take; past it the summary is partial.
DEADLINE_SECONDS = 0.05
#: Elements of a list, dict or set whose sizes are sampled to estimate its deep size.
SAMPLE = 16

_MRO: Callable[[type], tuple[type, ...]] = type.__dict__["__mro__"].__get__
_QUALNAME: Callable[[type], str] = type.__dict__["__qualname__"].__get__
_MODULE: Callable[[type], object] = type.__dict__["__module__"].__get__
_OBJECT_SIZEOF = object.__sizeof__

_SCALARS = (int, float, complex, bool, type(None), str, bytes, bytearray)
_SEQUENCES = (list, tuple)
_SETS = (set, frozenset)
_SKIPPED = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    type,
)


def type_name(cls: type) -> str:
    """``module.QualName`` of a type, read through ``type``'s own descriptors."""
    module = _MODULE(cls)
    name = _QUALNAME(cls)
    if type(module) is not str or module == "builtins":
        return str(name)
    return f"{module}.{name}"


def _one_of(cls: type, candidates: tuple[type, ...]) -> bool:
    """``cls in candidates`` by identity: ``in`` or a dict would call a metaclass's
    ``__eq__`` or ``__hash__``."""
    return any(cls is candidate for candidate in candidates)


def _base(cls: type, candidates: tuple[type, ...]) -> type | None:
    """The first of ``candidates`` that ``cls`` is or derives from (identity, no
    ``__subclasscheck__``), else None."""
    for klass in _MRO(cls):
        for candidate in candidates:
            if klass is candidate:
                return candidate
    return None


class Budget:
    """Units of work and a deadline; ``spend`` says False once either is used up."""

    def __init__(self, units: int, seconds: float) -> None:
        self.left = units
        self.spent = 0
        self.deadline = time.perf_counter() + seconds
        self.reason = ""

    def spend(self, units: int = 1) -> bool:
        self.left -= units
        self.spent += units
        if self.left < 0:
            self.reason = "budget"
            return False
        if self.spent & 4095 < units and time.perf_counter() > self.deadline:
            self.reason = "time"
            return False
        return True


class Frameworks:
    """The array and frame types of frameworks already imported, resolved once per summary."""

    def __init__(self) -> None:
        modules = sys.modules
        numpy = modules.get("numpy")
        self.ndarray: type | None = getattr(numpy, "ndarray", None) if numpy else None
        self.np_getters: dict[str, Any] = {}
        if self.ndarray is not None:
            slots = self.ndarray.__dict__
            self.np_getters = {k: slots[k].__get__ for k in ("shape", "dtype", "nbytes")}
        self.exact: dict[type, str] = {}
        torch = modules.get("torch")
        if torch is not None:
            for cls in (getattr(torch, "Tensor", None), _dig(torch, "nn", "Parameter")):
                if isinstance(cls, type):
                    self.exact[cls] = "torch"
        cupy = modules.get("cupy")
        if cupy is not None and isinstance(getattr(cupy, "ndarray", None), type):
            self.exact[cupy.ndarray] = "cupy"
        jax_array = modules.get("jax._src.array")
        if jax_array is not None and isinstance(getattr(jax_array, "ArrayImpl", None), type):
            self.exact[jax_array.ArrayImpl] = "jax"
        pandas = modules.get("pandas")
        if pandas is not None:
            for name in ("DataFrame", "Series"):
                if isinstance(getattr(pandas, name, None), type):
                    self.exact[getattr(pandas, name)] = f"pandas.{name}"
        polars = modules.get("polars")
        if polars is not None:
            for name in ("DataFrame", "Series"):
                if isinstance(getattr(polars, name, None), type):
                    self.exact[getattr(polars, name)] = f"polars.{name}"


def _dig(module: Any, *names: str) -> Any:
    for name in names:
        module = getattr(module, name, None)
    return module


def _own_size(obj: object, fw: Frameworks) -> int:
    """An element's bytes without looking inside it (for sampling containers)."""
    cls = type(obj)
    if _one_of(cls, _SCALARS):
        return sys.getsizeof(obj)
    if fw.ndarray is not None and _base(cls, (fw.ndarray,)) is not None:
        return int(fw.np_getters["nbytes"](obj))
    return int(_OBJECT_SIZEOF(obj))


def _container(obj: Any, base: Any, fw: Frameworks, budget: Budget) -> dict[str, Any]:
    """Length and estimated deep size of a list, tuple, dict, set or frozenset: the
    container's own bytes plus its length times the mean size of up to SAMPLE elements."""
    length = base.__len__(obj)
    own = int(base.__sizeof__(obj))
    picked: list[Any] = []
    if length:
        if base is dict:
            values = dict.values(obj)
            keys = dict.keys(obj)
            picked = [*itertools.islice(keys, SAMPLE // 2), *itertools.islice(values, SAMPLE // 2)]
        elif base in _SETS:
            picked = list(itertools.islice(base.__iter__(obj), SAMPLE))
        else:
            step = max(1, length // SAMPLE)
            picked = [base.__getitem__(obj, i) for i in range(0, length, step)[:SAMPLE]]
    budget.spend(len(picked))
    per_item = 0.0
    if picked:
        sizes = [_own_size(item, fw) for item in picked]
        per_item = sum(sizes) / len(sizes) * (2 if base is dict else 1)
    record: dict[str, Any] = {"length": length, "size": own + int(per_item * length)}
    if length > len(picked):
        record["estimated"] = True
    return record


def _framework(obj: Any, kind: str, budget: Budget) -> dict[str, Any]:
    """Shape, dtype, bytes and device of an exact framework type (library code only)."""
    record: dict[str, Any] = {}
    if kind in ("torch", "cupy", "jax"):
        record["shape"] = [int(n) for n in obj.shape]
        record["dtype"] = str(obj.dtype)
        if kind == "torch":
            record["size"] = int(obj.element_size()) * int(obj.numel())
            device = obj.device
            if device.type != "cpu":
                record["device"] = str(device)
        elif kind == "cupy":
            record["size"] = int(obj.nbytes)
            record["device"] = f"cuda:{int(obj.device.id)}"
        else:
            record["size"] = int(obj.nbytes)
            devices = sorted(str(d) for d in obj.devices())
            if devices and not all(d.startswith("TFRT_CPU") or "cpu" in d for d in devices):
                record["device"] = ",".join(devices)
    elif kind.startswith("pandas."):
        record["shape"] = [int(n) for n in obj.shape]
        budget.spend(record["shape"][1] if len(record["shape"]) > 1 else 1)
        usage = obj.memory_usage(index=True, deep=False)
        record["size"] = int(usage.sum()) if kind == "pandas.DataFrame" else int(usage)
        if kind == "pandas.Series":
            record["dtype"] = str(obj.dtype)
    else:  # polars
        record["shape"] = [int(n) for n in obj.shape]
        budget.spend(record["shape"][1] if len(record["shape"]) > 1 else 1)
        record["size"] = int(obj.estimated_size())
        if kind == "polars.Series":
            record["dtype"] = str(obj.dtype)
    return record


def describe(obj: Any, fw: Frameworks, budget: Budget) -> dict[str, Any] | None:
    """One variable's record ({"type", "size", ...}), or None for what is not data
    (modules, functions, classes). Never runs the object's own code (module docstring)."""
    cls = type(obj)
    if _base(cls, _SKIPPED) is not None:
        return None
    record: dict[str, Any] = {"type": type_name(cls)}
    try:
        kind = next((k for known, k in fw.exact.items() if known is cls), None)
        if kind is not None:
            record.update(_framework(obj, kind, budget))
            return record
        if fw.ndarray is not None and _base(cls, (fw.ndarray,)) is not None:
            getters = fw.np_getters
            record["shape"] = [int(n) for n in getters["shape"](obj)]
            record["dtype"] = str(getters["dtype"](obj))
            record["size"] = int(getters["nbytes"](obj))
            return record
        base = _base(cls, (dict, list, tuple, set, frozenset))
        if base is not None:
            record.update(_container(obj, base, fw, budget))
            return record
        scalar: Any = _base(cls, (str, bytes, bytearray))
        if scalar is not None:
            record["length"] = scalar.__len__(obj)
            record["size"] = int(scalar.__sizeof__(obj))
            return record
        if _one_of(cls, _SCALARS):
            record["size"] = sys.getsizeof(obj)
            return record
        record["size"] = int(_OBJECT_SIZEOF(obj))
    except Exception as exc:  # noqa: BLE001  (a library failing on its own object: say so)
        record.setdefault("size", 0)
        record["error"] = f"{type(exc).__name__}"
    return record


def _skip(_obj: object) -> int:
    return -1


def _shallow_sizer(cls: type, fw: Frameworks, budget: Budget) -> Callable[[Any], int]:
    """How to size an object of type ``cls`` cheaply (the first pass): its own bytes, an
    array's data; ``_skip`` for what is not data. Decided once per type and summary."""
    if _base(cls, _SKIPPED) is not None:
        return _skip
    kind = next((k for known, k in fw.exact.items() if known is cls), None)
    if kind is not None:
        return lambda obj: int(_framework(obj, kind, budget).get("size", 0))
    if fw.ndarray is not None and _base(cls, (fw.ndarray,)) is not None:
        nbytes = fw.np_getters["nbytes"]
        return lambda obj: int(nbytes(obj))
    if _one_of(cls, _SCALARS):
        return sys.getsizeof
    base: Any = _base(cls, (dict, list, tuple, set, frozenset, str, bytes, bytearray))
    if base is not None:
        return base.__sizeof__  # type: ignore[no-any-return]
    return _OBJECT_SIZEOF


def _collector_paused(summarize: Callable[P, R]) -> Callable[P, R]:
    """Run ``summarize`` with the cycle collector paused: a collection that our own
    allocations trigger would run user ``__del__`` methods in this thread, and a full one
    over a large heap takes longer than the whole summary."""

    @functools.wraps(summarize)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return summarize(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()

    return paused


@_collector_paused
def summarize_namespace(
    namespace: dict[str, Any],
    hidden: set[str] | frozenset[str] = frozenset(),
    *,
    top: int = TOP_VARIABLES,
    units: int = BUDGET_UNITS,
    seconds: float = DEADLINE_SECONDS,
) -> dict[str, Any]:
    """The ``top`` largest variables of ``namespace`` (names not starting with "_" and not
    in ``hidden``) and their total; ``partial`` with a reason when the budget ran out.

    Two passes, so that 100 000 variables fit in the deadline: every variable is sized
    cheaply (its own bytes, an array's data: a few C calls, the way decided once per type),
    then only the largest few (4 x ``top``) are described in full (shape, dtype, device,
    containers' deep size estimated from a sample), which may reorder them."""
    started = time.perf_counter()
    budget = Budget(units, seconds)
    fw = Frameworks()
    items = list(dict.items(namespace))  # one C-level copy: the kernel may be changing it
    sizers: dict[int, Callable[[Any], int]] = {}  # by id(type): no metaclass __hash__ runs
    keep = top * 4
    heap: list[tuple[int, int, str, Any]] = []
    total = 0
    count = 0
    examined = 0
    partial = False
    # The hot loop: ~0.5 us a variable. Budget.spend's checks, inlined.
    limit = min(units, len(items))
    deadline = budget.deadline
    clock = time.perf_counter
    smallest = -1
    for name, value in items:
        if type(name) is not str or name[:1] == "_" or name in hidden:
            continue
        if examined >= limit or (examined & 4095 == 4095 and clock() > deadline):
            partial = True
            budget.reason = "budget" if examined >= limit else "time"
            break
        examined += 1
        cls = type(value)
        sizer = sizers.get(id(cls))
        if sizer is None:
            sizer = sizers[id(cls)] = _shallow_sizer(cls, fw, budget)
        try:
            size = sizer(value)
        except Exception:  # noqa: BLE001  (a library failing on its own object)
            size = 0
        if size < 0:
            continue
        count += 1
        total += size
        if size > smallest:
            if len(heap) < keep:
                heapq.heappush(heap, (size, examined, name, value))
                if len(heap) == keep:
                    smallest = heap[0][0]
            else:
                heapq.heapreplace(heap, (size, examined, name, value))
                smallest = heap[0][0]
    budget.left -= examined
    budget.spent += examined
    described: list[tuple[int, str, dict[str, Any]]] = []
    for size, _, name, value in heap:
        record = describe(value, fw, budget)
        if record is None:
            continue
        full = int(record.get("size", 0))
        total += full - size
        described.append((full, name, record))
    described.sort(key=lambda entry: (entry[0], entry[1]), reverse=True)
    largest = [{"name": name, **record} for _, name, record in described[:top]]
    summary: dict[str, Any] = {
        "variables": largest,
        "variable_count": count,
        "variables_bytes": total,
        "examined": examined,
        "budget_spent": budget.spent,
        "partial": partial,
        "seconds": round(time.perf_counter() - started, 6),
    }
    if partial:
        summary["partial_reason"] = (
            f"the namespace was not summarised within {seconds * 1000:.0f} ms"
            if budget.reason == "time"
            else f"the namespace is larger than the summary's budget of {units} units"
        )
    return summary
