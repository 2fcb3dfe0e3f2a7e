"""A CUDA device on a CPU-only torch: the workbench's GPU code run on tensors *labelled* cuda, to find device
mixes and count host syncs without a GPU (tests/test_fake_cuda.py).

`fake_cuda()` runs a block in which
- `device="cuda"` works: every tensor made on or moved to cuda is a `CudaTensor`, a real CPU tensor that says
  it is on cuda:0 (its `device`, its dispatch keys: autocast, kernel choice such as
  `lab.drafter.ttt_attention.kernel_for`, every `if x.device.type == "cuda"` take their CUDA side);
- every aten op is checked as CUDA would check it: an op mixing cuda with CPU tensors (other than what CUDA
  accepts: CPU 0-dim scalars, CPU index tensors, copies between devices) is a *device mix*; an op on cuda
  tensors without a CUDA kernel (torchgen's registry, tests/cuda_branch.py) is a *violation*;
- every op that makes the host wait for the GPU on a real one is a *host sync*, counted with the line of lab/
  code that asked for it: reading a value (`.item()`, `bool`/`int`/`float` of a tensor, `.tolist()`, `.cpu()`),
  an op whose output size depends on the data (`nonzero`, boolean-mask indexing, `unique`, `bincount`,
  `torch.equal`, ...), a blocking copy from the CPU to cuda (CUDA's `memcpy_and_sync`: `torch.tensor(...,
  device=cuda)`, `.to(cuda)`, CPU index tensors), `torch.cuda.synchronize` and waiting for a `torch.cuda.Event`
  (whose marks are the host's clock here). This is the list
  `torch.cuda.set_sync_debug_mode("warn")` would warn about on a GPU;
- SDPA takes its math backend, so the block computes real numbers and runs to the end.

Why labelled real tensors and not `FakeTensorMode` (checked on torch 2.13, CPU build): fake tensors catch a
device mix, but they have no values, so nothing whose control flow reads a value can run (greedy generation
stops at eos, speculative decoding accepts a prefix, the TTT loss sizes its rows with `nonzero`): they raise at
the first such op, which is exactly what this harness must count and step over. Besides, on a CPU build torch's
own `ensureCUDADeviceGuardSet` installs no CUDA device guard (only a CUDA build without a GPU gets one), so
even a fake cuda tensor cannot be indexed (`x[0]`) or moved (`.to("cuda")`). Labelled tensors keep real values,
so one run checks devices, counts syncs and still computes what the CPU computes.

What a CPU build lacks for cuda tensors to exist at all is supplied by a small C++ shim, compiled once from
torch's own headers (seconds, with the C++ compiler any Linux build machine has) and cached under
`~/.cache/lab-fake-cuda/`: a no-op CUDA device guard (c10's `FakeGuardImpl`, which torch itself installs in a
CUDA build without a GPU) and CUDA hooks saying "built, no GPU", which the autograd engine needs to order a
backward over cuda tensors. Torch reads its hooks once, so the shim is loaded before torch is imported: this
module must be the first import of a fresh process (`python tests/fake_cuda.py`, which runs
tests/fake_cuda_checks.py under pytest; tests/test_fake_cuda.py starts it). Being process-wide and
irreversible, the shim never enters the main test session. `fake_cuda()` also patches what a CPU build answers
about CUDA (`is_available`, bfloat16 support, free memory, `synchronize`) for the block's duration.

Limits: streams, events and `non_blocking` copies are not modelled (a non-blocking copy is not counted as a
sync, a copy in flight is never read early); `.numpy()` of a cuda tensor fails, as it does on a GPU. Which ops
sync is this module's list (`SHAPE_SYNC`, `READ_SYNC`, the moves, `.item()`/`.tolist()`), not CUDA's own
word: an op that syncs inside a CUDA kernel's C++ and is missing here goes uncounted. Syncs inside libraries
count too (transformers' mask checks), named with the lab/ line that called them.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SHIM_SOURCE = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
// "CUDA is built, no GPU is there": the autograd engine then takes cuda as the accelerator whose streams
// order a backward (without it, a backward through a cuda tensor fails on a CPU build)
struct LabFakeCUDAHooks final : CUDAHooksInterface {
  LabFakeCUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return false; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
};
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", LabFakeCUDAHooks);
}  // namespace at

extern "C" int lab_fake_cuda() {
  // a no-op device guard for cuda (the one torch installs in a CUDA build without a GPU): indexing,
  // `.to("cuda")` and the autograd engine open one for a cuda tensor
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
    static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;
    c10::impl::registerDeviceGuard(c10::DeviceType::CUDA, &guard);
  }
  return at::detail::getCUDAHooks().isBuilt() ? 1 : 0;
}
"""


