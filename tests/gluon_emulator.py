"""Gluon kernels run on the CPU, op by op in torch: what CI has where Gluon has no interpreter.

A Gluon kernel's values do not depend on its layouts: layouts say which thread holds an element,
and ``convert_layout`` moves elements without changing them. So the kernel's own Python source,
run with ``gl`` bound to the torch ops below (layouts ignored, one program at a time), computes
what the compiled kernel computes: the index arithmetic, the nibble unpacking, the orders of the
head dimension and the online softmax are all checked. What it cannot see: whether the layouts
compile (``scripts/kernel_resources.py`` builds the kernel for sm_90 in CI) and the hardware's
rounding in ``exp2`` and in the order of a dot's sums (the tests' tolerances).

Only the operations the kernels in ``proxima/engine/attention/gluon_*`` use are here; another one
fails loudly (``AttributeError`` on the stand-in ``gl``). Inline assembly is emulated by its text,
for the two instructions those kernels issue.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch
from triton.experimental.gluon import language as real_gl
from triton.runtime.jit import JITFunction

_TORCH = {real_gl.float32: torch.float32, real_gl.float16: torch.float16, real_gl.bfloat16: torch.bfloat16,
          real_gl.int16: torch.int16, real_gl.int32: torch.int32, real_gl.int64: torch.int64,
          real_gl.int8: torch.int8, real_gl.uint8: torch.uint8, real_gl.int1: torch.bool}
_GLUON = {v: k for k, v in _TORCH.items()}


def _t(x: Any) -> Any:
    return x.t if isinstance(x, Value) else x


def _wrap_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns -> int32, two's complement (what a 32-bit register holds)."""
    return ((x & 0xFFFFFFFF) ^ 0x80000000).sub(0x80000000).to(torch.int32)


class Value:
    """A tensor (or scalar) of a kernel: torch underneath, Triton's ``.to`` on top."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.t.shape)

    @property
    def dtype(self):
        return _GLUON[self.t.dtype]

    def to(self, dtype, bitcast: bool = False) -> Value:
        target = _TORCH[dtype]
        return Value(self.t.view(target) if bitcast else self.t.to(target))

    def __index__(self) -> int:
        return int(self.t)

    __int__ = __index__

    def __bool__(self) -> bool:
        return bool(self.t)

    def __neg__(self) -> Value:
        return Value(-self.t)


def _binary(name: str, reverse: bool = False):
    op = getattr(torch.Tensor, f"__{name}__")

    def method(self: Value, other: Any) -> Any:
        if isinstance(other, Pointer):
            return NotImplemented
        o = _t(other)
        if reverse:
            return Value(op(torch.as_tensor(o, dtype=_scalar_dtype(o, self.t)), self.t))
        return Value(op(self.t, o))

    return method


def _scalar_dtype(o: Any, like: torch.Tensor) -> torch.dtype:
    """A Python scalar beside a tensor takes the tensor's dtype unless it is a float beside ints."""
    if isinstance(o, torch.Tensor):
        return o.dtype
    if isinstance(o, float) and not like.is_floating_point():
        return torch.float32
    return like.dtype


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "xor", "rshift", "lshift",
            "lt", "le", "gt", "ge", "eq", "ne"):
    setattr(Value, f"__{_op}__", _binary(_op))
for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "xor"):
    setattr(Value, f"__r{_op}__", _binary(_op, reverse=True))


class Pointer:
    """A pointer (or a tensor of them): a flat view of one tensor's storage and element offsets."""

    def __init__(self, base: torch.Tensor, offset: Any) -> None:
        self.base = base
        self.offset = offset  # int or Value

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Pointer:
        count = tensor.untyped_storage().nbytes() // tensor.element_size()
        return cls(torch.as_strided(tensor, (count,), (1,), 0), tensor.storage_offset())

    @property
    def dtype(self):
        return types.SimpleNamespace(element_ty=_GLUON[self.base.dtype])

    def __add__(self, other: Any) -> Pointer:
        return Pointer(self.base, self.offset + other)

    __radd__ = __add__

    def __sub__(self, other: Any) -> Pointer:
        return Pointer(self.base, self.offset - other)

    def index(self) -> torch.Tensor:
        return torch.as_tensor(_t(self.offset), dtype=torch.int64)


