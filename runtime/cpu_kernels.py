"""specserve's own int4 and int8 weight products, and float32 products on weights it
prepacks, for x86 CPUs with AVX2 (cpu_kernels.cpp, q8_kernels.cpp), RMSNorm, the int models'
short passes' float64 attention with RoPE, and the attention of short passes over cached rows
(float32 or float64), each one call.

The int products multiply the weight codes either by each row's activations quantised to 8
bits per block of 32, with integer dot products (q8_kernels.cpp, the default, `ACTIVATIONS`
"int8": AVX2's maddubs, VNNI's dot product where the CPU has it, AMX's tile multiply for
passes of AMX_MIN_ROWS rows or more where it has AMX-INT8, q8_amx.cpp and `use_amx`, with the
same bits), so that a pass of many rows costs little more than one row; or by the float32 activations as they are ("float32",
cpu_kernels.cpp: weights decoded to float32, compute-bound with many rows). torch's CPU
kernels for int weights take bfloat16 activations, and on the CPUs measured (AMD EPYCs with
AVX2 or AVX-512, an Intel Xeon with AMX) they are slower than these (docs/DESIGN-NOTES.md); for float32, oneDNN's
prepacked product is slower than these for passes of a few rows. Every one gives each row the
same result whatever the rows beside it (the lossless contract). The sources are compiled with
the system's C++ compiler on first use, a few seconds, for AVX-512 where torch finds it and
AVX2 otherwise, with VNNI where /proc/cpuinfo shows it, and kept in the cache directory
(`runtime.cache.cache_root`).

Who multiplies (`preferred`, `CpuTuning.kernels`, SPECSERVE_CPU_KERNELS at the edge):
`auto` these wherever they can be built (on a CPU with AMX too: there they measured faster
than torch's, docs/DESIGN-NOTES.md), else torch's (no compiler, no AVX2, not x86: a warning
says so); `native` these on any AVX2 CPU, an error if they cannot be built; `torch` torch's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from .cache import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# one library; q8_amx.cpp is empty unless built with AMX_FLAGS
SOURCES = (SOURCE, Path(__file__).with_name("q8_kernels.cpp"), Path(__file__).with_name("q8_amx.cpp"))
HEADERS = (Path(__file__).with_name("q8_amx.h"),)  # what the sources include: in the library's key
GROUP = 32  # inputs per int4 group and per step of every product
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]  # what torch's AVX512 capability means
# the integer dot product of the 8-bit-activation products, where the CPU has it (/proc/cpuinfo's
# flag: the compiler's flag); a compiler that lacks it builds without
VNNI_FLAGS = {"AVX512": ("avx512_vnni", "-mavx512vnni"), "AVX2": ("avx_vnni", "-mavxvnni")}
# AMX's tile multiply for the 8-bit-activation products of several rows (q8_amx.cpp), on an
# AVX-512 build where the CPU has AMX-INT8; a compiler that lacks the flags builds without
AMX_FLAGS = ("amx_int8", ["-mamx-tile", "-mamx-int8"])
AMX_MIN_ROWS = 8  # passes of fewer rows keep VNNI's products: faster there (docs/DESIGN-NOTES.md)
CHOICES = ("auto", "native", "torch")  # who multiplies (module doc)
# what an int8/int4 layer's native product multiplies its weights by: the activations quantised
# to 8 bits per block of 32 (integer dot products, q8_kernels.cpp), or float32 as they are
ACTIVATIONS = ("int8", "float32")
LANES = 8  # output channels a packed tile of the 8-bit-activation products holds (kLanes)

_library: ctypes.CDLL | None = None
_error: str | None = None  # why they cannot load, once tried


def available(cache_dir: str | os.PathLike | None = None, compiler: str | None = None) -> bool:
    """Whether the native products can run here (built, under `cache_dir`, by `compiler`
    (None: g++ or c++ on the PATH), and loaded on first call)."""
    return library(cache_dir, compiler) is not None


def preferred(choice: str = "auto", cache_dir: str | os.PathLike | None = None, compiler: str | None = None) -> bool:
    """Whether linear layers on the CPU take the native products, by `choice` (module doc)."""
    if choice not in CHOICES:
        raise ValueError(f"CPU kernels: choice must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "torch":
        return False
    if available(cache_dir, compiler):
        return True
    if choice == "native":
        raise RuntimeError(f"specserve's CPU kernels were asked for (native), but they cannot load: {_error}")
    return False


def fits(in_features: int) -> bool:
    return in_features % GROUP == 0


FLOAT32_CHANNELS = 4  # output channels a float32 product takes at once (kF32Channels)


def float32_fits(out_features: int, in_features: int) -> bool:
    return fits(in_features) and out_features % FLOAT32_CHANNELS == 0


def library(cache_dir: str | os.PathLike | None = None, compiler: str | None = None) -> ctypes.CDLL | None:
    """The loaded products, or None (once, a warning says why) where they cannot load."""
    global _library, _error
    if _library is None and _error is None:
        try:
            _library = _load(cache_dir, compiler)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _error = str(e)
            log.warning("specserve's CPU kernels are unavailable (%s): linear layers use torch's", e)
    return _library


def _cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; none where it cannot tell)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def build_flags(vnni: bool = True, amx: bool | None = None) -> list[str]:
    """The compiler's flags for this CPU: AVX-512 where torch finds it, else AVX2; with `vnni`,
    VNNI's dot product where the CPU has it (AVX512-VNNI, or AVX-VNNI beside AVX2); with `amx`
    (None: as `vnni`), AMX-INT8 on an AVX-512 build where the CPU has it."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = FLAGS + AVX512_FLAGS if capability == "AVX512" else list(FLAGS)
    cpu_flag, flag = VNNI_FLAGS.get(capability, VNNI_FLAGS["AVX2"])
    present = cpu_flags()
    flags = flags + [flag] if vnni and cpu_flag in present else flags
    amx = vnni if amx is None else amx
    return flags + AMX_FLAGS[1] if amx and capability == "AVX512" and AMX_FLAGS[0] in present else flags


