"""CPU speed tuning, applied to a plain model (`apply_cpu_tuning`).

The model in `model.py` computes the same thing without it; this module only
makes its passes cheaper on a CPU, and is installed onto a loaded model the way
parallelism is applied to a plain one:

- the linear layers are prepacked: CPU BLAS multiplies a few rows inefficiently,
  and a pass of several new tokens (what verifying a draft is) costs much less
  prepacked. Where specserve's own CPU products run (`runtime.cpu_kernels`,
  `CpuTuning.kernels`) they are packed for those (`NativeLinear`), else in
  oneDNN's blocked layout (`PackedLinear`), whose one row, and 2-3 rows, take
  whichever path this CPU runs faster, measured once per process (`_blas_wins`);
- where 2-3 rows are cheaper packed, one row of 2-3 new tokens is padded to
  PAD_ROWS_TO tokens;
- passes longer than PACKED_CHUNK_ROWS rows (long prefills) take whichever of BLAS
  and the packed path this CPU runs faster, measured once per process;
- each serving thread keeps its own torch thread count (`own_torch_threads`).

What was measured to choose these is in docs/DESIGN-NOTES.md.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .cpu_kernels import ACTIVATIONS, CHOICES
from .model import Transformer

# On the CPU a pass of one row and 2-3 new tokens runs padded to this many: BLAS takes a
# slower path for 2-3 rows than for 4. Whoever sizes a KV cache leaves this many spare
# slots after the tokens it needs, so that the padding fits.
PAD_ROWS_TO = 4

ONE_ROW_PATHS = ("auto", "blas", "packed")
SHORT_ROWS_PATHS = ("auto", "blas", "padded")
LONG_ROWS_PATHS = ("auto", "blas", "packed")
KERNELS = CHOICES  # who multiplies on the CPU (runtime/cpu_kernels.py)
INT_ACTIVATIONS = ACTIVATIONS  # what specserve's int8/int4 products multiply the weights by

# oneDNN keeps a primitive, with scratch memory sized by its rows, for every shape it meets
# (up to 1,024 of them): a server whose passes took every row count up to a prompt's length
# grew by gigabytes. A packed layer therefore runs at most PACKED_CHUNK_ROWS rows a call,
# padded to one of a few sizes (`packed_rows`): about 80 shapes per layer size.
PACKED_CHUNK_ROWS = 256
_EXACT_ROWS = 16  # up to this many rows run unpadded: the sizes a verification pass takes
LONG_ROWS_TIMED = 2 * PACKED_CHUNK_ROWS  # the long pass `apply_cpu_tuning` times, one layer's worth


@dataclass(frozen=True)
class CpuTuning:
    """How `apply_cpu_tuning` tunes a model.

    `packed_linear`: prepack the linear layers (float32 models only). `one_row`: the
    path one row takes through them: `blas`, `packed`, or `auto`, whichever this CPU
    runs faster (measured). `short_rows`: the path of 2-3 rows: `blas` as they are,
    `padded` to PAD_ROWS_TO rows through the packed layers (a pass of one row and 2-3
    new tokens is padded), or `auto`, whichever this CPU runs faster (measured).
    `long_rows`: the path of passes over PACKED_CHUNK_ROWS rows: `blas`, `packed` (in
    slices), or `auto`, whichever this CPU runs faster (measured). `kernels`: who
    multiplies (`runtime.cpu_kernels.preferred`): specserve's own products or
    torch's, for int8/int4 weights when `runtime.loading.load` quantises and for
    the float32 layers `packed_linear` packs (`NativeLinear` or `PackedLinear`).
    `compiler`: the C++ compiler that builds specserve's products on first use (None:
    g++ or c++ on the PATH). `int_activations`: what specserve's int8/int4 products multiply
    the weights by: `int8`, each row's activations quantised per block of 32 and integer dot
    products (a pass of many rows costs little more than one), or `float32`, the activations as
    they are (docs/DESIGN-NOTES.md, Precision). `amx`: the int8-activation products of several
    rows take AMX's tile multiply where the CPU has it (`cpu_kernels.use_amx`: the same bits,
    faster; process-wide, set by the last model quantised)."""

    packed_linear: bool = True
    one_row: str = "auto"
    short_rows: str = "auto"
    long_rows: str = "auto"
    kernels: str = "auto"
    compiler: str | None = None
    int_activations: str = "int8"
    amx: bool = True

    def __post_init__(self):
        if self.one_row not in ONE_ROW_PATHS:
            raise ValueError(f"one_row must be auto, blas or packed, got {self.one_row!r}")
        if self.short_rows not in SHORT_ROWS_PATHS:
            raise ValueError(f"short_rows must be auto, blas or padded, got {self.short_rows!r}")
        if self.long_rows not in LONG_ROWS_PATHS:
            raise ValueError(f"long_rows must be auto, blas or packed, got {self.long_rows!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be auto, native or torch, got {self.kernels!r}")
        if self.int_activations not in INT_ACTIVATIONS:
            raise ValueError(f"int_activations must be int8 or float32, got {self.int_activations!r}")


def apply_cpu_tuning(model: Transformer, tuning: CpuTuning = CpuTuning()) -> bool:
    """Tune an inference-only model on the CPU: prepack every linear layer of a float32
    model (`NativeLinear` where specserve's products run, with their norms and attention,
    `PackedLinear` otherwise), and
    pad one-row passes of 2-3 tokens to PAD_ROWS_TO where oneDNN's packed layers run 2-3
    rows packed. Returns whether the layers were packed: False, leaving them as they are
    (and padding short rows), for another device or dtype, a torch without oneDNN's packed
    linear and no native products, or `tuning.packed_linear` off; an int8 or int4 model's
    layers stay as they are, unpadded. The
    model remembers `tuning` (`tuning_of`). Not for training."""
    model.cpu_tuning = tuning
    # weight-only int layers (runtime/quantize.py) keep their own kernels, whose cost grows
    # with every row from the first: padding short passes is for BLAS
    int_layers = getattr(model, "precision", None) in ("int8", "int4")
    if model.device.type == "cpu" and type(model) is Transformer:
        model.__class__ = PaddedShortRows  # the same model, its forward wrapped
        model.pad_short_rows = not int_layers
    if not (tuning.packed_linear and not int_layers and model.device.type == "cpu"
            and model.dtype == torch.float32):
        return False
    native = cpu_kernels.preferred(tuning.kernels, compiler=tuning.compiler)
    ops = torch.ops.mkldnn
    if not native and not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                           and hasattr(ops, "_linear_pointwise")):
        return False
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        attn.qkv, attn.o = _prepacked(attn.qkv, native), _prepacked(attn.o, native)
        mlp.gate_up, mlp.down = _prepacked(mlp.gate_up, native), _prepacked(mlp.down, native)
    if isinstance(model.lm_head, nn.Linear):  # not a tensor-parallel rank's missing head (runtime/tp.py)
        model.lm_head = _prepacked(model.lm_head, native)  # a packed copy: the embedding stays for lookups
    if native:
        native_norms(model)
        native_attention(model)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    one_blas = short_blas = False  # NativeLinear layers take every short pass as it is
    if packed:
        one_blas = _blas_wins(packed, 1, 1) if tuning.one_row == "auto" else tuning.one_row == "blas"
        # 3 rows: of the short ones, the dearer for BLAS
        short_blas = (_blas_wins(packed, 3, PAD_ROWS_TO) if tuning.short_rows == "auto"
                      else tuning.short_rows == "blas")
    # compute-bound: one layer's products time it as well as the whole model's, and steadily
    first_layer = [m for m in model.layers[0].modules() if isinstance(m, (PackedLinear, NativeLinear))]
    long_blas = (_blas_wins(first_layer, LONG_ROWS_TIMED, LONG_ROWS_TIMED, repeats=3) if tuning.long_rows == "auto"
                 else tuning.long_rows == "blas")
    for m in model.modules():
        if isinstance(m, (PackedLinear, NativeLinear)):
            m.long_rows_blas = long_blas
        if isinstance(m, PackedLinear):
            m.one_row_blas, m.short_rows_blas = one_blas, short_blas
    if isinstance(model, PaddedShortRows):
        model.pad_short_rows = bool(packed) and not short_blas
    return True


class NativeRMSNorm(nn.Module):
    """`model.RMSNorm` of float32 rows by specserve's CPU product: one call where PyTorch runs
    about six operators, each row alone (row-exact). A float32 or int model's norms, where
    its products are specserve's (`native_norms`)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return cpu_kernels.rms_norm(rows, self.weight, self.eps).view(x.shape)


