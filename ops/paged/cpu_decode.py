"""The C decode kernel of `cpu_decode.c`: built at first use, called through ctypes (issue 26).

Why C and not torch: decode at the real GQA shape (8 query rows per KV head, head_dim 128)
does 4 FLOP per KV byte, and torch's CPU kernels run it far below this CPU's FMA rate
(MKL's skinny fp32 GEMMs and the flash kernel: ~1/3 of the read-once bandwidth), while a
shuffled block table cost the torch kernel a gather of every page on top. The C kernel
walks the block table per position (in place, whatever the table) and keeps the scores
of a 32-key block in L1. Why ctypes and not `torch.utils.cpp_extension`: the source
includes no torch header, so it builds in ~1-2 s with the system C compiler (a
cpp_extension build with torch's headers takes most of a minute on the CI machine).

No -march: the AVX2 + FMA code is chosen at run time; a CPU without them, a dtype other
than fp32 (or int8 / float8_e4m3fn pages with their scales, dequantised per block), a head dim not a multiple of 8, more than 64 query rows per KV head, a
missing compiler or `CP_COMPILE_CPU_DECODE=torch` leave the pure-torch kernel in
charge (`attend` returns None). The built library is cached by source hash under
`$CP_COMPILE_CACHE_DIR` (default `~/.cache/cp_compile`, else the temp dir).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_decode.c")
MAX_ROWS = 64  # MAXR in cpu_decode.c

_lib: ctypes.CDLL | None = None
_tried = False


def enabled() -> bool:
    return os.environ.get("CP_COMPILE_CPU_DECODE", "c") != "torch"


def _cache_dir() -> Path:
    root = os.environ.get("CP_COMPILE_CACHE_DIR")
    for d in ([Path(root)] if root else []) + [Path.home() / ".cache" / "cp_compile",
                                                 Path(tempfile.gettempdir()) / "cp_compile"]:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError("no writable cache directory for the C decode kernel (set CP_COMPILE_CACHE_DIR)")


def _build() -> Path:
    """Compile once per source version (several rank processes may race: each writes its
    own temporary file and renames it into place)."""
    src = SOURCE.read_bytes()
    path = _cache_dir() / f"cpu_decode-{hashlib.sha256(src).hexdigest()[:16]}.so"
    if path.exists():
        return path
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cc = os.environ.get("CC", "cc")
    base = [cc, "-O2", "-fPIC", "-shared", str(SOURCE), "-o", str(tmp), "-lm"]
    # OpenMP over the batch's (request, KV head) items when the compiler has it; the
    # library links libgomp.so.1, the runtime torch has already loaded.
    for cmd in (base[:2] + ["-fopenmp"] + base[2:], base):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            os.replace(tmp, path)
            return path
    raise OSError(f"building {SOURCE.name} failed ({' '.join(base)}): {r.stderr.strip()[-400:]}")


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (with one warning) when it cannot be built here."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        lib = ctypes.CDLL(str(_build()))
    except OSError as e:
        warnings.warn(f"CPU decode attention falls back to the pure-torch kernel: {e}", RuntimeWarning)
        return None
    I, P = ctypes.c_int64, ctypes.c_void_p
    lib.cp_decode_attention.argtypes = [I, P, P, I, I, I, I, I, ctypes.c_float, P, P, I, I, I, I, I, I, I, P, I,
                                        P, P, I, P, P, I, I, I, I, I, I]
    lib.cp_decode_attention.restype = ctypes.c_int
    lib.cp_fma_chains.argtypes = [I]
    lib.cp_fma_chains.restype = ctypes.c_float
    _lib = lib
    return lib


def fma_floor(flops: int) -> bool:
    """Run `flops` fp32 FLOP of independent FMAs (no memory traffic): the compute floor of a kernel
    doing that many, at this core's FMA rate under the current load. False where it cannot run."""
    lib = library()
    return lib is not None and lib.cp_fma_chains(max(1, flops // 160)) != -1.0


# Quantised page dtypes the kernel dequantises (issue 39): qtype 1 int8, 2 float8_e4m3fn.
QTYPES = {torch.int8: 1, torch.float8_e4m3fn: 2}


def attend(qt: Tensor, kvl: Tensor, k_cache: Tensor, v_cache: Tensor, tbl: Tensor, scale: float,
           k_scales: Tensor | None = None, v_scales: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """qt [Bg, Hkv, Tq * g, D] fp32 (row t * g + j: token t, head j of the group), kvl [Bg, Tq]
    key count per token, caches [NB, BS, Hkv, D|Dv] fp32, tbl [Bg, width] int64 page ids
    (every entry a row reads in range) -> out [Bg, Hkv, Tq * g, Dv], lse [Bg, Hkv, Tq * g] fp32;
    None when the C kernel does not apply (the caller runs the torch kernel). Quantised caches
    (int8 / float8_e4m3fn) come with their scales `k_scales` / `v_scales` [NB, BS, Hkv] fp32."""
    Bg, Hkv, R, D = qt.shape
    Dv = v_cache.shape[3]
    Rp = (R + 3) // 4 * 4
    quant = k_scales is not None
    cache_ok = (k_cache.dtype in QTYPES and v_cache.dtype == k_cache.dtype and v_scales is not None
                and k_scales.dtype == v_scales.dtype == torch.float32) if quant else \
        (k_cache.dtype == torch.float32 and v_cache.dtype == torch.float32)
    if (not enabled() or Rp > MAX_ROWS or D % 8 or Dv % 8 or qt.dtype != torch.float32 or not cache_ok
            or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or qt.device.type != "cpu"):
        return None
    lib = library()
    if lib is None:
        return None
    g = R // kvl.shape[1]
    q = torch.nn.functional.pad(qt, (0, 0, 0, Rp - R)).contiguous()
    rl = torch.nn.functional.pad(kvl.long().repeat_interleave(g, dim=1), (0, Rp - R)).contiguous()  # [Bg, Rp]
    tbl = tbl.long().contiguous()
    out = torch.empty(Bg, Hkv, Rp, Dv, dtype=torch.float32, device=qt.device)
    lse = torch.empty(Bg, Hkv, Rp, dtype=torch.float32, device=qt.device)
    ks, vs = k_cache.stride(), v_cache.stride()
    qtype = QTYPES[k_cache.dtype] if quant else 0
    kss = k_scales.stride() if quant else (0, 0, 0)  # type: ignore[union-attr]
    vss = v_scales.stride() if quant else (0, 0, 0)  # type: ignore[union-attr]
    rc = lib.cp_decode_attention(torch.get_num_threads(), q.data_ptr(), rl.data_ptr(), Bg, Hkv, Rp, D, Dv, scale,
                                 k_cache.data_ptr(), v_cache.data_ptr(), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                                 k_cache.shape[1], tbl.data_ptr(), tbl.shape[1], out.data_ptr(), lse.data_ptr(),
                                 qtype, k_scales.data_ptr() if quant else None,  # type: ignore[union-attr]
                                 v_scales.data_ptr() if quant else None, *kss, *vss)  # type: ignore[union-attr]
    if rc != 0:  # no AVX2 / FMA on this CPU (1), or no memory for the dequantised block (2)
        return None
    return out[:, :, :R], lse[:, :, :R]