def _load(cache_dir, compiler: str | None) -> ctypes.CDLL:
    if not _cpu_supported():
        raise RuntimeError(f"needs an x86-64 CPU with AVX2, this one is {platform.machine()} "
                           f"{torch.backends.cpu.get_cpu_capability()}")
    # a compiler without the CPU's AMX flags (gcc 11) or VNNI flag (AVX-VNNI needs gcc 11)
    # builds without them
    tries = [build_flags(), build_flags(amx=False), build_flags(vnni=False)]
    tries = [f for i, f in enumerate(tries) if f not in tries[:i]]
    for i, flags in enumerate(tries):
        try:
            path = _built(cache_dir, compiler, flags)
            break
        except RuntimeError as e:
            if i == len(tries) - 1:
                raise
            log.warning("specserve's CPU kernels build without %s: %s", " ".join(set(flags) - set(tries[i + 1])), e)
    lib = _declared(ctypes.CDLL(str(path)))
    lib.q8_amx_min_rows(AMX_MIN_ROWS)
    return lib


def variant(defines: Sequence[str], cache_dir: str | os.PathLike | None = None,
            compiler: str | None = None) -> ctypes.CDLL:
    """The 8-bit-activation products alone (q8_kernels.cpp), built with extra preprocessor
    `defines` and this CPU's flags without VNNI: the tests build other CPUs' paths emulated on
    AVX2 so ("-DSPECSERVE_EMULATE_VNNI", "-DSPECSERVE_EMULATE_AVX512")."""
    lib = ctypes.CDLL(str(_built(cache_dir, compiler, build_flags(vnni=False) + list(defines), SOURCES[1:])))
    return _declared_q8(lib)


def _declared_q8(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.q8_quantize.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr]
    lib.int4_linear_q8.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.int8_linear_q8.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int, i64, ptr]
    lib.q8_vnni.argtypes, lib.q8_vnni.restype = [], ctypes.c_int
    lib.q8_amx.argtypes, lib.q8_amx.restype = [], ctypes.c_int
    lib.q8_amx_min_rows.argtypes, lib.q8_amx_min_rows.restype = [ctypes.c_int], ctypes.c_int
    for fn in (lib.q8_quantize, lib.int4_linear_q8, lib.int8_linear_q8):
        fn.restype = None
    return lib


