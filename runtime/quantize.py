"""Weight-only int8 and int4 linear layers, and `quantize(model, mode)` that installs them.

Only the weights are low-precision; the KV cache and every non-linear op stay in the model's
float dtype (`Transformer.dtype`, the embedding's), and so do the activations between the
layers (specserve's products quantise a layer's input to 8 bits per block of 32 inside the
product, unless `CpuTuning.int_activations` is "float32"). The weights:

- int8: per-output-channel symmetric int8;
- int4: groupwise asymmetric 4-bit, w = d * q + m with q in 0..15 and one (d, m) per
  `group` inputs of a row: GGUF's Q4_1 blocks. `Int4Linear.from_blocks` takes a 4-bit
  GGUF's blocks as they are (runtime/gguf_blocks.py reads them; Q4_0's w = d*(q - 8)
  is m = -8d); `quantize_int4` quantises any other float weight.

`quantized_weights` gives a model's weights in either form before any kernel packs them,
which is how a tensor-parallel rank takes its slice of the very weights one process would
use (runtime/tp.py, `shard_weights`).

On an x86 CPU with AVX2 or AVX-512 the products are specserve's own
(runtime/cpu_kernels.py; `quantize`'s `tuning.kernels` picks): by default each row's input
quantised to 8 bits per block of 32 (a Q8_0 block, a scale of its own) and multiplied by the
weight codes with integer dot products (q8_kernels.cpp), or with `tuning.int_activations`
"float32" the float32 activations as they are by the weights exactly d * q + m. Elsewhere
they are PyTorch's weight-packed kernels on bfloat16 activations: `_weight_int8pack_mm`, and
for int4 `_weight_int4pack_mm_for_cpu` on a CPU, `_weight_int4pack_mm` on CUDA, in torch's
int4 format w = (q - 8) * scale + zero (scale = d, zero = m + 8d).

Every kernel gives each row of the input the same result whatever the number of rows
(tests/test_precision.py checks it): verifying a tree rounds like decoding one token.
Passes longer than PACKED_CHUNK_ROWS rows (long prefills) multiply by the weights
dequantised to float32 through BLAS instead, on the float32 activations, like float32's
long passes (runtime/cpu_tuning.py): several times faster there, not row-exact, which a
prefill does not need.
CPU bfloat16 `nn.Linear` does so only up to BF16_EXACT_ROWS rows (oneDNN switches kernels
above), so a bfloat16 model's layers run longer passes in slices of that many
(`RowSlicedLinear`, installed by `quantize(model, "bfloat16")`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .cpu_tuning import PACKED_CHUNK_ROWS, CpuTuning, NativeRMSNorm, native_attention, native_norms, tuning_of
from .model import Transformer

MODES = ("int8", "int4")  # weight-only quantised
BF16_EXACT_ROWS = 32  # CPU bfloat16 linear: the most rows whose results match one row's (measured)
LINEAR_PARTS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # a layer's linear layers
# torch's packed kernels compute in bfloat16 (10-30x faster than on float32 on a CPU; CUDA's int4
# takes nothing else); the model around them stays in its float dtype, where one row scored
# alone or beside others gives the same tokens, as in float32 (docs/DESIGN-NOTES.md, Precision)
KERNEL_DTYPE = torch.bfloat16
INT4_GROUP = 32  # GGUF's block size, so a 4-bit GGUF's blocks need no regrouping
_CPU_INNER_K_TILES = 2  # the CPU packer's tiling (any of 2, 4, 8 computes the same)


def cuda_inner_k_tiles(in_features: int) -> int:
    """The CUDA packer's tiling: the widest of 8, 4, 2 tiles of 16 inputs that divides the
    row (the default model's 576 inputs take 4; any multiple of the group of 32 takes 2)."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def _activations(activations: str) -> str:
    if activations not in cpu_kernels.ACTIVATIONS:
        raise ValueError(f"int activations must be one of {', '.join(cpu_kernels.ACTIVATIONS)}, got {activations!r}")
    return activations


def _native(device: torch.device, in_features: int, native: bool | None) -> bool:
    """Whether a layer on `device` takes specserve's own CPU products (runtime/cpu_kernels.py):
    `native` where they fit, None for `cpu_kernels.preferred`'s default."""
    if device.type != "cpu" or not cpu_kernels.fits(in_features):
        return False
    return cpu_kernels.preferred() if native is None else native and cpu_kernels.available()


def _native_forward(layer: nn.Module, x: torch.Tensor, product) -> torch.Tensor:
    """A native int layer's pass: `product` of float32 rows (row-exact), or for passes of over
    PACKED_CHUNK_ROWS rows (prefills) the dequantised weights by BLAS, unless the layer's
    `long_rows_blas` is off."""
    rows = x.reshape(-1, layer.in_features).float().contiguous()
    if rows.shape[0] > PACKED_CHUNK_ROWS and layer.long_rows_blas:
        y = F.linear(rows, layer.dequantized(), layer.bias)
    else:
        y = product(rows)
        y = y if layer.bias is None else y + layer.bias
    return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights, one scale per output channel (gpt-fast's
    WeightOnlyInt8Linear) or, native only, one per group of 32 inputs (GGUF's Q8_0
    blocks, `scales` [out, in/32]). Scales in float32 for the native CPU product, else in
    the activation dtype torch's kernel wants.

    The native product multiplies by the activations quantised to 8 bits per block of 32
    (`activations` "int8", integer dot products: `weight` and `scales` then in
    `cpu_kernels.int8_pack`'s tiles), or by them in float32 as they are ("float32")."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 native: bool | None = None, activations: str = "int8"):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.native = _native(weight.device, self.in_features, native) and scales.dtype == torch.float32
        self.long_rows_blas = True  # native: passes of over PACKED_CHUNK_ROWS rows by BLAS (`quantize`)
        if scales.dim() == 2 and not self.native:
            raise ValueError("int8 with a scale per group of inputs needs the native CPU product")
        self.grouped = scales.dim() == 2
        self.activations = _activations(activations) if self.native else None
        if self.activations == "int8":
            weight, scales = cpu_kernels.int8_pack(weight, scales)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    def from_weights(cls, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     bias: torch.Tensor | None = None, native: bool | None = None,
                     activations: str = "int8") -> "Int8Linear":
        """From `quantize_int8`'s (q, scales); `dtype` is torch's kernel's activation dtype,
        where the native product does not run."""
        native = _native(q.device, q.shape[1], native)
        if not native:
            scales = scales.to(dtype)
        bias = None if bias is None else bias.detach().to(scales.dtype)
        return cls(q, scales, bias, native, activations)

    @classmethod
    def quantized(cls, linear: nn.Linear, dtype: torch.dtype, native: bool | None = None,
                  activations: str = "int8") -> "Int8Linear":
        """`linear` quantised (`quantize_int8`)."""
        return cls.from_weights(*quantize_int8(linear.weight.detach().float()), dtype, linear.bias, native,
                                activations)

    def quantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [out, in] int8, scales [out] or [out, in/32]) as given, whatever the layout kept."""
        if self.activations == "int8":
            return cpu_kernels.int8_unpack(self.weight, self.scales, self.out_features)
        return self.weight, self.scales

    def dequantized(self) -> torch.Tensor:
        q, scales = self.quantized_weights()
        if self.grouped:
            return (q.float().unflatten(1, (-1, cpu_kernels.GROUP)) * scales[..., None]).flatten(1)
        return q.float() * scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "int8":
            return _native_forward(self, x, lambda rows: cpu_kernels.int8_linear_q8(rows, self.weight, self.scales,
                                                                                   self.out_features))
        if self.native:
            return _native_forward(self, x, lambda rows: cpu_kernels.int8_linear(rows, self.weight, self.scales))
        flat = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()
        y = torch._weight_int8pack_mm(flat, self.weight, self.scales).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """`nn.Linear` with groupwise 4-bit weights, w = d * q + m: on the native CPU product
    in `cpu_kernels.int4_pack`'s tiles, multiplied by the activations quantised to 8 bits per
    block of 32 (`activations` "int8", integer dot products), or as Q4_1 blocks
    (`cpu_kernels.to_blocks`) by the activations in float32 as they are ("float32"); else in
    torch's packed int4 layout (gpt-fast's WeightOnlyInt4Linear) with `scales_and_zeros`
    [in/group, out, 2] in the activation dtype `dtype`."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype,
                 bias: torch.Tensor | None = None, group: int = INT4_GROUP, native: bool | None = None,
                 activations: str = "int8"):
        """`q` [out, in] integers 0..15; `d`, `m` [out, in/group] float32; all on the target
        device. `native`: take specserve's own CPU product (None: `cpu_kernels.preferred()`),
        on `activations` (`cpu_kernels.ACTIVATIONS`)."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % group:
            raise ValueError(f"int4: in_features {self.in_features} is not a multiple of the group size {group}")
        self.group = group
        self.on_cuda = q.device.type == "cuda"
        self.native = group == cpu_kernels.GROUP and _native(q.device, self.in_features, native)
        self.long_rows_blas = True  # native: passes of over PACKED_CHUNK_ROWS rows by BLAS (`quantize`)
        if self.on_cuda and dtype != torch.bfloat16:
            raise ValueError(f"int4 on CUDA computes in bfloat16 only, not {dtype}")
        self.activations = _activations(activations) if self.native else None
        if self.native:
            self.register_buffer("weight", cpu_kernels.int4_pack(q, d, m) if self.activations == "int8"
                                 else cpu_kernels.to_blocks(q, d, m))
            self.register_buffer("bias", None if bias is None else bias.float())
            return
        if self.on_cuda:  # the CUDA packer takes two 4-bit values a byte, the even one high
            q = q.to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(),
                                                                cuda_inner_k_tiles(self.in_features))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(),
                                                                        _CPU_INNER_K_TILES)
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", torch.stack((d.t(), (m + 8 * d).t()), dim=-1).to(dtype).contiguous())
        self.register_buffer("bias", bias)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None = None, native: bool | None = None,
                    activations: str = "int8") -> "Int4Linear":
        """From GGUF 4-bit blocks of 32 (w = d*q + m): `q` [out, in] in 0..15, `d` and `m`
        [out, in/32] in float32 (widened from the blocks' float16; Q4_0 is m = -8d)."""
        return cls(q, d, m, dtype, bias, group=32, native=native, activations=activations)

    @classmethod
    def quantized(cls, linear: nn.Linear, dtype: torch.dtype, group: int = INT4_GROUP,
                  native: bool | None = None, activations: str = "int8") -> "Int4Linear":
        """`linear` quantised groupwise, each group's min..max spread over 0..15 (`quantize_int4`)."""
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(*quantize_int4(linear.weight.detach().float(), group), dtype, bias, group, native, activations)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] as the kernel computes it, in float32 (torch's: an identity pass)."""
        if self.activations == "int8":
            return cpu_kernels.int4_dequantize(cpu_kernels.to_blocks(*cpu_kernels.int4_unpack(self.weight,
                                                                                              self.out_features)))
        if self.native:
            return cpu_kernels.int4_dequantize(self.weight)
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype, device=self.weight.device)
        return self._matmul(eye).t().float()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.weight, self.group, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, self.group, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "int8":
            return _native_forward(self, x, lambda rows: cpu_kernels.int4_linear_q8(rows, self.weight,
                                                                                   self.out_features))
        if self.native:
            return _native_forward(self, x, lambda rows: cpu_kernels.int4_linear(rows, self.weight))
        flat = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype).contiguous()
        y = self._matmul(flat).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class RowSlicedLinear(nn.Module):
    """A bfloat16 `nn.Linear` run BF16_EXACT_ROWS rows at a time, so that each row's result
    is the one it gets alone (a pass of up to that many rows runs as one call). One row runs
    as two (itself twice): on a CPU with AVX512-BF16 oneDNN's one-row kernel sums unlike its
    several-row one (a 576x1536 layer on an AMD EPYC, Zen 4), its two-row one like them."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.cat([self._slice(part) for part in rows.split(BF16_EXACT_ROWS)]) \
            if rows.shape[0] > BF16_EXACT_ROWS else self._slice(rows)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _slice(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 1:
            return self.linear(rows.expand(2, -1).contiguous())[:1]
        return self.linear(rows)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of float weight `w` [out, in]: each row scaled so that its largest |w|
    maps to 127, w ~ scales[:, None] * q."""
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
    return torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8), scales


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, m) of float weight `w` [out, in], asymmetric per group of `group` inputs,
    w ~ d * q + m: m = the group's min, d = (max - min) / 15, q = round((w - m) / d)."""
    out, inp = w.shape
    groups = w.reshape(out, inp // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-10)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).reshape(out, inp)
    return q.to(torch.int32), scales, low


def quantized_weights(model, mode: str, int4_blocks: dict[str, tuple] | None = None) -> dict[str, tuple]:
    """Every decoder layer's linear weights of float `model` in weight-only `mode`, by layer
    name ("layers.3.attn.qkv"), before any kernel packs them: int8 `quantize_int8`'s
    (q, scales), int4 (q, d, m), a 4-bit GGUF's blocks where `int4_blocks` has them (moved to
    the model's device), else `quantize_int4`'s; and `int4_blocks`' "lm_head", if any."""
    if mode not in MODES:
        raise ValueError(f"quantized_weights: mode must be one of {', '.join(MODES)}, got {mode!r}")
    blocks = int4_blocks or {}
    weights = {}
    for i, layer in enumerate(model.layers):
        for part in LINEAR_PARTS:
            name, w = f"layers.{i}.{part}", layer.get_submodule(part).weight.detach().float()
            if mode == "int8":
                weights[name] = quantize_int8(w)
            elif name in blocks:
                weights[name] = tuple(t.to(w.device) for t in blocks[name])
            else:
                weights[name] = quantize_int4(w)
    if "lm_head" in blocks:
        weights["lm_head"] = blocks["lm_head"]
    return weights


def quantize(model, mode: str, weights: dict[str, tuple] | None = None, tuning: CpuTuning = CpuTuning(),
             cache_dir: str | os.PathLike | None = None):
    """Make `model`'s linear layers weight-only `mode` ("int8" or "int4"), in place
("bfloat16": slice a CPU bfloat16 model's passes to BF16_EXACT_ROWS rows, `RowSlicedLinear`,
    and attend in float64 on any device).

    Every layer's q/k/v, o, gate/up and down become `mode`. The LM head becomes int8 in
    both modes and is untied from the embedding, which stays in the float dtype for
    lookups: it is the largest matrix (vocab x hidden), a Q8_0 in the shipped GGUF, and
    4 bits there cost more accuracy than anywhere else (docs/DESIGN-NOTES.md, Precision).
    A model without a head (a tensor-parallel rank other than 0, runtime/tp.py) gets none.
    `weights` maps a layer's name to its weights in `quantized_weights`' form (a 4-bit GGUF's
    blocks, or a tensor-parallel rank's slice of the whole model's); a layer it leaves out is
    quantised from its float weights.
    Its "lm_head", (q, d) of a Q8_0 head, makes the int8 head those blocks as they are where
    the native CPU product runs (torch's int8 kernel takes one scale per channel only); there
    a float32 model's norms run on it too (`NativeRMSNorm`), and its short passes' attention
    (`Attention.fused_attention` for one sequence, `Attention.rows_attention` for several).
    `tuning.kernels`: who multiplies on a CPU (`runtime.cpu_kernels.preferred`, built
    under `cache_dir`); `tuning.long_rows` "packed" keeps passes of over PACKED_CHUNK_ROWS
    rows on specserve's products (row-exact, slower) instead of BLAS.
    """
    has_head = isinstance(model.lm_head, nn.Linear)
    if mode == "bfloat16":  # no quantisation: row-exact slicing of the CPU bfloat16 layers
        if model.device.type == "cpu":
            for layer in model.layers:
                for part in LINEAR_PARTS:
                    owner_name, attr = part.split(".")
                    owner = layer.get_submodule(owner_name)
                    setattr(owner, attr, RowSlicedLinear(getattr(owner, attr)))
            if has_head:
                model.lm_head = RowSlicedLinear(model.lm_head)
        # bfloat16 attention over several queries rounds unlike one query, on CPUs without
        # AVX-512 and on CUDA (scripts/gpu_check.py): attend in float64, as the int modes do
        model.attention_dtype = torch.float64
        return model
    if mode not in MODES:
        raise ValueError(f"quantize: mode must be one of bfloat16, {', '.join(MODES)}, got {mode!r}")
    dtype = KERNEL_DTYPE
    weights = weights or {}
    native = model.device.type == "cpu" and cpu_kernels.preferred(tuning.kernels, cache_dir, tuning.compiler)
    activations = tuning.int_activations
    if native:
        cpu_kernels.use_amx(tuning.amx)  # the library's, for the whole process
    for i, layer in enumerate(model.layers):
        for part in LINEAR_PARTS:
            owner_name, attr = part.split(".")
            owner, name = layer.get_submodule(owner_name), f"layers.{i}.{part}"
            linear = getattr(owner, attr)
            given = weights.get(name)
            if given is None:
                w = linear.weight.detach().float()
                given = quantize_int8(w) if mode == "int8" else quantize_int4(w)
            given = tuple(t.to(linear.weight.device) for t in given)
            bias = None if linear.bias is None else linear.bias.detach()
            setattr(owner, attr, Int8Linear.from_weights(*given, dtype, bias, native, activations) if mode == "int8"
                    else Int4Linear(*given, dtype, bias, native=native, activations=activations))
    head = weights.get("lm_head")
    if has_head and head is not None and _native(model.device, model.lm_head.in_features, native):
        model.lm_head = Int8Linear(*(t.to(model.device) for t in head), native=True, activations=activations)
    elif has_head:
        model.lm_head = Int8Linear.quantized(model.lm_head, dtype, native, activations)
    for m in model.modules():
        if isinstance(m, (Int4Linear, Int8Linear)):
            m.long_rows_blas = tuning.long_rows != "packed"
    model.precision = mode
    model.attention_dtype = torch.float64  # so a verified token rounds as it does alone (model.py)
    if native and model.dtype == torch.float32 and native_norms(model):
        for layer in model.layers:
            if cpu_kernels.attends(model.config.head_dim):
                layer.attn.fused_attention = cpu_kernels.attend
        native_attention(model)
    return model


def quantized_copy(model, mode: str = "int4"):
    """A weight-only `mode` twin of a float `model`, to draft with (the `self-int4` drafter):
    its linear layers quantised from `model`'s, whatever wraps them (CPU-prepacked or not);
    its embedding, norms and rotary tables shared with `model`, which stays as it is.

    It attends in the float dtype: the float64 attention `quantize` sets makes a token
    verified beside others round as it does alone, which a draft does not need."""
    if getattr(model, "precision", None) in MODES:
        raise ValueError(f"its linear layers are {model.precision} already")
    with torch.device("meta"):
        twin = Transformer(model.config)
    linears = [(name, m) for name, m in twin.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in linears:
        if mode == "int4" and name != "lm_head" and linear.in_features % INT4_GROUP:  # the head goes int8
            raise ValueError(f"{name} takes {linear.in_features} inputs, not a multiple of int4's group of "
                             f"{INT4_GROUP}")
    tensors = {}
    for name, linear in linears:
        source = model.get_submodule(name)
        tensors[f"{name}.weight"] = source.weight
        if linear.bias is not None:
            tensors[f"{name}.bias"] = source.bias
    for name, _ in twin.named_parameters():  # the embedding and the norms
        owner, _, attr = name.rpartition(".")
        tensors.setdefault(name, getattr(model.get_submodule(owner), attr))
    twin.load_state_dict(tensors, assign=True)
    twin.rope_cos, twin.rope_sin = model.rope_cos, model.rope_sin
    quantize(twin, mode, tuning=tuning_of(model))
    twin.attention_dtype = twin.cache_dtype = None
    for layer in twin.layers:  # installed for float64 attention
        layer.attn.fused_attention = layer.attn.rows_attention = None
    if any(isinstance(m, NativeRMSNorm) for m in twin.modules()):  # where specserve's kernels run
        native_attention(twin)
    return twin.requires_grad_(False).eval()