def _in_bounds(ptr: Pointer, index: torch.Tensor) -> None:
    """A read or write the mask lets through lands in its tensor's storage (the GPU would not say)."""
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= ptr.base.numel()):
        raise IndexError(f"a kernel access at {int(index.min())}..{int(index.max())} outside its tensor's "
                         f"{ptr.base.numel()} elements")


def _load(ptr: Pointer, mask: Any = None, other: Any = None, **_) -> Value:
    index = ptr.index()
    if mask is None:
        _in_bounds(ptr, index.reshape(-1))
        return Value(ptr.base[index])
    mask = torch.as_tensor(_t(mask))
    index, mask = torch.broadcast_tensors(index, mask)
    _in_bounds(ptr, index[mask])
    values = ptr.base[torch.where(mask, index, 0)]
    fill = torch.as_tensor(0 if other is None else _t(other), dtype=values.dtype)
    return Value(torch.where(mask, values, fill))


def _store(ptr: Pointer, value: Any, mask: Any = None, **_) -> None:
    index = ptr.index()
    value = torch.as_tensor(_t(value))
    mask = torch.ones((), dtype=torch.bool) if mask is None else torch.as_tensor(_t(mask))
    index, value, mask = torch.broadcast_tensors(index, value, mask)
    _in_bounds(ptr, index[mask])
    ptr.base[index[mask]] = value[mask].to(ptr.base.dtype)


def _expand_dims(x: Any, axis: int) -> Any:
    if isinstance(x, Pointer):
        return Pointer(x.base, _expand_dims(x.offset, axis))
    return Value(_t(x).unsqueeze(axis))


def _convert_layout(x: Any, layout: Any = None, assert_trivial: bool = False) -> Any:
    return x


def _lop3_mask_or(x: torch.Tensor, bias: int) -> torch.Tensor:
    """``lop3.b32 d, x, 0x000F000F, bias, 0xEA``: (x & 0x000F000F) | bias."""
    return (x & 0x000F000F) | bias


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    """``prmt.b32 d, a, b, sel`` (no sign modes): byte i of d is byte sel[i] of b:a (a bytes 0-3)."""
    wide = (b.to(torch.int64) & 0xFFFFFFFF) << 32 | (a.to(torch.int64) & 0xFFFFFFFF)
    out = torch.zeros_like(wide)
    for i in range(4):
        pick = (sel >> (4 * i)) & 0xF
        if pick & 8:
            raise NotImplementedError("prmt sign replication is not emulated")
        out |= ((wide >> (8 * pick)) & 0xFF) << (8 * i)
    return _wrap_int32(out)


def _inline_asm_elementwise(asm: str, constraints: str, args: list, dtype, is_pure: bool, pack: int) -> Value:
    xs = [_t(a) for a in args]
    if asm == "lop3.b32 $0, $1, 0x000F000F, $2, 0xEA;":
        return Value(_lop3_mask_or(xs[0], xs[1]))
    if asm == "prmt.b32 $0, $1, $2, $3; lop3.b32 $0, $0, 0x000F000F, $4, 0xEA;":
        return Value(_lop3_mask_or(_prmt(xs[0], xs[1], xs[2]), xs[3]))
    raise NotImplementedError(f"inline assembly not emulated: {asm!r}")


def _mma_v2(a: Value, b: Value, acc: Value, input_precision: Any = None) -> Value:
    """The products of two 16-bit values are exact in float32; the sum's order is the hardware's."""
    return Value(torch.matmul(a.t.to(torch.float32), b.t.to(torch.float32)) + acc.t)


class _Program:
    ids: tuple[int, int, int] = (0, 0, 0)