def _declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    _declared_q8(lib)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.int4_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.int8_linear.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_int, i64, ptr]
    lib.int4_dequantize.argtypes = [i64, ptr, i64, ptr]
    lib.float32_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.float32_pack.argtypes = [ptr, i64, i64, ptr]
    lib.rms_norm.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr]
    lib.attend.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, ptr]
    lib.attend_rows_float32.argtypes = lib.attend_rows_float64.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr,
                                                                           i64, i64, ptr, i64, ptr, ptr, ptr, i64]
    for fn in (lib.float32_pack, lib.float32_linear, lib.int4_linear, lib.int8_linear, lib.int4_dequantize,
               lib.rms_norm, lib.attend, lib.attend_rows_float32, lib.attend_rows_float64):
        fn.restype = None
    return lib


def library_path(cache_dir: str | os.PathLike | None = None, flags: Sequence[str] | None = None,
                 sources: Sequence[Path] = SOURCES) -> Path:
    """Where the library compiled from `sources` with these flags (None: `build_flags()`) is kept."""
    flags = build_flags() if flags is None else flags
    text = b"".join(p.read_bytes() for p in (*sources, *HEADERS))
    key = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "kernels" / f"cpu_kernels-{key}.so"


def _built(cache_dir, compiler: str | None, flags: list[str], sources: Sequence[Path] = SOURCES) -> Path:
    """The compiled library for these sources and these flags, compiling it if needed."""
    path = library_path(cache_dir, flags, sources)
    if path.exists():  # built before: no compiler needed
        return path
    compiler = compiler or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) to build them with")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=path.parent)  # processes may build at once
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", partial, *map(str, sources)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def int4_linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 contiguous @ W.T, W given as Q4_1 `blocks` [out, in/32, 24] (`to_blocks`)."""
    rows, k = x.shape
    y = torch.empty(rows, blocks.shape[0], dtype=torch.float32)
    _library.int4_linear(x.data_ptr(), rows, k, blocks.data_ptr(), blocks.shape[0], y.data_ptr())
    return y


def float32_pack(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] float32 (`float32_fits`) in the layout `float32_linear` reads: [out / 4, in / 16,
    4, 16], a tile of 4 output channels' weights one stream. Viewed as [out, in]."""
    out, k = w.shape
    packed = torch.empty(out * k, dtype=torch.float32)
    _library.float32_pack(w.contiguous().data_ptr(), out, k, packed.data_ptr())
    return packed.view(out, k)


def float32_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 contiguous @ W.T, W [out, in] as `float32_pack` packed it."""
    rows, k = x.shape
    y = torch.empty(rows, packed.shape[0], dtype=torch.float32)
    _library.float32_linear(x.data_ptr(), rows, k, packed.data_ptr(), packed.shape[0], y.data_ptr())
    return y


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 contiguous @ W.T, W = q [out, in] int8 times float32 `scales`: [out],
    one per channel, or [out, in/32], one per group of 32 inputs (GGUF's Q8_0)."""
    rows, k = x.shape
    y = torch.empty(rows, q.shape[0], dtype=torch.float32)
    _library.int8_linear(x.data_ptr(), rows, k, q.data_ptr(), scales.data_ptr(), int(scales.dim() == 2), q.shape[0],
                         y.data_ptr())
    return y


