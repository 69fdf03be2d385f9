"""Fused multi-pool paged decode attention for the CPU: ``cpu_attention.c`` (the kernel) behind
``cpu_attention_op.cpp`` (the PyTorch operator ``torch.ops.structkv.paged_decode_attention_pools``).

Both are compiled on first use with the system compilers (``cc -O3 -march=native -fopenmp`` for
the kernel, ``c++`` against PyTorch's headers for the operator; about 10 s on two cores) into a
per-user cache (``$STRUCTKV_CACHE_DIR``, default ``~/.cache/structkv``), keyed by the sources, the
flags, the processor and the PyTorch version; later processes load the cached library. It is
loaded after PyTorch, so its OpenMP threads are PyTorch's own ``libgomp.so.1`` pool, as many as
``torch.get_num_threads()``. An operator, not a ctypes call: eager Python calls it as one builtin,
and the compiled decode graph (inductor's C++ wrapper) calls it through the dispatcher with no
Python at all. Where no compiler works, :func:`available` is False and the engine keeps the torch
reference (:func:`kernels.decode_attention.paged_decode_attention_pools_ref`, same contract);
``STRUCTKV_CPU_KERNEL=0`` forces the reference.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_KERNEL = Path(__file__).with_name("cpu_attention.c")
_OPERATOR = Path(__file__).with_name("cpu_attention_op.cpp")
_C_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC"]
_CXX_FLAGS = ["-O2", "-std=c++20", "-fPIC", "-w"]
_BITS_DTYPE = {0: torch.float32, 8: torch.int8, 4: torch.uint8}
# A row's entries are cut into ranges of at least this many (flash-decoding's split) when the batch
# has fewer rows than twice the threads.
MIN_SPLIT_ENTRIES = 256

_op = None
_tried = False


def _cpu_key() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{proc.stderr[-2000:]}")


def _build() -> Path:
    """Compile the kernel and the operator into one cached library (atomically: built in a
    temporary folder, renamed into place).

    Raises:
        RuntimeError: no C / C++ compiler, or a compiler failed (its output in the message).
    """
    from torch.utils import cpp_extension
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cc is None or cxx is None:
        raise RuntimeError("no C and C++ compiler (cc / c++) on PATH")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu", "-ltorch"]
    key = hashlib.sha256(b"".join([_KERNEL.read_bytes(), _OPERATOR.read_bytes(),
                                   " ".join([cc, cxx, abi, *_C_FLAGS, *_CXX_FLAGS, torch.__version__]).encode(),
                                   _cpu_key().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("STRUCTKV_CACHE_DIR", Path.home() / ".cache" / "structkv"))
    lib = cache / f"cpu_attention_{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        kernel, op, out = Path(tmp, "kernel.o"), Path(tmp, "op.o"), Path(tmp, "lib.so")
        _run([cc, *_C_FLAGS, "-c", str(_KERNEL), "-o", str(kernel)])
        _run([cxx, *_CXX_FLAGS, abi, *includes, "-c", str(_OPERATOR), "-o", str(op)])
        _run([cxx, "-shared", "-fopenmp", str(kernel), str(op), "-o", str(out), *libs, "-lm"])
        os.replace(out, lib)
    return lib


def _load():
    global _op, _tried
    if _tried:
        return _op
    _tried = True
    if os.environ.get("STRUCTKV_CPU_KERNEL", "1") == "0":
        return None
    try:
        if not hasattr(torch.ops.structkv, "paged_decode_attention_pools"):
            torch.ops.load_library(str(_build()))
            torch.library.register_fake("structkv::paged_decode_attention_pools")(_fake)
    except (OSError, RuntimeError) as e:
        log.warning("fused CPU decode attention unavailable (%s); using the torch reference", e)
        return None
    _op = torch.ops.structkv.paged_decode_attention_pools
    return _op


def _fake(q, k, v, k_scale, v_scale, block_tables, lens, bits, extra_k, extra_v, extra_mask, sm_scale,
          min_split=MIN_SPLIT_ENTRIES):
    return q.new_empty(q.shape, dtype=torch.float32)


def available() -> bool:
    """Whether the fused kernel is built and loaded (compiling it on the first call)."""
    return _load() is not None


def supports(q: torch.Tensor, pools) -> bool:
    """Whether the fused kernel takes these inputs: CPU tensors, float32 queries and HIGH pools."""
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and all(p[0].device.type == "cpu" and p[0].dtype == _BITS_DTYPE.get(p[6]) for p in pools))


def paged_decode_attention_pools_cpu(q: torch.Tensor, pools, extra_kv=None,
                                     sm_scale: float | None = None) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, D]`` float32 over several paged pools, fused (one operator call).

    Same contract as :func:`kernels.decode_attention.paged_decode_attention_pools_ref`: ``pools``
    are tuples ``(k, v, k_scale, v_scale, block_table [B, W] int32, lens [B] int32, bits)`` with
    ``k, v [pages, block_size, Hkv, Dk]`` (float32 at bits 0, int8 at 8, packed uint8 at 4) and
    scales ``[pages, block_size, Hkv]`` float32; ``extra_kv = (k [B, Hkv, D], v, mask [B] bool)``
    adds one full-precision entry per masked row. Each entry is read once in its stored precision.
    Returns ``[B, Hq, D]`` float32 (zeros for a row with no entry).

    Raises:
        RuntimeError: the kernel is not available (see :func:`available`), inputs it does not take
            (the message names the pool and the tensor), or it failed.
    """
    op = _load()
    if op is None:
        raise RuntimeError("the fused CPU decode attention is not available")
    ks, vs, kss, vss, tables, lens, bits = zip(*pools) if pools else ((),) * 7
    ek, ev, em = extra_kv if extra_kv is not None else (None, None, None)
    return op(q.contiguous(), ks, vs, kss, vss, tables, lens, bits,
              None if ek is None else ek.float().contiguous(), None if ev is None else ev.float().contiguous(),
              None if em is None else em.contiguous(), sm_scale if sm_scale is not None else q.shape[-1] ** -0.5,
              MIN_SPLIT_ENTRIES)
