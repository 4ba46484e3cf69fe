"""The environment variables read at the edge (cluster.env) keep their names, accepted
values and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.env import cache_dir_from_env, cpu_tuning_from_env
from runtime.cpu_tuning import CpuTuning
from runtime.cache import cache_root


def test_cpu_tuning_from_env(monkeypatch):
    monkeypatch.delenv("SPECSERVE_PACKED_LINEAR", raising=False)
    monkeypatch.delenv("SPECSERVE_ONE_ROW_LINEAR", raising=False)
    monkeypatch.delenv("SPECSERVE_SHORT_ROWS_LINEAR", raising=False)
    monkeypatch.delenv("SPECSERVE_LONG_ROWS_LINEAR", raising=False)
    monkeypatch.delenv("SPECSERVE_CPU_KERNELS", raising=False)
    monkeypatch.delenv("SPECSERVE_INT_ACTIVATIONS", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    assert cpu_tuning_from_env() == CpuTuning(packed_linear=True, one_row="auto", short_rows="auto", long_rows="auto")
    for choice in ("auto", "blas", "packed"):
        monkeypatch.setenv("SPECSERVE_ONE_ROW_LINEAR", choice)
        assert cpu_tuning_from_env() == CpuTuning(one_row=choice)
    monkeypatch.setenv("SPECSERVE_ONE_ROW_LINEAR", "fast")
    with pytest.raises(ValueError, match="SPECSERVE_ONE_ROW_LINEAR must be auto, blas or packed, got 'fast'"):
        cpu_tuning_from_env()
    monkeypatch.setenv("SPECSERVE_PACKED_LINEAR", "0")  # packing off: the one-row path is not read
    assert cpu_tuning_from_env() == CpuTuning(packed_linear=False)
    monkeypatch.setenv("SPECSERVE_PACKED_LINEAR", "1")
    monkeypatch.setenv("SPECSERVE_ONE_ROW_LINEAR", "blas")
    assert cpu_tuning_from_env() == CpuTuning(one_row="blas")
    paths = (("SPECSERVE_SHORT_ROWS_LINEAR", "short_rows", ("auto", "blas", "padded"), "packed"),
             ("SPECSERVE_LONG_ROWS_LINEAR", "long_rows", ("auto", "blas", "packed"), "padded"))
    for var, field, choices, wrong in paths:
        for choice in choices:
            monkeypatch.setenv(var, choice)
            assert cpu_tuning_from_env() == CpuTuning(one_row="blas", **{field: choice})
        monkeypatch.setenv(var, wrong)
        accepted = f"{', '.join(choices[:-1])} or {choices[-1]}"
        with pytest.raises(ValueError, match=f"{var} must be {accepted}, got '{wrong}'"):
            cpu_tuning_from_env()
        monkeypatch.setenv(var, "auto")
    for choice in ("auto", "native", "torch"):  # read whether packing is on or not
        monkeypatch.setenv("SPECSERVE_CPU_KERNELS", choice)
        assert cpu_tuning_from_env().kernels == choice
        monkeypatch.setenv("SPECSERVE_PACKED_LINEAR", "0")
        assert cpu_tuning_from_env() == CpuTuning(packed_linear=False, kernels=choice)
        monkeypatch.setenv("SPECSERVE_PACKED_LINEAR", "1")
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="SPECSERVE_CPU_KERNELS must be auto, native or torch, got 'fast'"):
        cpu_tuning_from_env()
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "auto")
    assert cpu_tuning_from_env().int_activations == "int8"
    for choice in ("int8", "float32"):  # what the int products multiply by, read whether packing is on or not
        monkeypatch.setenv("SPECSERVE_INT_ACTIVATIONS", choice)
        assert cpu_tuning_from_env().int_activations == choice
        monkeypatch.setenv("SPECSERVE_PACKED_LINEAR", "0")
        assert cpu_tuning_from_env() == CpuTuning(packed_linear=False, int_activations=choice)
        monkeypatch.setenv("SPECSERVE_PACKED_LINEAR", "1")
    monkeypatch.setenv("SPECSERVE_INT_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="SPECSERVE_INT_ACTIVATIONS must be int8 or float32, got 'int4'"):
        cpu_tuning_from_env()
    monkeypatch.setenv("SPECSERVE_INT_ACTIVATIONS", "int8")
    monkeypatch.setenv("CXX", "/usr/bin/clang++")  # the compiler that builds specserve's products
    assert cpu_tuning_from_env().compiler == "/usr/bin/clang++"
    monkeypatch.setenv("SPECSERVE_PACKED_LINEAR", "0")
    assert cpu_tuning_from_env().compiler == "/usr/bin/clang++"


def test_cache_dir_from_env(monkeypatch, tmp_path):
    default = Path.home() / ".cache" / "specserve"
    monkeypatch.delenv("SPECSERVE_CACHE_DIR", raising=False)
    assert cache_root(cache_dir_from_env()) == default
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", "")
    assert cache_root(cache_dir_from_env()) == default
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    assert cache_root(cache_dir_from_env()) == tmp_path