def int4_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """The weights [out, in] float32 that `int4_linear` multiplies by."""
    out, groups, _ = blocks.shape
    w = torch.empty(out, groups * GROUP, dtype=torch.float32)
    _library.int4_dequantize(groups * GROUP, blocks.data_ptr(), out, w.data_ptr())
    return w


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [rows, k] float32 contiguous, k a multiple of 8: weight * x / sqrt(mean(x^2) + eps)."""
    rows, k = x.shape
    y = torch.empty(rows, k, dtype=torch.float32)
    _library.rms_norm(x.data_ptr(), rows, k, weight.data_ptr(), eps, y.data_ptr())
    return y


MAX_HEAD_DIM = 256  # attend's limit (kMaxHeadDim)
MAX_QUERIES = 1024  # of one row and kv head in one call (kMaxQueries)
ATTEND_ROWS_FLOAT32_LANES = 16  # float32 heads go 16 floats a vector (8 in the AVX2 build: 16 suits both)


def attends(head_dim: int) -> bool:
    """Whether `attend` takes heads of this size."""
    return head_dim % 4 == 0 and head_dim <= MAX_HEAD_DIM


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           start: int, mask: torch.Tensor, n_heads: int, slot_map: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's attention for t new tokens in float64 (cpu_kernels.cpp's `attend`).

    qkv [t, (n_heads + 2 n_kv) * d] float32; cos, sin [t, d] float32 (model.Transformer's
    rope tables at the tokens' positions); k_cache, v_cache [n_kv, max_len, d] float32 (the
    keys and values are float32 values: the attention widens them as it reads them), written
    at slots start..start+t-1; mask [t, span] float64, 0 or -inf. `slot_map`: int32 [span
    at least], where each slot lies in the caches' max_len (a paged cache's row,
    runtime/paged_kv.py; None: slot s at s). Returns [t, n_heads * d] float32, each query's
    output the one it gets alone."""
    t = qkv.shape[0]
    n_kv, max_len, d = k_cache.shape
    if n_heads // n_kv * t > MAX_QUERIES:
        raise ValueError(f"attend: {n_heads // n_kv * t} queries of one kv head exceed {MAX_QUERIES}")
    if k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32 or mask.dtype != torch.float64:
        raise ValueError(f"attend: caches {k_cache.dtype} and {v_cache.dtype}, mask {mask.dtype}: "
                         "float32 caches and a float64 mask")
    _check_map(slot_map, 1, start + t)
    out = torch.empty(t, n_heads * d, dtype=torch.float32)
    _library.attend(qkv.data_ptr(), t, n_heads, n_kv, d, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                    v_cache.data_ptr(), max_len, start, mask.data_ptr(), mask.shape[-1], out.data_ptr(),
                    None if slot_map is None else slot_map.data_ptr())
    return out


def _check_map(slot_map: torch.Tensor | None, rows: int, slots: int) -> None:
    if slot_map is not None and (slot_map.dtype != torch.int32 or not slot_map.is_contiguous()
                                 or slot_map.numel() < rows * slots):
        raise ValueError(f"a slot map is int32, contiguous, {slots} slots a row: got {slot_map.dtype} "
                         f"{tuple(slot_map.shape)}")