def _load_shim() -> str | None:
    """Build (once, cached under ~/.cache/lab-fake-cuda) and load the C++ shim; None when loaded in time,
    else why the harness cannot run here. Runs before torch is imported: torch reads its CUDA hooks once."""
    if "torch" in sys.modules:
        return "tests.fake_cuda must be imported before torch (run `python tests/fake_cuda.py`)"
    spec = importlib.util.find_spec("torch")
    root = Path(spec.submodule_search_locations[0])
    if any((root / "lib").glob("libtorch_cuda*")) or any((root / "lib").glob("libtorch_hip*")):
        # its own CUDA hooks would collide with the shim's: a GPU build has tests/test_gpu.py instead
        return "a CUDA build of torch: the fake device is for CPU builds (tests/test_gpu.py runs on a GPU)"
    version = (root / "version.py").read_text()
    key = hashlib.sha256((version + SHIM_SOURCE).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lab-fake-cuda"
    lib = cache / f"shim-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        src, tmp = lib.with_suffix(f".{os.getpid()}.cpp"), lib.with_suffix(f".{os.getpid()}.tmp")
        src.write_text(SHIM_SOURCE)
        # torch's wheels are built with the C++11 ABI (torch._C._GLIBCXX_USE_CXX11_ABI, unreadable before the import)
        cmd = [os.environ.get("CXX", "c++"), "-O1", "-shared", "-fPIC", "-std=c++20", "-D_GLIBCXX_USE_CXX11_ABI=1",
               f"-I{root / 'include'}", str(src), "-o", str(tmp), f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu",
               f"-Wl,-rpath,{root / 'lib'}"]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            return f"no C++ compiler to build the fake CUDA shim ({exc})"
        finally:
            src.unlink(missing_ok=True)
        if done.returncode != 0:
            return f"cannot build the fake CUDA shim: {done.stderr[-1500:]}"
        tmp.replace(lib)  # atomic: a parallel session sees the whole library or none
    # RTLD_GLOBAL: loads torch's own libraries, which `import torch` then finds in place, with the hooks registered
    if not ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL).lab_fake_cuda():
        return "torch's CUDA hooks were read before the shim registered its own"
    return None


PROBLEM = _load_shim()

import torch  # noqa: E402 - after the shim, which must register its CUDA hooks first
from cuda_branch import _op_name, cuda_kernels  # noqa: E402
from torch.utils._mode_utils import no_dispatch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402

CUDA = torch.device("cuda", 0)
HERE = str(Path(__file__).resolve())
ROOT = Path(__file__).resolve().parent.parent
LAB = str(ROOT / "lab")


