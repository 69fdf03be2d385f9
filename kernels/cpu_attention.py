"""Fused multi-pool paged decode attention for the CPU (``cpu_attention.c``), loaded with ctypes.

The C source is compiled on first use with the system C compiler (``cc -O3 -march=native
-fopenmp``) into a per-user cache (``$STRUCTKV_CACHE_DIR``, default ``~/.cache/structkv``), keyed
by the source, the flags and the processor; later processes load the cached library. It is loaded
after PyTorch, so its OpenMP calls run on PyTorch's own ``libgomp.so.1`` thread pool.
Where no compiler works, :func:`available` is False and the engine keeps the torch reference
(:func:`kernels.decode_attention.paged_decode_attention_pools_ref`, same contract);
``STRUCTKV_CPU_KERNEL=0`` forces the reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]
_BITS_DTYPE = {0: torch.float32, 8: torch.int8, 4: torch.uint8}
# A row's entries are cut into ranges of at least this many (flash-decoding's split) when the batch
# has fewer rows than threads can take.
MIN_SPLIT_ENTRIES = 256

_lib = None
_tried = False


class _PoolArg(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("k_scale", ctypes.c_void_p),
                ("v_scale", ctypes.c_void_p), ("table", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                ("width", ctypes.c_int64), ("bits", ctypes.c_int32), ("block_size", ctypes.c_int32)]


def _cpu_key() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> Path:
    """Compile the library into the cache (atomically: a temporary file renamed into place).

    Raises:
        RuntimeError: no C compiler, or the compiler failed (its output in the message).
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([cc] + _FLAGS).encode() + _cpu_key().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("STRUCTKV_CACHE_DIR", Path.home() / ".cache" / "structkv"))
    lib = cache / f"cpu_attention_{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    proc = subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True)
    if proc.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"{cc} failed on {_SOURCE}:\n{proc.stderr[-2000:]}")
    os.replace(tmp, lib)
    return lib


def _load():
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("STRUCTKV_CPU_KERNEL", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as e:
        log.warning("fused CPU decode attention unavailable (%s); using the torch reference", e)
        return None
    fn = lib.structkv_paged_decode_attention_pools
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                   ctypes.POINTER(_PoolArg), ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_float, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]
    _lib = fn
    return _lib


def available() -> bool:
    """Whether the fused kernel is built and loaded (compiling it on the first call)."""
    return _load() is not None


def supports(q: torch.Tensor, pools) -> bool:
    """Whether the fused kernel takes these inputs: CPU tensors, float32 queries and HIGH pools."""
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and all(p[0].device.type == "cpu" and p[0].dtype == _BITS_DTYPE.get(p[6]) for p in pools))