def native_norms(model: Transformer) -> bool:
    """Put a float32 model's RMSNorms on specserve's product (`NativeRMSNorm`) where its
    hidden size fits it; whether they were."""
    if model.config.hidden_size % 8:
        return False
    for layer in model.layers:
        layer.attn_norm, layer.mlp_norm = NativeRMSNorm(layer.attn_norm), NativeRMSNorm(layer.mlp_norm)
    model.norm = NativeRMSNorm(model.norm)
    return True


def native_attention(model: Transformer) -> bool:
    """Give a model's short passes specserve's attention over cached rows (`Attention.rows_attention`)
    where its heads and attention dtype fit it; whether they got it."""
    if not cpu_kernels.attends_rows(model.config.head_dim, model.attention_dtype or model.dtype):
        return False
    for layer in model.layers:
        layer.attn.rows_attention = cpu_kernels.attend_rows
    model.cache_dtype = torch.float32  # what it reads in either dtype (Transformer.cache_dtype)
    return True


def cpu_has_bfloat16() -> bool:
    """Whether oneDNN computes bfloat16 on this CPU (it needs AVX-512). Without it,
    bfloat16 matmuls of several rows are emulated, several times slower than float32's."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return True if check is None else bool(check())


def tuning_of(model: Transformer) -> CpuTuning:
    """The tuning `model` was given (the default if none), for models that run beside it."""
    return getattr(model, "cpu_tuning", None) or CpuTuning()


def _prepacked(layer: nn.Module, native: bool) -> nn.Module:
    """`layer` prepacked if it is a float `nn.Linear`: for specserve's products where `native`
    and its shape fits them, else for oneDNN's; a weight-only quantised layer
    (runtime/quantize.py) keeps its own packed kernel."""
    if not isinstance(layer, nn.Linear):
        return layer
    if native and cpu_kernels.float32_fits(layer.out_features, layer.in_features):
        return NativeLinear(layer)
    return PackedLinear(layer)


class NativeLinear(nn.Module):
    """`nn.Linear` for CPU float32 inference on specserve's own products
    (`runtime.cpu_kernels.float32_linear`), its weight packed for them.

    Measured against oneDNN's packed layer on the AMD EPYC with AVX-512, they cost less
    for passes of every row count measured, 1 to 64 (docs/DESIGN-NOTES.md), and give
    each row the same result at every row count. Passes over PACKED_CHUNK_ROWS rows (long
    prefills) take BLAS instead where `apply_cpu_tuning` measured it faster
    (`long_rows_blas`). The results differ from `nn.Linear`'s by float32 rounding only."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach()
        self.packed = cpu_kernels.float32_pack(self.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.long_rows_blas = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > PACKED_CHUNK_ROWS and self.long_rows_blas:
            return F.linear(x, self.weight, self.bias)
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_kernels.float32_linear(x.reshape(-1, self.in_features).contiguous(), self.packed)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    """`nn.Linear` for CPU float32 inference, its weight prepacked in oneDNN's blocked layout.

    CPU BLAS multiplies a few rows inefficiently; prepacked, a pass of several new tokens
    costs much less over one of a single token. For one row (plain decoding, a chain
    drafter's step), for 2-3 rows (a short draft) and for long prefills the faster path
    depends on the CPU, so `apply_cpu_tuning` measures which (`one_row_blas`,
    `short_rows_blas`, `long_rows_blas`). The results differ from `nn.Linear`'s by
    float32 rounding only; the packed path gives each row the same result at every
    row count, BLAS does not."""

    def __init__(self, linear: nn.Linear, rows: int = 16):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.one_row_blas = True
        self.short_rows_blas = False
        self.long_rows_blas = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        blas = self.one_row_blas if rows == 1 else self.short_rows_blas and rows < PAD_ROWS_TO
        if blas:
            return F.linear(x, self.weight, self.bias)
        if rows <= _EXACT_ROWS:  # a pass of a few new tokens as it is: no reshaping, padding or slicing
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if rows > PACKED_CHUNK_ROWS and self.long_rows_blas:
            return F.linear(x, self.weight, self.bias)
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= PACKED_CHUNK_ROWS:  # every verification pass: no joining copy
            out = self._packed_rows(rows)
        else:
            out = torch.cat([self._packed_rows(part) for part in rows.split(PACKED_CHUNK_ROWS)])
        return out.reshape(*x.shape[:-1], self.out_features)

    def _packed_rows(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        padded = packed_rows(n)
        if padded > n:
            rows = torch.cat((rows, rows.new_zeros(padded - n, self.in_features)))
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, self.bias, "none", [], "")
        return out[:n]


def packed_rows(n: int) -> int:
    """`n` rows rounded up to a shape a packed layer runs: exact up to _EXACT_ROWS, then to
    four significant bits (at most 1/16 padding), so few shapes cover every row count."""
    if n <= _EXACT_ROWS:
        return n
    step = 1 << (n.bit_length() - 5)
    return -(-n // step) * step


# (the layers' (kind, out, in, bias), torch threads, rows, packed rows) -> seconds of a sweep by
# (BLAS, packed), measured once a process
_path_seconds: dict[tuple, tuple[float, float]] = {}


def _blas_wins(layers: Sequence[nn.Module], rows: int, packed_rows: int, repeats: int = 5) -> bool:
    """Whether `rows` rows through all of `layers` (`PackedLinear` or `NativeLinear`) cost
    less by BLAS than `packed_rows` rows (what the packed path runs them as) by their
    packed path on this CPU.

    Timed as a forward meets the layers: a sweep calls every layer once, in order, by
    one path, so each weight comes from memory as it does in a pass. (A layer called
    again and again alone runs from the CPU's cache, which a model's weights do not
    fit: timed so, BLAS looked faster for one row on a CPU where the packed path ran the
    forward faster, docs/DESIGN-NOTES.md.) The two paths' sweeps alternate; the median
    of `repeats` each. One path for every layer: switching between the two inside a
    forward cost more than either."""
    key = (tuple((type(m).__name__, m.out_features, m.in_features, m.bias is not None) for m in layers),
           torch.get_num_threads(), rows, packed_rows)
    if key not in _path_seconds:
        blas_in = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
        packed_in = {m.in_features: torch.randn(packed_rows, m.in_features) for m in layers}

        def by_blas() -> None:
            for m in layers:
                F.linear(blas_in[m.in_features], m.weight, m.bias)

        def packed() -> None:
            for m in layers:
                m._packed(packed_in[m.in_features])

        times: tuple[list[float], list[float]] = ([], [])
        with torch.inference_mode():
            for i in range(repeats + 1):  # the first round warms up
                for path, sweep in enumerate((by_blas, packed)):
                    start = time.perf_counter()
                    sweep()
                    if i:
                        times[path].append(time.perf_counter() - start)
        _path_seconds[key] = (statistics.median(times[0]), statistics.median(times[1]))
    blas, packed_s = _path_seconds[key]
    return blas < packed_s


class PaddedShortRows(Transformer):
    """A `Transformer` whose passes of one row and 2-3 tokens on the CPU run padded to
    PAD_ROWS_TO tokens (unless `pad_short_rows` is off: its packed layers run 2-3 rows
    by BLAS); the padding leaves the cache and the logits afterwards. `apply_cpu_tuning`
    makes a loaded model one (a class of its own rather than a wrapper stored on the
    model, which would keep the model alive in a reference cycle)."""

    pad_short_rows = True

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor,
                layers: Sequence[int] | None = None, logits_from: int = 0,
                real: Sequence[int] | None = None, capture: Sequence[int] | None = None,
                capture_rows=None):
        b, t = tokens.shape
        short = self.pad_short_rows and tokens.device.type == "cpu" and b == 1 and 1 < t < PAD_ROWS_TO
        if not short or (real is not None and sum(real) != t):  # rows given packed: the model's own path
            return super().forward(tokens, positions, cache, mask, layers, logits_from, real, capture, capture_rows)
        pad = PAD_ROWS_TO - t
        tokens, positions, mask = _pad_rows(tokens, positions, mask, pad)
        # one row: a real token's flattened row is its position, padded or not (capture_rows)
        out = super().forward(tokens, positions, cache, mask, layers, logits_from, capture=capture,
                              capture_rows=capture_rows)
        cache.lengths[0] -= pad

        def unpadded(x, start=logits_from):
            return x[:, : t - start] if real is None else x[0, : t - start][: real[0]]
        if capture is None:
            return unpadded(out)
        if capture_rows is not None:
            return unpadded(out[0]), out[1]
        return unpadded(out[0]), unpadded(out[1], 0)  # the features (EAGLE): every position


def _pad_rows(tokens, positions, mask, pad):
    """Append `pad` dummy tokens that attend only to themselves."""
    b, t = tokens.shape
    tokens = torch.cat((tokens, tokens[:, -1:].expand(b, pad)), dim=1)
    positions = torch.cat((positions, positions[:, -1:].expand(b, pad)), dim=1)
    span = mask.shape[-1]
    new = torch.zeros(b, t + pad, span + pad, dtype=torch.bool, device=mask.device)
    new[:, :t, :span] = mask
    new[:, t:, span:] = torch.eye(pad, dtype=torch.bool, device=mask.device)
    return tokens, positions, new


def own_torch_threads(n: int) -> None:
    """Give the calling thread `n` torch (OpenMP) threads, whatever other threads set later.

    A thread's count is its own once torch has initialised it (the first get call does),
    and set_num_threads then changes it; threads torch meets later start from the last
    count set anywhere. A serving process gives its one compute thread several and every
    other thread one: libgomp keeps a team for each thread that ever ran a parallel region
    wider than one, and once those teams hold more threads than there are cores it stops
    spinning between regions, which made the verifier's linear layers several times slower
    (docs/DESIGN-NOTES.md)."""
    torch.get_num_threads()  # initialise this thread's count first, or torch overwrites ours at its first op
    torch.set_num_threads(n)