class CudaTensor(torch.Tensor):
    """A real CPU tensor (`inner`) that says it is on cuda:0; ops on it run on `inner` under `fake_cuda`."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> CudaTensor:  # noqa: D102
        assert type(inner) is torch.Tensor and inner.device.type == "cpu", (type(inner), inner.device)
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, layout=inner.layout, device=CUDA, requires_grad=inner.requires_grad,
        )  # fmt: skip
        out.inner = inner
        return out

    def __repr__(self) -> str:  # noqa: D105
        return f"CudaTensor({self.inner!r})"

    # storage and pointer are the CPU tensor's: safetensors reads them to find shared tensors before it moves
    # each one to the CPU (`save_native` of a drafter on the device)
    def untyped_storage(self) -> torch.UntypedStorage:  # noqa: D102
        return self.inner.untyped_storage()

    def data_ptr(self) -> int:  # noqa: D102
        return self.inner.data_ptr()

    def tolist(self) -> object:  # noqa: D102 - torch's own refuses tensor subclasses
        if _ACTIVE:
            _ACTIVE[-1].record("read", "tolist")
        return self.inner.tolist()

    __torch_function__ = torch._C._disabled_torch_function_impl

    # a traceable wrapper subclass (what `torch.utils.swap_tensors`, which `Module.to` uses here, expects)
    def __tensor_flatten__(self) -> tuple[list[str], None]:  # noqa: D105
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: None, outer_size: object, outer_stride: object) -> CudaTensor:  # noqa: D105
        return CudaTensor(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206, D105
        raise RuntimeError(f"{func} on a CudaTensor outside fake_cuda(): the harness has ended")


class DeviceMixError(RuntimeError):
    """An op that mixed cuda and CPU tensors and then failed (on a GPU it would have failed at the mix)."""


@dataclass
class Event:
    kind: str  # "mix", "violation", or a sync's kind: "read" (a value to the host), "shape" (data-dependent
    # output size), "upload" (a blocking copy to cuda), "synchronize"
    op: str
    where: str  # "file:line function" of the innermost frame in lab/ (`_where`)


@dataclass
class Report:
    """What a `fake_cuda` block found, in the order it happened (slice `syncs` to count one part of a run)."""

    events: list[Event] = field(default_factory=list)

    @property
    def mixes(self) -> list[Event]:
        return [e for e in self.events if e.kind == "mix"]

    @property
    def violations(self) -> list[Event]:
        return [e for e in self.events if e.kind == "violation"]

    @property
    def syncs(self) -> list[Event]:
        return [e for e in self.events if e.kind not in ("mix", "violation")]

    def sync_table(self) -> str:
        """One line per (kind, op, place) with its count, most frequent first."""
        counts = Counter((e.kind, e.op, e.where) for e in self.syncs)
        return "\n".join(f"{n:5d}  {kind:11s} {op:40s} {where}" for (kind, op, where), n in counts.most_common())


# ops whose output size depends on the values: CUDA computes the size, then copies it to the host to allocate
SHAPE_SYNC = {
    "nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "bincount", "histc", "repeat_interleave.Tensor", "repeat_interleave.self_Tensor",
}  # fmt: skip
# ops that return a value to the host (besides `_local_scalar_dense`, which `.item()`, `int()`, `float()` call)
READ_SYNC = {"is_nonzero", "equal"}
# ops whose index tensors may be on the CPU beside a cuda tensor (CUDA copies them over, blocking)
INDEX_OPS = {"index.Tensor", "index_put_", "index_put", "_index_put_impl_", "_unsafe_index.Tensor", "_index_put_impl"}
# ops that move a tensor between devices (CUDA allows the mix)
MOVES = {"_to_copy", "to", "copy_", "lift_fresh", "lift_fresh_copy"}
# SDPA's backend on a GPU is picked by `_fused_sdp_choice`; its math backend (index 0 of `SDPBackend`) is one of
# those it picks, and the only one that runs on the CPU beneath the labels
SDP_MATH = 0


def _where() -> str:
    """The line that asked for the op: the innermost frame in lab/ (else the innermost outside torch and this
    file: a test's own line), and the innermost outside torch when that is in another library (transformers)."""
    frames = [f for f in traceback.extract_stack() if f.filename != HERE and "/torch/" not in f.filename]
    if not frames:
        return "?"
    ours = next((f for f in reversed(frames) if f.filename.startswith(LAB)), frames[-1])
    text = f"{os.path.relpath(ours.filename, ROOT)}:{ours.lineno} {ours.name}"
    inner = frames[-1]
    if inner is not ours:
        place = inner.filename.split("site-packages/")[-1]
        if Path(place).is_relative_to(ROOT):
            place = os.path.relpath(place, ROOT)
        text += f" (in {place}:{inner.lineno} {inner.name})"
    return text


def _unwrap(x: object) -> object:
    return x.inner if isinstance(x, CudaTensor) else x


def _is_cuda(x: object) -> bool:
    return isinstance(x, CudaTensor)


def _cpu_device(x: object) -> object:
    return torch.device("cpu") if isinstance(x, torch.device) and x.type == "cuda" else x


def _is_cpu_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, CudaTensor) and x.device.type == "cpu"