def attends_rows(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether `attend_rows` takes heads of this size attending in this dtype."""
    if dtype == torch.float64:
        return attends(head_dim)
    return dtype == torch.float32 and head_dim % ATTEND_ROWS_FLOAT32_LANES == 0 and head_dim <= MAX_HEAD_DIM


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                limits: Sequence[int], slot_map: torch.Tensor | None = None) -> torch.Tensor:
    """The attention of b rows of t new queries each, their keys and values in the caches already
    (cpu_kernels.cpp's `attend_rows`), in the queries' dtype (float32 or float64, `attends_rows`).

    q [b, n_heads, t, d] in that dtype; k_cache, v_cache [b, n_kv, max_len, d] float32 in
    either (a rows view of the cache, or a paged cache's rows gathered: each row's kv heads at
    any strides, each head's slots contiguous); mask [b, 1, t,
    span] additive (0 or -inf) in the queries' dtype; row r's queries see slots below
    limits[r] at most. `slot_map` int32 [b, S] (S at least every limit): row r's slot s lies at
    slot_map[r, s] of its heads' max_len, as a paged cache's block table places it
    (runtime/paged_kv.py: the caches then the pool's, every row the same, stride 0); None: at s.
    Returns [b, t, n_heads * d] float32, each query's output the one it gets
    in any batch: one thread's fixed sequence of operations over the slots its mask row allows."""
    b, n_heads, t, d = q.shape
    n_kv, max_len = k_cache.shape[1], k_cache.shape[2]
    if not attends_rows(d, q.dtype) or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32 \
            or mask.dtype != q.dtype:
        raise ValueError(f"attend_rows: heads of {d} in {q.dtype} (cache {k_cache.dtype}, mask {mask.dtype}) "
                         "do not fit it")
    if n_heads // n_kv * t > MAX_QUERIES:
        raise ValueError(f"attend_rows: {n_heads // n_kv * t} queries of one kv head exceed {MAX_QUERIES}")
    if k_cache.stride()[2:] != (d, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError("attend_rows: each cache row's kv heads must hold their slots contiguous")
    if slot_map is not None:
        _check_map(slot_map, b, max(limits))
        if slot_map.dim() != 2 or slot_map.shape[0] != b:
            raise ValueError(f"attend_rows: a slot map of {b} rows, got {tuple(slot_map.shape)}")
    q, mask = q.contiguous(), mask.contiguous()
    out = torch.empty(b, t, n_heads * d, dtype=torch.float32)
    bounds = (ctypes.c_int64 * b)(*limits)
    kernel = _library.attend_rows_float64 if q.dtype == torch.float64 else _library.attend_rows_float32
    kernel(q.data_ptr(), b, t, n_heads, n_kv, d, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
           k_cache.stride(1), mask.data_ptr(), mask.shape[-1], bounds, out.data_ptr(),
           None if slot_map is None else slot_map.data_ptr(), 0 if slot_map is None else slot_map.shape[1])
    return out


def to_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks [out, in/32, 24] uint8 of w = d * q + m: q [out, in] in 0..15, d and m
    [out, in/32] float32. Each block is d and m, then 16 bytes whose byte i holds q[i] low
    and q[i + 16] high (a GGUF's Q4_1 block with its float16 d and m widened, exactly)."""
    out, k = q.shape
    groups = q.to(torch.uint8).reshape(out, k // GROUP, GROUP)
    nibbles = groups[..., :GROUP // 2] | (groups[..., GROUP // 2:] << 4)
    scales = torch.stack((d, m), dim=-1).float().contiguous().view(torch.uint8)
    return torch.cat((scales, nibbles), dim=-1).contiguous()


def vnni(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the 8-bit-activation products take VNNI's dot product here (else AVX2's)."""
    return bool((lib or _library).q8_vnni())


def amx(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the 8-bit-activation products of AMX_MIN_ROWS rows or more take AMX's tile
    multiply here (q8_amx.cpp: built with it, Linux lent the tile state, not turned off)."""
    return bool((lib or library()).q8_amx())


def use_amx(on: bool, lib: ctypes.CDLL | None = None, min_rows: int = AMX_MIN_ROWS) -> bool:
    """Turn the AMX products on (passes of `min_rows` rows or more) or off, for the whole
    process (one library); returns `amx()`. Their results are the VNNI products' bit for bit:
    the setting changes only the speed."""
    return bool((lib or library()).q8_amx_min_rows(min_rows if on else 0))


def _tiles(out: int) -> int:
    return -(-out // LANES)


def _padded(t: torch.Tensor, out: int) -> torch.Tensor:
    """`t` [out, ...] with zero channels appended up to whole tiles of LANES."""
    return torch.cat((t, t.new_zeros(_tiles(out) * LANES - out, *t.shape[1:]))) if out % LANES else t


def int4_pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """w = d * q + m (q [out, in] in 0..15, d and m [out, in/32] float32) for `int4_linear_q8`:
    uint8 [tiles, in/32, 192], a tile of LANES = 8 output channels (the last one padded with
    zeros), each block of 32 inputs 128 bytes of codes, then d and m of the 8 channels. Code
    vector j (32 bytes) holds at byte 4c + i channel c's input 8j + i low and 8j + 4 + i high."""
    out, k = q.shape
    tiles, groups = _tiles(out), k // GROUP
    codes = _padded(q.to(torch.uint8), out).reshape(tiles, LANES, groups, 4, 2, 4)  # t c g j half i
    codes = codes.permute(0, 2, 3, 1, 5, 4)  # t g j c i half
    nibbles = (codes[..., 0] | (codes[..., 1] << 4)).reshape(tiles, groups, GROUP * LANES // 2)

    def scales(s):  # [out, groups] -> [tiles, groups, 8] bytes
        return _padded(s.float(), out).reshape(tiles, LANES, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat((nibbles, scales(d), scales(m)), dim=-1).contiguous()


def int4_unpack(packed: torch.Tensor, out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, m) of `int4_pack`'s tiles."""
    tiles, groups, _ = packed.shape
    nibbles = packed[..., :GROUP * LANES // 2].reshape(tiles, groups, 4, LANES, 4)  # t g j c i
    codes = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1)  # t g j c i half
    q = codes.permute(0, 3, 1, 2, 5, 4).reshape(tiles * LANES, groups * GROUP)[:out].to(torch.int32)

    def scales(first):
        s = packed[..., first:first + 4 * LANES].contiguous().view(torch.float32)  # t g c
        return s.transpose(1, 2).reshape(tiles * LANES, groups)[:out].contiguous()

    return q, scales(GROUP * LANES // 2), scales(GROUP * LANES // 2 + 4 * LANES)


def int8_pack(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w = scales * q (q [out, in] int8; scales float32 [out], a channel's, or [out, in/32], a
    block's: GGUF's Q8_0) for `int8_linear_q8`: codes int8 [tiles, in/32, 256], a tile of LANES
    = 8 output channels (the last padded with zeros), code vector j (32 bytes) holding at byte
    4c + i channel c's input 4j + i; and the scales, [tiles * 8] or [tiles, in/32, 8]."""
    out, k = q.shape
    tiles, groups = _tiles(out), k // GROUP
    codes = _padded(q.to(torch.int8), out).reshape(tiles, LANES, groups, 8, 4).permute(0, 2, 3, 1, 4)
    s = _padded(scales.float(), out)
    if scales.dim() == 2:
        s = s.reshape(tiles, LANES, groups).transpose(1, 2)
    return codes.reshape(tiles, groups, GROUP * LANES).contiguous(), s.contiguous()


def int8_unpack(codes: torch.Tensor, scales: torch.Tensor, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of `int8_pack`'s tiles."""
    tiles, groups, _ = codes.shape
    q = codes.reshape(tiles, groups, 8, LANES, 4).permute(0, 3, 1, 2, 4).reshape(tiles * LANES, groups * GROUP)
    s = scales.transpose(1, 2).reshape(tiles * LANES, groups) if scales.dim() == 3 else scales
    return q[:out].contiguous(), s[:out].contiguous()


def q8_quantize(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, ...]:
    """The 8-bit activations the `*_q8` products make of x [rows, in] float32 contiguous: codes
    int8 [rows, in], and per block of 32 d = max|x| / 127, d * sum(codes) and sum(codes)
    int32 [rows, in/32] (q8_kernels.cpp)."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    d, s = torch.empty(rows, k // GROUP), torch.empty(rows, k // GROUP)
    total = torch.empty(rows, k // GROUP, dtype=torch.int32)
    (lib or _library).q8_quantize(x.data_ptr(), rows, k, q.data_ptr(), d.data_ptr(), s.data_ptr(), total.data_ptr())
    return q, d, s, total


def int4_linear_q8(x: torch.Tensor, packed: torch.Tensor, out: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] float32 contiguous @ W.T, W given as `int4_pack`'s tiles of `out` channels,
    x quantised to 8 bits per block of 32 (`q8_quantize`)."""
    rows, k = x.shape
    y = torch.empty(rows, out, dtype=torch.float32)
    (lib or _library).int4_linear_q8(x.data_ptr(), rows, k, packed.data_ptr(), out, y.data_ptr())
    return y


def int8_linear_q8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out: int,
                   lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] float32 contiguous @ W.T, W given as `int8_pack`'s tiles of `out` channels and
    scales, x quantised to 8 bits per block of 32 (`q8_quantize`)."""
    rows, k = x.shape
    y = torch.empty(rows, out, dtype=torch.float32)
    (lib or _library).int8_linear_q8(x.data_ptr(), rows, k, codes.data_ptr(), scales.data_ptr(),
                                     int(scales.dim() == 3), out, y.data_ptr())
    return y
