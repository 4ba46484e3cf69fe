"""Environment variables that set how the core runs, read here at the edge: the functions
of `speculative/` take their values as parameters.

- SPECSERVE_PACKED_LINEAR: `0` keeps the linear layers unpacked on the CPU.
- SPECSERVE_ONE_ROW_LINEAR: the path of one row through packed layers, `auto`
  (the default: whichever this CPU runs faster), `blas` or `packed`.
- SPECSERVE_SHORT_ROWS_LINEAR: the path of 2-3 rows, `auto` (the default:
  whichever this CPU runs faster), `blas`, or `padded` to 4 rows through the
  packed layers.
- SPECSERVE_LONG_ROWS_LINEAR: the path of passes over 256 rows (long prefills),
  `auto` (the default: whichever this CPU runs faster), `blas` or `packed`; for int8/int4
  layers on specserve's products, `packed` keeps such passes on them (row-exact, slower),
  the others take BLAS.
- SPECSERVE_CPU_KERNELS: who multiplies on the CPU, int8/int4 weights and float32
  models' linear layers (with their norms), `auto` (the default: specserve's own on an
  x86 CPU with AVX2 or AVX-512, torch's where they cannot be built), `native` (specserve's own on
  any AVX2 CPU) or `torch` (torch's, and oneDNN's prepacked float32 layers).
- SPECSERVE_INT_ACTIVATIONS: what specserve's int8/int4 products multiply the weights by,
  `int8` (the default: the activations quantised to 8 bits per block of 32, integer dot
  products) or `float32` (the activations as they are: slower for passes of many rows).
- SPECSERVE_AMX: `0` keeps specserve's int8/int4 products of several rows off AMX's tile
  multiply on CPUs that have it (the same results, slower; the default `1` takes it).
- CXX: the C++ compiler that builds specserve's CPU products on first use (unset:
  g++ or c++ on the PATH).
- SPECSERVE_CACHE_DIR: the cache of converted models and distillation data
  (unset or empty: ~/.cache/specserve).
- SPECSERVE_CLUSTER_SECRET: the secret every internal call carries, when the
  config names none (`[security] cluster_secret`); it must be the same on
  every node. Unset or empty: one is generated and kept in the state store.
"""

from __future__ import annotations

import os

from runtime.cpu_tuning import INT_ACTIVATIONS, KERNELS, LONG_ROWS_PATHS, ONE_ROW_PATHS, SHORT_ROWS_PATHS, CpuTuning


def cpu_tuning_from_env() -> CpuTuning:
    """SPECSERVE_PACKED_LINEAR and the paths through packed layers, SPECSERVE_ONE_ROW_LINEAR,
    SPECSERVE_SHORT_ROWS_LINEAR and SPECSERVE_LONG_ROWS_LINEAR, SPECSERVE_CPU_KERNELS,
    SPECSERVE_INT_ACTIVATIONS, SPECSERVE_AMX and CXX (see module doc); the paths are only read when packing is on."""
    kernels = os.environ.get("SPECSERVE_CPU_KERNELS", "auto")
    if kernels not in KERNELS:
        raise ValueError(f"SPECSERVE_CPU_KERNELS must be auto, native or torch, got {kernels!r}")
    activations = os.environ.get("SPECSERVE_INT_ACTIVATIONS", "int8")
    if activations not in INT_ACTIVATIONS:
        raise ValueError(f"SPECSERVE_INT_ACTIVATIONS must be int8 or float32, got {activations!r}")
    compiler = os.environ.get("CXX") or None
    amx = os.environ.get("SPECSERVE_AMX", "1")
    if amx not in ("0", "1"):
        raise ValueError(f"SPECSERVE_AMX must be 0 or 1, got {amx!r}")
    if os.environ.get("SPECSERVE_PACKED_LINEAR", "1") == "0":
        return CpuTuning(packed_linear=False, kernels=kernels, compiler=compiler, int_activations=activations,
                         amx=amx == "1")
    one_row = os.environ.get("SPECSERVE_ONE_ROW_LINEAR", "auto")
    if one_row not in ONE_ROW_PATHS:
        raise ValueError(f"SPECSERVE_ONE_ROW_LINEAR must be auto, blas or packed, got {one_row!r}")
    short_rows = os.environ.get("SPECSERVE_SHORT_ROWS_LINEAR", "auto")
    if short_rows not in SHORT_ROWS_PATHS:
        raise ValueError(f"SPECSERVE_SHORT_ROWS_LINEAR must be auto, blas or padded, got {short_rows!r}")
    long_rows = os.environ.get("SPECSERVE_LONG_ROWS_LINEAR", "auto")
    if long_rows not in LONG_ROWS_PATHS:
        raise ValueError(f"SPECSERVE_LONG_ROWS_LINEAR must be auto, blas or packed, got {long_rows!r}")
    return CpuTuning(one_row=one_row, short_rows=short_rows, long_rows=long_rows, kernels=kernels, compiler=compiler,
                     int_activations=activations, amx=amx == "1")


def cache_dir_from_env() -> str | None:
    """SPECSERVE_CACHE_DIR; None when unset or empty (`runtime.cache.cache_root`'s default)."""
    return os.environ.get("SPECSERVE_CACHE_DIR") or None


CLUSTER_SECRET_ENV = "SPECSERVE_CLUSTER_SECRET"


def cluster_secret_from_env() -> str | None:
    """SPECSERVE_CLUSTER_SECRET; None when unset or empty. At least 16 characters, as in the config."""
    secret = os.environ.get(CLUSTER_SECRET_ENV) or None
    if secret is not None and len(secret) < 16:
        raise ValueError(f"{CLUSTER_SECRET_ENV} must be at least 16 characters long")
    return secret