_ACTIVE: list[_FakeCuda] = []  # the mode of the `fake_cuda` block under way


class _FakeCuda(TorchDispatchMode):
    def __init__(self, report: Report) -> None:
        super().__init__()
        self.report = report
        self.lock = threading.Lock()  # the autograd engine runs cuda backward ops on its own thread

    def record(self, kind: str, op: str) -> Event:
        event = Event(kind, op, _where())
        with self.lock:
            self.report.events.append(event)
        return event

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        named = [x for x in flat if isinstance(x, torch.device)]  # a factory's or a move's own device
        if not any(_is_cuda(x) for x in flat) and not any(d.type == "cuda" for d in named):
            return func(*args, **kwargs)  # nothing on cuda: as it is
        name = _op_name(func)
        base = name.split(".", 1)[0]
        if base == "_fused_sdp_choice":
            return SDP_MATH
        # where the result lives: the device the op names, else `to(other)`'s, else the inputs' (cuda here)
        if named:
            to = named[0]
        elif name == "to.other":
            to = args[1].device
        elif base == "copy_":
            to = args[0].device
        else:
            to = CUDA
        mixed = self.check(func, name, base, args, kwargs, flat, to)
        inner_args, inner_kwargs = tree_map(_unwrap, (args, kwargs))
        inner_args, inner_kwargs = tree_map(_cpu_device, (inner_args, inner_kwargs))
        try:
            out = func(*inner_args, **inner_kwargs)
        except Exception as exc:
            if mixed:  # what a GPU would have raised, rather than what the CPU tensors beneath did
                raise DeviceMixError(f"{name} mixes cuda and CPU tensors at {mixed.where} ({exc})") from exc
            raise
        # outputs that are an input (in-place and out= ops) come back as that input itself
        inputs = {id(_unwrap(x)): x for x in flat if isinstance(x, torch.Tensor)}
        move = base in MOVES

        def wrap(t: object) -> object:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in inputs and not (move and inputs[id(t)].device != to):
                same = inputs[id(t)]
                if isinstance(same, CudaTensor) and (same.shape != t.shape or same.stride() != t.stride()):
                    # an in-place view op (`squeeze_`, `transpose_`): the label takes the new shape too
                    with no_dispatch():
                        same.as_strided_(t.size(), t.stride(), t.storage_offset())
                return same
            if move and id(t) in inputs:
                t = t.clone()  # a move between devices is a copy (the CPU tensor came back as it was)
            return CudaTensor(t) if to.type == "cuda" and t.device.type == "cpu" else t

        return tree_map(wrap, out)

    def check(self, func, name: str, base: str, args, kwargs, flat, to: torch.device) -> Event | None:  # noqa: ANN001
        """Record the missing CUDA kernel, device mix or host sync of one op with a cuda input or output; returns
        the device mix, if any."""
        if func._schema.name.startswith("aten::"):
            has = cuda_kernels().get(name)
            if not has:
                self.record("violation", name if has is False else f"{name} (not in native_functions.yaml)")
        if base in MOVES:
            # a move between devices: allowed, and blocking unless asked not to (CUDA's memcpy_and_sync)
            src = args[1] if base == "copy_" else args[0]
            blocking = not (kwargs.get("non_blocking") or (base == "copy_" and len(args) > 2 and args[2]))
            if src.numel() == 0:
                return None  # nothing to copy: CUDA's copy returns before its memcpy
            if _is_cuda(src) and to.type == "cpu":
                self.record("read", name)
            elif _is_cpu_tensor(src) and to.type == "cuda" and blocking:
                self.record("upload", name)
            return None
        tensors = flat
        if name in INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            index_flat, _ = tree_flatten(indices)
            if any(_is_cpu_tensor(i) for i in index_flat):
                self.record("upload", f"{name} (CPU indices)")
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in index_flat):
                self.record("shape", f"{name} (boolean mask)")
            ids = {id(i) for i in index_flat}
            tensors = [x for x in flat if id(x) not in ids]
        # CUDA kernels take CPU 0-dim tensors as scalars; any other CPU tensor beside a cuda one is an error
        mixed = None
        if any(_is_cuda(x) for x in tensors) and any(_is_cpu_tensor(x) and x.dim() > 0 for x in tensors):
            mixed = self.record("mix", name)
        if base == "_local_scalar_dense" or base in READ_SYNC:
            self.record("read", name)
        elif (name in SHAPE_SYNC or base in SHAPE_SYNC) and kwargs.get("output_size") is None:
            self.record("shape", name)  # (repeat_interleave told its output size does not sync)
        return mixed