def _gl() -> types.SimpleNamespace:
    def layout(*_, **__):
        return None

    def reduce(fn):
        return lambda x, axis: Value(fn(_t(x), dim=axis))

    return types.SimpleNamespace(
        program_id=lambda axis: Value(torch.tensor(_Program.ids[axis], dtype=torch.int32)),
        load=_load, store=_store,
        arange=lambda start, end, layout=None: Value(torch.arange(start, end, dtype=torch.int32)),
        zeros=lambda shape, dtype, layout=None: Value(torch.zeros(shape, dtype=_TORCH[dtype])),
        full=lambda shape, value, dtype, layout=None: Value(torch.full(shape, value, dtype=_TORCH[dtype])),
        zeros_like=lambda x: Value(torch.zeros_like(_t(x))),
        expand_dims=_expand_dims, convert_layout=_convert_layout,
        reshape=lambda x, shape, **_: Value(_t(x).reshape(shape)),
        permute=lambda x, dims: Value(_t(x).permute(*dims)),
        join=lambda a, b: Value(torch.stack(torch.broadcast_tensors(_t(a), _t(b)), -1)),
        split=lambda x: (Value(_t(x)[..., 0]), Value(_t(x)[..., 1])),
        where=lambda c, a, b: Value(torch.where(_t(c), _t(a), _t(b))),
        maximum=lambda a, b: Value(torch.maximum(_t(a), _t(b))),
        max=reduce(torch.amax), sum=reduce(torch.sum),
        exp2=lambda x: Value(torch.exp2(_t(x))),
        cdiv=lambda a, b: (a + b - 1) // b,
        inline_asm_elementwise=_inline_asm_elementwise,
        static_range=range, constexpr=real_gl.constexpr,
        SliceLayout=layout, BlockedLayout=layout, DistributedLinearLayout=layout,
        NVMMADistributedLayout=layout, DotOperandLayout=layout,
        int64=real_gl.int64, **{name: getattr(real_gl, name)
           for name in ("float32", "float16", "bfloat16", "int1", "int8", "uint8", "int16", "int32")},
    )


_STAND_INS = {"mma_v2": _mma_v2}
_emulated: dict[int, types.FunctionType] = {}
_module_globals: dict[int, dict] = {}


def _globals_of(original: dict) -> dict:
    """A module's globals with ``gl`` and the jitted functions replaced by their emulations."""
    key = id(original)
    if key not in _module_globals:
        g = dict(original)
        _module_globals[key] = g
        fake = _gl()
        for name, value in original.items():
            if value is real_gl:
                g[name] = fake
            elif isinstance(value, JITFunction):
                g[name] = emulated(value)
            elif name in _STAND_INS:
                g[name] = _STAND_INS[name]
    return _module_globals[key]


def emulated(fn: JITFunction) -> types.FunctionType:
    """The jitted function's Python source, bound to the stand-in ``gl``: callable on Values."""
    if id(fn) not in _emulated:
        raw = fn.fn
        _emulated[id(fn)] = types.FunctionType(raw.__code__, _globals_of(raw.__globals__), raw.__name__,
                                                raw.__defaults__, raw.__closure__)
    return _emulated[id(fn)]


def launch(kernel: JITFunction, grid: tuple[int, ...], args: tuple) -> None:
    """``kernel[grid](*args)``, program after program: tensors become pointers into their storage."""
    body = emulated(kernel)
    bound = tuple(Pointer.of(a) if isinstance(a, torch.Tensor) else a for a in args)
    for ids in itertools.product(*(range(n) for n in (*grid, 1, 1)[:3])):
        _Program.ids = ids
        body(*bound)


class EmulatedLaunch:
    """Stands in for ``kernel_launch.CompiledLaunch`` of a Gluon kernel: ``(grid, args, key, **options)``."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self.launches = 0

    def __call__(self, grid: tuple[int, int, int], args, key=None, **options) -> None:
        self.launches += 1
        launch(self.kernel, grid, tuple(args))