def paged_decode_attention_pools_cpu(q: torch.Tensor, pools, extra_kv=None,
                                     sm_scale: float | None = None) -> torch.Tensor:
    """Decode attention of ``q [B, Hq, D]`` float32 over several paged pools, fused (one C call).

    Same contract as :func:`kernels.decode_attention.paged_decode_attention_pools_ref`: ``pools``
    are tuples ``(k, v, k_scale, v_scale, block_table [B, W] int32, lens [B] int32, bits)`` with
    ``k, v [pages, block_size, Hkv, Dk]`` (float32 at bits 0, int8 at 8, packed uint8 at 4) and
    scales ``[pages, block_size, Hkv]`` float32; ``extra_kv = (k [B, Hkv, D], v, mask [B] bool)``
    adds one full-precision entry per masked row. Each entry is read once in its stored precision.
    Returns ``[B, Hq, D]`` float32 (zeros for a row with no entry).

    Raises:
        RuntimeError: the kernel is not available (see :func:`available`), or it failed.
        ValueError: inputs it does not take (see :func:`supports`), or mismatched shapes.
    """
    fn = _load()
    if fn is None:
        raise RuntimeError("the fused CPU decode attention is not available")
    if not supports(q, pools):
        raise ValueError("the fused CPU kernel takes CPU tensors with float32 queries and HIGH pools")
    b, hq, d = q.shape
    q = q.contiguous()
    keep = [q]                                 # keep every tensor whose pointer C reads alive
    args = (_PoolArg * max(1, len(pools)))()
    for i, (k, v, ks, vs, table, lens, bits) in enumerate(pools):
        hkv = k.shape[2]
        if k.shape != v.shape or k.shape[3] != (d // 2 if bits == 4 else d) or table.shape[0] != b or lens.shape != (b,):
            raise ValueError(f"pool {i}: k, v {tuple(k.shape)} / {tuple(v.shape)}, table {tuple(table.shape)}, "
                             f"lens {tuple(lens.shape)} do not match q {tuple(q.shape)} at bits={bits}")
        table = table.to(torch.int32).contiguous()
        lens = lens.to(torch.int32).contiguous()
        t = [k.contiguous(), v.contiguous(), table, lens]
        if bits:
            t += [ks.contiguous(), vs.contiguous()]
        keep += t
        args[i] = _PoolArg(t[0].data_ptr(), t[1].data_ptr(), t[4].data_ptr() if bits else None,
                           t[5].data_ptr() if bits else None, table.data_ptr(), lens.data_ptr(),
                           table.shape[1], bits, k.shape[1])
    ek = ev = em = None
    if extra_kv is not None:
        ek, ev, em = (extra_kv[0].float().contiguous(), extra_kv[1].float().contiguous(),
                      extra_kv[2].to(torch.uint8).contiguous())
        hkv = ek.shape[1]
        keep += [ek, ev, em]
    elif pools:
        hkv = pools[0][0].shape[2]
    else:
        return torch.zeros(b, hq, d, dtype=torch.float32)
    out = torch.empty(b, hq, d, dtype=torch.float32)
    threads = torch.get_num_threads()
    splits = max(1, -(-2 * threads // max(1, b)))
    rc = fn(q.data_ptr(), b, hq, hkv, d, args, len(pools), ek.data_ptr() if ek is not None else None,
            ev.data_ptr() if ev is not None else None, em.data_ptr() if em is not None else None,
            sm_scale if sm_scale is not None else 1.0 / math.sqrt(d), splits, MIN_SPLIT_ENTRIES, threads,
            out.data_ptr())
    if rc:
        raise RuntimeError(f"fused CPU decode attention failed (code {rc}: 1 bad shape, 2 out of memory)")
    return out


def _pool_tuples(ks, vs, k_scales, v_scales, tables, lens, bits):
    return [(k, v, ksc if b else None, vsc if b else None, t, n, b)
            for k, v, ksc, vsc, t, n, b in zip(ks, vs, k_scales, v_scales, tables, lens, bits)]


@torch.library.custom_op("structkv::paged_decode_attention_pools", mutates_args=())
def paged_decode_attention_pools_op(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
                                    k_scales: list[torch.Tensor], v_scales: list[torch.Tensor],
                                    tables: list[torch.Tensor], lens: list[torch.Tensor], bits: list[int],
                                    extra_k: torch.Tensor, extra_v: torch.Tensor, extra_mask: torch.Tensor,
                                    sm_scale: float) -> torch.Tensor:
    """:func:`paged_decode_attention_pools_cpu` as a PyTorch operator, which a compiled graph
    (``torch.compile``, the engine's CPU decode graph) calls as one opaque node. A HIGH pool's
    scales may be any tensor (unread); ``extra_mask`` all False adds no entry."""
    return paged_decode_attention_pools_cpu(q, _pool_tuples(ks, vs, k_scales, v_scales, tables, lens, bits),
                                            (extra_k, extra_v, extra_mask), sm_scale)


@paged_decode_attention_pools_op.register_fake
def _(q, ks, vs, k_scales, v_scales, tables, lens, bits, extra_k, extra_v, extra_mask, sm_scale):
    return q.new_empty(q.shape, dtype=torch.float32)