@contextlib.contextmanager
def fake_cuda(monkeypatch) -> Iterator[Report]:  # noqa: ANN001
    """Run the block with a labelled CUDA device (module docstring); yields the `Report` it fills."""
    if PROBLEM:
        raise RuntimeError(PROBLEM)
    report = Report()
    mode = _FakeCuda(report)

    def synchronize(device: object = None) -> None:
        mode.record("synchronize", "torch.cuda.synchronize")

    class Event:
        """`torch.cuda.Event` on the fake device: a mark of the host's clock; waiting for it is a host sync."""

        def __init__(self, enable_timing: bool = False, **kwargs: object) -> None:
            self.at = 0.0

        def record(self, stream: object = None) -> None:
            self.at = time.perf_counter()

        def synchronize(self) -> None:
            mode.record("synchronize", "torch.cuda.Event.synchronize")

        def elapsed_time(self, end: Event) -> float:
            return (end.at - self.at) * 1000

    # torch's device initialisation for a cuda factory call (`torch.zeros(..., device="cuda")`); it skips
    # itself under FakeTensorMode, not under this mode
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake CUDA (labelled CPU tensors)")
    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    # `Module.to` swaps each moved tensor into the module's own Parameter object (as `.data =` keeps it on a
    # GPU): a labelled tensor cannot be set into a plain one's `.data`, nor a plain one into a labelled one's
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
    # no CUDA graphs on labelled tensors: the static KV cache's step runs uncompiled (its syncs are counted alike)
    from lab.target import static_decode

    monkeypatch.setattr(static_decode, "compile_step", lambda step, device, dynamic: step)
    lift = torch._C._only_lift_cpu_tensors()
    # torch.tensor(data, device="cuda") makes its tensor on the CPU and moves it through the mode (as
    # FakeTensorMode has it), rather than asking the absent CUDA allocator
    torch._C._set_only_lift_cpu_tensors(True)
    try:
        with mode:
            _ACTIVE.append(mode)
            yield report
    finally:
        if _ACTIVE:
            _ACTIVE.pop()
        torch._C._set_only_lift_cpu_tensors(lift)


if __name__ == "__main__":
    # `python tests/fake_cuda.py [pytest options]`: the checks under pytest, in this fresh process. They import
    # this module by its name: alias it, so that they get this module object (its shim state), not a second copy
    sys.modules["fake_cuda"] = sys.modules[__name__]
    import pytest

    sys.exit(pytest.main(["-p", "no:cacheprovider", str(ROOT / "tests" / "fake_cuda_checks.py"), *sys.argv[1:]]))
