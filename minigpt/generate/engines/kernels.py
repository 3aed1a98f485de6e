"""The NumPy engine's one-token steps and short prefills as compiled kernels (numba): the whole model in
one call.

What a step computes. `model_step` takes new tokens, one a row for a decoding step (a batch of samples, a
server's clients) or a row's tokens at consecutive positions for a prefill, and returns their logits: the
embeddings, every block, the final norm and the LM head. Each block (`_block_step`) runs its norms, the
fused Q/K/V product, QK-norm and rotary positions, the write of the new keys and values into the cache,
attention over the cache, the output projection and the MLP. A cached step reads every weight once and
does little else, so it is bound by how fast the weights stream from memory; through NumPy it would be a
few hundred library calls, each a Python call that streams nothing and starts from caches the weights
have just flushed. Here it is one call.

Matrix products. Each reads its matrix's weights once for all the step's rows, so a batch costs little
more than one row. A weight is held in one of four layouts (`form`):
  - bands (`BANDS`): where every width of the model is a multiple of LANES, the blocks' float32 matrices
    are held as bands of LANES consecutive outputs, input-major within each band (`numpy_engine.banded`,
    made at load; the file is unchanged). Each input's LANES weights are one 64-byte load, multiplied into
    every row's LANES sums at once (`_band_sums`, written in LLVM's vector types): a vector's lanes are
    outputs, so no sum across lanes is left at the end. Bands are split between threads.
  - int8 bands (`QBANDS`, `--quantize int8`): every block's matrices and the LM head as int8 with one
    float32 scale an output, held as bands whose groups of four inputs are 64 bytes
    (`numpy_engine.quantized_bands`, padded to whole bands and blocks, so any width). Each product's
    activations are rounded to int8 too, in blocks of QBLOCK inputs with a scale each (`_quantize`, as
    llama.cpp's q8_0 does), so that a group is one byte dot-product instruction per row (AVX-512 VNNI,
    AVX-VNNI; elsewhere portable integer sums, the same numbers): a weight costs a byte and a sixteenth of
    an instruction, where converting each weight to float32 leaves the CPU, not the memory, setting the
    pace of a step.
  - rows (`ROWS`): other float32 models, and the LM head (the tied embedding table), keep the file's
    (out, in) rows, each a contiguous dot product that LLVM vectorises, four rows of the batch a pass so
    that each weight loaded serves four products.
  - tiles (`TILES`): for batches of four rows or more and weight rows long enough (`tiled`; which lengths
    gain depends on the CPU, so the engine measures it), four weight rows a quarter of the matrix apart by
    four rows of the batch (`_tile`), each value loaded used four times.

Prefetching. The float32 band products may ask for weights ahead of the ones they multiply (`_prefetch`),
so that memory stays busy while the sums run; whether that pays at each batch width, and how far ahead,
depends on the CPU's caches and memory, so the distances are values of the call (`PREFETCHES`) and the
engine times them on the user's machine.

Element-wise work. The exps of GELU, SwiGLU and the softmax are a polynomial the vectoriser keeps in
vector registers (`_exp`) rather than a library call per element. A float16 KV cache (`--kv-cache
float16`, handed over as its bits: numba has no float16 on the CPU) halves the bytes attention reads,
widened in registers.

The kernels compute what `minigpt.generate.engines.numpy_engine`'s functions compute, in float32, with
sums in whatever order the vectoriser picks (`reassoc`): the parity table holds them to GPT.forward
within the same rounding bound as the NumPy path. They cover every option of the NumPy engine except the
`general` and `additive` attention scores, which stay on its array path (`supported`). numba compiles them
for each set of argument types a call brings (`entries`: the weights' and the KV cache's types) and keeps
the machine code beside this file (or under NUMBA_CACHE_DIR), so later runs load them instead of compiling
again; compiling takes tens of seconds, which `minigpt.generate.engines.compiling` has another process do
while the engine decodes on its array path. numba is optional at import: without it (`available()` False)
the engine runs its array path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from minigpt.model.weights import BlockWeights, LinearWeights, ModelWeights

__all__ = [
    "ACTIVATIONS",
    "LANES",
    "ModelArgs",
    "PREFETCHES",
    "VERSION",
    "available",
    "cache_folder",
    "caches",
    "compile_entries",
    "draw",
    "entries",
    "get_threads",
    "matvec",
    "missing",
    "model_args",
    "model_step",
    "out_features",
    "set_threads",
    "supported",
    "tiled",
]

try:  # numba is a dependency, but a platform without its wheels still decodes (on the array path)
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.core.extending import intrinsic
    from numba.core.typing.typeof import Purpose
except ImportError:  # pragma: no cover - exercised only where numba cannot be installed
    numba = None

VERSION = "" if numba is None else numba.__version__  # measured choices are kept per version (`tuning`)

ACTIVATIONS = {"gelu": 0, "relu2": 1, "swiglu": 2}
# how a product reads its weight (`_linear`): output-major rows (`_rows`), four rows a quarter of the
# matrix apart (`_tile`), bands of LANES outputs (`_bands`), or int8 bands (`_qbands`)
ROWS, TILES, BANDS, QBANDS = 0, 1, 2, 3
LANES = 16  # a band's outputs: 64 bytes of float32 weights for each input, one cache line
QBLOCK = 32  # the inputs of an int8 product that share an activation scale (`_quantize`), as in q8_0
# the values a row-by-row loop (a batch's draw, its rounding to int8) needs before it runs on every thread:
# waking the threads costs a few microseconds, as much as a few thousand values' work
SPREAD_FROM = 1 << 14
# how far ahead of a band's weights `_band_sums` may ask for them, in bytes (`_prefetch`): the near line
# into every cache level, the far one into L2 only (0: none); "none" asks for nothing. Which pays depends
# on the CPU's caches and memory and on the batch's rows, so the engine times these on the user's machine
# (`NumpyEngine._pick_prefetch`)
PREFETCHES = {
    "none": (0, 0), "2k": (2048, 0), "1k/8k": (1024, 8192), "2k/16k": (2048, 16384), "4k/32k": (4096, 32768)
}  # fmt: skip
_EMPTY = np.zeros(0, dtype=np.float32)
_EMPTY_ROWS = np.zeros((0, 0), dtype=np.float32)
_EMPTY_BYTES = np.zeros(0, dtype=np.uint8)
# 1/12!, 1/11!, ... 1/1!, 1/0!: `_exp_weight`'s Taylor series after its 1/13!, highest power first
_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(12, -1, -1))
# `model_args`' table of where a step's tensors lie: the model's slots (the token and position embeddings,
# the U-net skips' weights, the final norm's weight and bias, the head's weight, scales and bias), then
# `_LAYER` for each block (its norms' weights and biases, QK-norm's two weights, the value embeddings,
# then the QKV, output, up and down products' weights, scales and biases, `_QKV` ... `_DOWN`)
_WTE, _WPE, _SKIPS, _LNF, _HEAD, _GLOBALS = 0, 1, 2, 3, 5, 8
_QK, _VE, _QKV, _PROJ, _FC, _DOWN, _LAYER = 4, 6, 7, 10, 13, 16, 19
# sums may be reordered (vectorised) and multiply-adds fused; no assumption about inf or NaN: GELU's exp
# overflows to inf on purpose (x / inf = 0), as on the array path
_FAST = {"reassoc", "contract", "nsz"}


def _can_cache() -> bool:
    """Whether numba has somewhere to keep compiled code for this module (its __pycache__, or a user-wide
    cache directory): where neither is writable, it refuses `cache=True` outright, and the kernels are
    compiled in each process instead."""
    if numba is None:
        return False
    try:
        numba.njit(cache=True)(_can_cache)
    except RuntimeError:
        return False
    return True


_CACHE = _can_cache()


@functools.cache
def available() -> bool:
    """Whether the kernels can run here: numba imports and its threads start on OpenMP or TBB. Its last
    resort, the `workqueue` layer, starts each parallel loop far more slowly than those two, and a step
    starts dozens of them: the array path is the better choice there."""
    if numba is None:
        return False
    from numba.np.ufunc import parallel

    try:  # start the thread pool now: numba names its layer only once it has one
        parallel._launch_threads()
        return numba.threading_layer() in ("omp", "tbb")
    except Exception:  # a numba whose internals moved, or no layer at all: the array path
        return False


def get_threads() -> int:
    """The kernels' thread count."""
    return numba.get_num_threads() if numba is not None else 1


def set_threads(n: int) -> None:
    """The kernels' thread count (at most the cores numba started with)."""
    if numba is not None:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def supported(block: BlockWeights[np.ndarray]) -> bool:
    """Whether `_block_step` computes this block (output-major float32 weights, a dot-product score)."""
    lins = (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
    return (
        block.attn.score in ("scaled", "dot")
        and block.mlp.c_gate is None
        and (block.mlp.activation != "swiglu" or block.mlp.fused_gate)
        and all(not lin.input_major and lin.lora is None for lin in lins)
    )


if numba is not None:

    @intrinsic
    def _float_from_bits(typingctx: Any, bits: Any) -> Any:
        """The float32 whose IEEE-754 bits are the low 32 of the integer `bits` (a register move, which
        the vectoriser keeps in vector registers, where `math.ldexp` is a library call per element)."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            v = args[0]
            if v.type.width != 32:
                v = builder.trunc(v, ir.IntType(32))
            return builder.bitcast(v, context.get_value_type(types.float32))

        return types.float32(bits), codegen

    @intrinsic
    def _double_from_bits(typingctx: Any, bits: Any) -> Any:
        """The float64 whose IEEE-754 bits are the 64-bit integer `bits` (`_float_from_bits`' twin)."""
        if not (isinstance(bits, types.Integer) and bits.bitwidth == 64):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.DoubleType())

        return types.float64(bits), codegen

    @intrinsic
    def _widen(typingctx: Any, v: Any) -> Any:
        """A cached key or value as float32: a float16's bits (a uint16, as a float16 KV cache is handed
        to the kernels: numba has no float16 on the CPU) converted by LLVM's fpext, which vectorises to the
        CPU's half-to-float instruction (F16C, AVX-512, NEON); a float32 as it is."""
        if isinstance(v, types.Integer) and v.bitwidth == 16:

            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

            return types.float32(v), codegen
        if v == types.float32:
            return types.float32(v), lambda context, builder, signature, args: args[0]
        return None

    @intrinsic
    def _narrow(typingctx: Any, x: Any, like: Any) -> Any:
        """The float32 x as an element of the array `like` stores: a float16's bits (LLVM's fptrunc, round
        to nearest even, as NumPy's astype) or x itself."""
        if not (x == types.float32 and isinstance(like, types.Array)):
            return None
        if like.dtype == types.uint16:

            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

            return types.uint16(x, like), codegen
        if like.dtype == types.float32:
            return types.float32(x, like), lambda context, builder, signature, args: args[0]
        return None

    @intrinsic
    def _largest(typingctx: Any, like: Any) -> Any:
        """The largest finite float32 an element of the array `like` holds (float16: 65,504), as a
        constant; a float32 array: infinity (nothing to clamp)."""
        if not isinstance(like, types.Array) or like.dtype not in (types.uint16, types.float32):
            return None
        top = 65504.0 if like.dtype == types.uint16 else math.inf

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return context.get_constant(types.float32, top)

        return types.float32(like), codegen

    @njit(fastmath=_FAST, cache=_CACHE, inline="always")
    def _exp(x: Any) -> Any:
        """exp of a float32 in float32 arithmetic that LLVM vectorises: without Intel's SVML numba calls
        libm's expf once per element, a call the vectoriser cannot see through. x = k ln2 + r with
        |r| <= ln2/2 (ln2 in two parts, so k ln2 is exact), e^r by Cephes' expf polynomial, 2^k put into
        the exponent bits: within 3 units in the last place of the exact value (NumPy's float32 exp: 2).
        Below -87.3 it is 0; above 88.3 (where e^x nears float32's largest) it stays at e^88.3: GELU's
        x / (1 + e^u) is then within 1e-37 |x| of infinity's 0."""
        f = np.float32
        under = x < f(-87.3)
        x = min(max(x, f(-87.3)), f(88.3))
        k = np.floor(x * f(1.44269504088896341) + f(0.5))
        r = x - k * f(0.693359375) - k * f(-2.12194440e-4)
        p = f(1.9875691500e-4)
        p = p * r + f(1.3981999507e-3)
        p = p * r + f(8.3334519073e-3)
        p = p * r + f(4.1665795894e-2)
        p = p * r + f(1.6666665459e-1)
        p = p * r + f(5.0000001201e-1)
        y = (p * r * r + r + f(1.0)) * _float_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))
        return f(0.0) if under else y

    @njit(fastmath=_FAST, cache=_CACHE)
    def _rows(w: Any, x: Any, bias: Any, out: Any, start: int, end: int) -> None:
        """out[b, r] = w[r] . x[b] + bias[r] for r in start..end-1 and every row b: each weight row read
        once for all the rows of x, four rows of x a pass (one load of w for four products)."""
        rows, n_in = x.shape
        for r in range(start, end):
            wr = w[r]
            add = bias[r] if bias.size else np.float32(0.0)
            b = 0
            while b + 4 <= rows:
                x0, x1, x2, x3 = x[b], x[b + 1], x[b + 2], x[b + 3]
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for i in range(n_in):
                    wi = wr[i]
                    s0 += wi * x0[i]
                    s1 += wi * x1[i]
                    s2 += wi * x2[i]
                    s3 += wi * x3[i]
                out[b, r], out[b + 1, r] = s0 + add, s1 + add
                out[b + 2, r], out[b + 3, r] = s2 + add, s3 + add
                b += 4
            for rest in range(b, rows):
                xb = x[rest]
                s = np.float32(0.0)
                for i in range(n_in):
                    s += wr[i] * xb[i]
                out[rest, r] = s + add

    @njit(fastmath=_FAST, cache=_CACHE)
    def _column(out: Any, b: int, r: int, sums: Any, bias: Any) -> None:
        """out[b..b+3, r] = the four sums of weight row r, biased."""
        add = bias[r] if bias.size else np.float32(0.0)
        for k in range(4):
            out[b + k, r] = sums[k] + add

    @njit(fastmath=_FAST, cache=_CACHE)
    def _tile(w: Any, x: Any, bias: Any, out: Any, r: int, apart: int) -> None:
        """`_rows` for weight rows r, r + apart, r + 2 apart and r + 3 apart and four or more rows of x,
        four rows of x a pass: sixteen sums, each value loaded used four times (`_rows`: a weight used
        four times, each x value once). A batch's last rows that do not fill four are done as part of
        its last four (those rows computed twice, the same values written again)."""
        rows, n_in = x.shape
        w0, w1, w2, w3 = w[r], w[r + apart], w[r + 2 * apart], w[r + 3 * apart]
        b = 0
        while b < rows:
            b = min(b, rows - 4)
            x0, x1, x2, x3 = x[b], x[b + 1], x[b + 2], x[b + 3]
            a0 = a1 = a2 = a3 = c0 = c1 = c2 = c3 = np.float32(0.0)
            d0 = d1 = d2 = d3 = e0 = e1 = e2 = e3 = np.float32(0.0)
            for i in range(n_in):
                p, q, u, v = w0[i], w1[i], w2[i], w3[i]
                y0, y1, y2, y3 = x0[i], x1[i], x2[i], x3[i]
                a0, a1, a2, a3 = a0 + p * y0, a1 + p * y1, a2 + p * y2, a3 + p * y3
                c0, c1, c2, c3 = c0 + q * y0, c1 + q * y1, c2 + q * y2, c3 + q * y3
                d0, d1, d2, d3 = d0 + u * y0, d1 + u * y1, d2 + u * y2, d3 + u * y3
                e0, e1, e2, e3 = e0 + v * y0, e1 + v * y1, e2 + v * y2, e3 + v * y3
            _column(out, b, r, (a0, a1, a2, a3), bias)
            _column(out, b, r + apart, (c0, c1, c2, c3), bias)
            _column(out, b, r + 2 * apart, (d0, d1, d2, d3), bias)
            _column(out, b, r + 3 * apart, (e0, e1, e2, e3), bias)
            b += 4

    @njit(fastmath=_FAST, cache=_CACHE, parallel=True)
    def _matvec(w: Any, x: Any, bias: Any, out: Any, tiled: bool) -> None:
        """out[b] = w x[b] + bias for every row b, w (n_out, n_in) float32. By `_rows`, 16 output rows a
        task; or where `tiled` and x has four rows or more, by `_tile` over rows a quarter of the matrix
        apart, the rows past four quarters by `_rows`. A quarter apart rather than adjacent so that each
        thread reads four long runs of consecutive rows, which the CPU's prefetcher follows; four adjacent
        rows a task would make every thread's reads short jumps across the matrix."""
        n_out = w.shape[0]
        if tiled and x.shape[0] >= 4:
            quarter = n_out // 4
            for r in prange(quarter):
                _tile(w, x, bias, out, r, quarter)
            _rows(w, x, bias, out, 4 * quarter, n_out)
        else:
            for task in prange((n_out + 15) // 16):
                _rows(w, x, bias, out, task * 16, min(n_out, task * 16 + 16))

    def _const(value: int, bits: int = 64) -> Any:
        return ir.Constant(ir.IntType(bits), value)

    def _splat(builder: Any, value: Any, vec: Any) -> Any:
        """`value` (a float) in every lane of a vector of type `vec`."""
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, _const(0, 32))
        every = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), every)

    def _row_pointer(builder: Any, array: Any, row: Any) -> Any:
        """Where row `row` of a 2-D array (numba's array structure) starts, as a pointer to its elements."""
        stride = builder.sdiv(cgutils.unpack_tuple(builder, array.strides)[0], array.itemsize)
        return builder.gep(array.data, [builder.mul(row, stride)])

    def _prefetch(builder: Any, at: Any, distances: tuple[Any, ...]) -> None:
        """Ask the CPU for the line `near` bytes past `at` into every cache level (prefetcht0), and the
        one `far` bytes past it into L2 (LLVM's locality 2: prefetcht1), for `distances` (near, far),
        (near,) or none. The near request has the next weights in L1 when the sums reach them; the far
        one keeps memory busy while the sums run on weights the near one found in L3, which would
        otherwise leave memory idle. The distances are values of the call (`PREFETCHES`), not
        constants: the engine picks them by timing."""
        byte = ir.IntType(8).as_pointer()
        kind = ir.FunctionType(ir.VoidType(), [byte, *[ir.IntType(32)] * 3])
        fetch = cgutils.get_or_insert_function(builder.module, kind, "llvm.prefetch.p0i8")
        for distance, locality in zip(distances, (3, 2)[: len(distances)], strict=True):
            ahead = builder.gep(builder.bitcast(at, byte), [distance])
            builder.call(fetch, [ahead, _const(0, 32), _const(locality, 32), _const(1, 32)])

    # each row's sums in two vectors, inputs i and i + 1 (int8: groups g and g + 1): with one, a row alone
    # would wait a multiply-add's latency at each input, and two already hide it; the same two at every
    # row count sum a row in the same order, so that its logits are the same bits in a batch of any size
    _WAYS = 2

    def _band_codegen(rows: int) -> Any:
        """The LLVM IR of `_band_sums` for `rows` rows of x and float32 weights."""
        vec = ir.VectorType(ir.FloatType(), LANES)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            w, start, n_in, x, b0, out, col = args[:7]
            near, far = (context.cast(builder, args[k], signature.args[k], types.int64) for k in (9, 10))
            arrays = [context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 3, 5)]
            band = builder.gep(arrays[0].data, [start])
            xs = [_row_pointer(builder, arrays[1], builder.add(b0, _const(r))) for r in range(rows)]
            sums = [
                [cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(_WAYS)] for _ in xs
            ]

            def step(i: Any, way: int, fetch: tuple[Any, ...]) -> None:  # input i: LANES weights by each x[i]
                at = builder.gep(band, [builder.mul(i, _const(LANES))])
                _prefetch(builder, at, fetch)
                wv = builder.load(builder.bitcast(at, vec.as_pointer()), align=4)
                for xr, acc in zip(xs, sums, strict=True):
                    xv = _splat(builder, builder.load(builder.gep(xr, [i])), vec)
                    product = builder.fmul(xv, wv, flags=("contract",))
                    builder.store(
                        builder.fadd(builder.load(acc[way]), product, flags=("contract",)), acc[way]
                    )

            def inputs(fetch: tuple[Any, ...]) -> None:  # every input, in pairs, then an odd n_in's last one
                pairs = builder.udiv(n_in, _const(_WAYS))
                with cgutils.for_range(builder, pairs) as loop:
                    for way in range(_WAYS):
                        step(builder.add(builder.mul(loop.index, _const(_WAYS)), _const(way)), way, fetch)
                done = builder.mul(pairs, _const(_WAYS))
                with cgutils.for_range(builder, builder.sub(n_in, done)) as loop:
                    step(builder.add(done, loop.index), 0, fetch)

            # the loop three times, asking for both lines, the near one, or none, chosen once a call: no
            # test in the loop
            with builder.if_else(builder.icmp_signed(">", near, _const(0))) as (asking, not_asking):
                with asking:
                    with builder.if_else(builder.icmp_signed(">", far, _const(0))) as (both, near_only):
                        with both:
                            inputs((near, far))
                        with near_only:
                            inputs((near,))
                with not_asking:
                    inputs(())
            for r, acc in enumerate(sums):
                total = builder.load(acc[0])
                for part in acc[1:]:
                    total = builder.fadd(total, builder.load(part))
                row = _row_pointer(builder, arrays[2], builder.add(b0, _const(r)))
                builder.store(total, builder.bitcast(builder.gep(row, [col]), vec.as_pointer()), align=4)
            return context.get_dummy_value()

        return codegen

    def _dot_instruction(context: Any) -> str:
        """The instruction `_dots` multiplies bytes with on the CPU numba compiles for: AVX-512 VNNI's
        vpdpbusd on 512-bit vectors, AVX-VNNI's on two 256-bit halves, else none ("")."""
        try:  # the features numba's target machine was made with (its own attribute: where it moved, none)
            features = set(context.codegen()._tm_features.split(","))
        except AttributeError:
            return ""
        if {"+avx512vnni", "+avx512bw"} <= features:
            return "avx512"
        return "avxvnni" if "+avxvnni" in features else ""

    def _dots(builder: Any, instruction: str, acc: Any, w: Any, x: Any) -> Any:
        """acc (LANES int32) + for each lane j the sum over k < 4 of w's byte 4j + k (unsigned) times x's
        byte 4j + k (signed): one vpdpbusd where the CPU has it (`_dot_instruction`), else the same sums
        widened to int32, which LLVM turns into whatever the CPU multiplies integers with."""
        ivec = acc.type
        if instruction == "avx512":
            kind = ir.FunctionType(ivec, [ivec] * 3)
            return builder.call(
                cgutils.get_or_insert_function(builder.module, kind, "llvm.x86.avx512.vpdpbusd.512"),
                [acc, w, x],
            )
        if instruction == "avxvnni":
            half = ir.VectorType(ir.IntType(32), LANES // 2)
            kind = ir.FunctionType(half, [half] * 3)
            dot = cgutils.get_or_insert_function(builder.module, kind, "llvm.x86.avx512.vpdpbusd.256")
            parts = []
            for lanes in (range(LANES // 2), range(LANES // 2, LANES)):
                pick = ir.Constant(ir.VectorType(ir.IntType(32), LANES // 2), list(lanes))
                parts.append(builder.call(dot, [builder.shuffle_vector(v, v, pick) for v in (acc, w, x)]))
            whole = ir.Constant(ir.VectorType(ir.IntType(32), LANES), list(range(LANES)))
            return builder.shuffle_vector(parts[0], parts[1], whole)
        bytes_ = ir.VectorType(ir.IntType(8), 4 * LANES)
        wb, xb = builder.bitcast(w, bytes_), builder.bitcast(x, bytes_)
        for k in range(4):
            pick = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [4 * j + k for j in range(LANES)])
            wk = builder.zext(builder.shuffle_vector(wb, wb, pick), ivec)
            xk = builder.sext(builder.shuffle_vector(xb, xb, pick), ivec)
            acc = builder.add(acc, builder.mul(wk, xk))
        return acc

    def _qband_codegen(rows: int, portable: bool) -> Any:
        """The LLVM IR of `_band_sums` for `rows` rows of quantized x (`_quantize`) and a band of
        `numpy_engine.quantized_bands` (`portable`: without the CPU's byte dot-product instruction)."""
        i32, f32 = ir.IntType(32), ir.FloatType()
        ivec, fvec = ir.VectorType(i32, LANES), ir.VectorType(f32, LANES)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            w, start, n_in, x, b0, out, col = args[:7]
            instruction = "" if portable else _dot_instruction(context)
            xq, xs, xc = (
                context.make_array(t)(context, builder, v)
                for t, v in zip(signature.args[3], cgutils.unpack_tuple(builder, x), strict=True)
            )
            band = builder.gep(context.make_array(signature.args[0])(context, builder, w).data, [start])
            lines = [builder.add(b0, _const(r)) for r in range(rows)]
            quads = [builder.bitcast(_row_pointer(builder, xq, b), i32.as_pointer()) for b in lines]
            scales = [_row_pointer(builder, xs, b) for b in lines]
            corrections = [_row_pointer(builder, xc, b) for b in lines]
            totals = [cgutils.alloca_once_value(builder, ir.Constant(fvec, None)) for _ in lines]
            with cgutils.for_range(builder, builder.udiv(n_in, _const(QBLOCK))) as loop:
                block = loop.index
                # each row's block sum starts at its correction (`_quantize`), one way's of them
                sums = [
                    [_splat(builder, builder.load(builder.gep(c, [block])), ivec)]
                    + [ir.Constant(ivec, None)] * (_WAYS - 1)
                    for c in corrections
                ]
                for g in range(QBLOCK // 4):  # four inputs by LANES outputs: 64 bytes
                    group = builder.add(builder.mul(block, _const(QBLOCK // 4)), _const(g))
                    at = builder.gep(band, [builder.mul(group, _const(4 * LANES))])
                    wv = builder.load(builder.bitcast(at, ivec.as_pointer()), align=1)
                    for quad, acc in zip(quads, sums, strict=True):
                        xv = _splat(builder, builder.load(builder.gep(quad, [group]), align=1), ivec)
                        acc[g % _WAYS] = _dots(builder, instruction, acc[g % _WAYS], wv, xv)
                for row_scales, acc, total in zip(scales, sums, totals, strict=True):
                    whole = acc[0]
                    for part in acc[1:]:
                        whole = builder.add(whole, part)
                    scale = _splat(builder, builder.load(builder.gep(row_scales, [block])), fvec)
                    product = builder.fmul(builder.sitofp(whole, fvec), scale, flags=("contract",))
                    builder.store(builder.fadd(builder.load(total), product, flags=("contract",)), total)
            out_array = context.make_array(signature.args[5])(context, builder, out)
            for b, total in zip(lines, totals, strict=True):
                row = _row_pointer(builder, out_array, b)
                builder.store(
                    builder.load(total), builder.bitcast(builder.gep(row, [col]), fvec.as_pointer()), align=4
                )
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def _band_sums(
        typingctx: Any,
        w: Any,
        start: Any,
        n_in: Any,
        x: Any,
        b0: Any,
        out: Any,
        col: Any,
        rows: Any,
        portable: Any,
        near: Any,
        far: Any,
    ) -> Any:
        """out[b0 + r, col + j] = sum over i of w[start + LANES i + j] x[b0 + r, i], for the LANES outputs
        j of the band at `start` and `rows` rows of x (a constant: 1, 2, 4 or 8), without scale or bias.

        Written in LLVM's vectors because numba's loops cannot keep a row's LANES sums in one register:
        the products of output-major rows end in a sum across a vector's lanes for each output, where a
        band's lanes are its outputs and each input is one 64-byte load and `rows` multiply-adds, x[b, i]
        broadcast to every lane. With `near` > 0 the weights `near` and `far` bytes ahead are asked for
        (`_prefetch`), so that both the CPU's caches and memory stay busy while the sums run; whether that
        pays, and at what distances, the engine measures (`PREFETCHES`).

        With uint8 weights (`numpy_engine.quantized_bands`: each group of four inputs' LANES x 4 bytes,
        the int8 weights plus 128) x is `_quantize`'s (int8 rows, their blocks' scales, their
        corrections): each group of four inputs is one 64-byte load and, for each row, one byte
        dot-product instruction (`_dots`; `portable` a constant, True: without it) into int32 sums, the
        sums of each QBLOCK inputs then scaled into the float32 ones. A weight costs a quarter of
        float32's bytes and a sixteenth of its instructions, where converting each int8 weight to float32
        would leave the CPU, not the memory, setting the pace."""
        quantized = isinstance(x, types.BaseTuple)
        arrays = (w, *(x.types if quantized else (x,)), out)
        if not (
            isinstance(rows, types.IntegerLiteral)
            and rows.literal_value in (1, 2, 4, 8)
            and isinstance(portable, types.BooleanLiteral)
            and all(isinstance(d, types.Integer) for d in (near, far))
            and all(isinstance(a, types.Array) for a in arrays)
            and w.ndim == 1
            and all(a.ndim == 2 for a in arrays[1:])
            and out.dtype == types.float32
            and [a.dtype for a in arrays[:-1]]
            == ([types.uint8, types.int8, types.float32, types.int32] if quantized else [types.float32] * 2)
        ):
            return None
        codegen = (
            _qband_codegen(rows.literal_value, portable.literal_value)
            if quantized
            else _band_codegen(rows.literal_value)
        )
        return types.none(w, start, n_in, x, b0, out, col, rows, portable, near, far), codegen

    @njit(fastmath=_FAST, cache=_CACHE)
    def _band(
        w: Any, start: int, n_in: int, x: Any, rows: int, out: Any, col: int, near: int, far: int
    ) -> None:
        """The `rows` rows of x (float32, or `_quantize`'s) through the band at `start` (`n_in` inputs)
        into out[:, col:col + LANES], asking for the weights `near` and `far` bytes ahead (`_band_sums`):
        eight rows a pass, a batch's last rows that do not fill eight (or four, or two) done as part of
        its last eight (those rows summed twice, the same values written again)."""
        b = 0
        if rows >= 8:
            while b < rows:
                b = min(b, rows - 8)
                _band_sums(w, start, n_in, x, b, out, col, 8, False, near, far)
                b += 8
        elif rows >= 4:
            while b < rows:
                b = min(b, rows - 4)
                _band_sums(w, start, n_in, x, b, out, col, 4, False, near, far)
                b += 4
        elif rows >= 2:
            while b < rows:
                b = min(b, rows - 2)
                _band_sums(w, start, n_in, x, b, out, col, 2, False, near, far)
                b += 2
        else:
            _band_sums(w, start, n_in, x, 0, out, col, 1, False, near, far)

    @njit(fastmath=_FAST, cache=_CACHE, parallel=True)
    def _bands(w: Any, start: int, x: Any, bias: Any, out: Any, near: int, far: int) -> None:
        """out[b] = W x[b] + bias for every row b, W float32 held from w[start] on as bands
        (`numpy_engine.banded`: out.shape[1] / LANES of them, each (n_in, LANES)), a band a task, the
        weights ahead asked for as `PREFETCHES` says (`near`, `far`)."""
        rows, n_in = x.shape
        for p in prange(out.shape[1] // LANES):
            col = p * LANES
            _band(w, start + p * n_in * LANES, n_in, x, rows, out, col, near, far)
            if bias.size:
                for b in range(rows):
                    for j in range(col, col + LANES):
                        out[b, j] += bias[j]

    @njit(fastmath=_FAST, cache=_CACHE)
    def _quantize_row(x: Any, xq: Any, xs: Any, xc: Any) -> None:
        """One row of `_quantize`: x (k,) into xq (n_in,), its blocks' scales xs and corrections xc."""
        k = x.shape[0]
        for block in range(xs.shape[0]):
            lo, hi = block * QBLOCK, min(k, (block + 1) * QBLOCK)
            top = np.float32(0.0)
            for i in range(lo, hi):
                top = max(top, abs(x[i]))
            scale = top / np.float32(127.0)
            inverse = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
            total = 0
            for i in range(lo, hi):
                q = np.int32(np.rint(x[i] * inverse))
                xq[i] = q
                total += q
            xs[block], xc[block] = scale, -128 * total

    @njit(fastmath=_FAST, cache=_CACHE, parallel=True)
    def _quantize(x: Any, n_in: int) -> tuple[Any, Any, Any]:
        """Each row of x (rows, k) as int8 in blocks of QBLOCK inputs (n_in of them, k <= n_in, the rest
        zeros), as llama.cpp's q8_0 quantizes a product's activations: each block's largest magnitude
        maps to 127 (scale = largest / 127), every value to its nearest step (ties to even). Returns the
        int8 rows, each block's scale and its correction, -128 times the sum of its int8 values, which
        `quantized_bands`' weights (the int8 weights plus 128) make every dot product exceed its value by.
        A batch's rows are rounded on every thread, where they are enough to repay waking the threads
        (SPREAD_FROM values)."""
        rows = x.shape[0]
        blocks = n_in // QBLOCK
        xq = np.zeros((rows, n_in), dtype=np.int8)
        xs, xc = np.empty((rows, blocks), dtype=np.float32), np.empty((rows, blocks), dtype=np.int32)
        if x.size < SPREAD_FROM:
            for b in range(rows):
                _quantize_row(x[b], xq[b], xs[b], xc[b])
        else:
            for b in prange(rows):
                _quantize_row(x[b], xq[b], xs[b], xc[b])
        return xq, xs, xc

    @njit(fastmath=_FAST, cache=_CACHE, parallel=True)
    def _qbands(w: Any, start: int, n_in: int, scale: Any, x: Any, bias: Any, out: Any) -> None:
        """out[b, :n] = (W q(x[b])) * scale + bias for every row b and the n = scale.size outputs: W held
        from w[start] on as `numpy_engine.quantized_bands` (n_in inputs, a multiple of QBLOCK; out.shape[1]
        / LANES bands, the last one's outputs past n padding), q(x) x as `_quantize` rounds it, a band a
        task."""
        rows, n = x.shape[0], scale.size
        quantized = _quantize(x, n_in)
        for p in prange(out.shape[1] // LANES):
            col = p * LANES
            _band(w, start + p * n_in * LANES, n_in, quantized, rows, out, col, 0, 0)
            for b in range(rows):
                for j in range(col, min(col + LANES, n)):
                    y = out[b, j] * scale[j]
                    out[b, j] = y + bias[j] if bias.size else y

    @njit(fastmath=_FAST, cache=_CACHE)
    def _norm(x: Any, weight: Any, bias: Any, eps: float, rms: bool, out: Any) -> None:
        """LayerNorm (or RMSNorm) of each row of x into out, as `numpy.norm`."""
        n = x.shape[1]
        for b in range(x.shape[0]):
            mean = np.float32(0.0)
            if not rms:
                for i in range(n):
                    mean += x[b, i]
                mean /= n
            var = np.float32(0.0)
            for i in range(n):
                d = x[b, i] - mean
                var += d * d
            inv = np.float32(1.0) / np.sqrt(var / n + np.float32(eps))
            for i in range(n):
                y = (x[b, i] - mean) * inv * weight[i]
                out[b, i] = y + bias[i] if bias.size else y

    @njit(fastmath=_FAST, cache=_CACHE)
    def _head_norm(v: Any, weight: Any, eps: float) -> None:
        """QK-norm: RMSNorm of one head's vector v in place."""
        n = v.shape[0]
        ss = np.float32(0.0)
        for i in range(n):
            ss += v[i] * v[i]
        inv = np.float32(1.0) / np.sqrt(ss / n + np.float32(eps))
        for i in range(n):
            v[i] = v[i] * inv * weight[i]

    @njit(fastmath=_FAST, cache=_CACHE)
    def _rotate(v: Any, cos: Any, sin: Any) -> None:
        """Rotary positions on one head's vector v in place (`sin`'s first half negated, as `rotary`):
        each pair (v[i], v[i + half]) turned together, a loop without a copy or an index modulo, which
        LLVM vectorises."""
        half = v.shape[0] // 2
        for i in range(half):
            a, b = v[i], v[i + half]
            v[i] = a * cos[i] + b * sin[i]
            v[i + half] = b * cos[i + half] + a * sin[i + half]

    @njit(fastmath=_FAST, cache=_CACHE)
    def _prepare_heads(
        qkv: Any, n_head: int, n_kv: int, hd: int, qn: Any, kn: Any, eps: float, cos: Any, sin: Any
    ) -> None:
        """QK-norm and rotary positions on the queries and keys of every row, in place (cos and sin: a row
        of angles for each row of qkv, or one row for all)."""
        for b in range(qkv.shape[0]):
            at = min(b, cos.shape[0] - 1)
            for h in range(n_head + n_kv):
                v = qkv[b, h * hd : (h + 1) * hd]
                if qn.size:
                    _head_norm(v, qn if h < n_head else kn, eps)
                if cos.size:
                    _rotate(v, cos[at], sin[at])

    @njit(fastmath=_FAST, cache=_CACHE)
    def _scores(q: Any, keys: Any, scores: Any, start: int, end: int) -> None:
        """scores[j] = q . keys[j] for j in start..end-1, four keys a pass (one load of q for four products)."""
        j = start
        while j + 4 <= end:
            k0, k1, k2, k3 = keys[j], keys[j + 1], keys[j + 2], keys[j + 3]
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for i in range(q.size):
                s0 += q[i] * _widen(k0[i])
                s1 += q[i] * _widen(k1[i])
                s2 += q[i] * _widen(k2[i])
                s3 += q[i] * _widen(k3[i])
            scores[j], scores[j + 1], scores[j + 2], scores[j + 3] = s0, s1, s2, s3
            j += 4
        for rest in range(j, end):
            s = np.float32(0.0)
            for i in range(q.size):
                s += q[i] * _widen(keys[rest, i])
            scores[rest] = s

    @njit(fastmath=_FAST, cache=_CACHE)
    def _softmax(scores: Any, scale: float) -> Any:
        """scores -> exp(scale (s - max s)) in place (scale > 0: the largest term e^0); returns their sum."""
        top = scores[0]
        for j in range(scores.size):
            top = max(top, scores[j])
        total = np.float32(0.0)
        for j in range(scores.size):
            scores[j] = _exp((scores[j] - top) * np.float32(scale))
            total += scores[j]
        return total

    @njit(fastmath=_FAST, cache=_CACHE)
    def _weigh(weights: Any, values: Any, acc: Any, start: int, end: int) -> None:
        """acc += weights[j] values[j] for j in start..end-1."""
        for j in range(start, end):
            p = weights[j]
            for i in range(acc.size):
                acc[i] += p * _widen(values[j, i])

    @njit(fastmath=_FAST, cache=_CACHE)
    def _task(work: Any, t: int) -> Any:
        """Attention task t (query row t // n_head, head t % n_head) of `work` (`_attend`'s arguments):
        its query, its key/value head's keys and values in its cache row, how many slots it reads (the
        first min(position + 1, capacity): the order of the slots does not matter to one query), and its
        slice of the output."""
        qkv, kc, vc, n_head, n_kv, positions, cache_rows = work[:7]
        hd = kc.shape[3]
        b, h = t // n_head, t % n_head
        g, c = h // (n_head // n_kv), cache_rows[b]
        keys = min(positions[b] + 1, kc.shape[2])
        return qkv[b, h * hd : (h + 1) * hd], kc[c, g], vc[c, g], keys, (b, h * hd, (h + 1) * hd)

    @njit(fastmath=_FAST, cache=_CACHE)
    def _attend_one(work: Any, t: int) -> None:
        """Task t's query over its keys, its values weighed into its slice of the output."""
        scale, out = work[7:]
        q, keys, values, n, (b, lo, hi) = _task(work, t)
        scores = np.empty(n, dtype=np.float32)
        _scores(q, keys, scores, 0, n)
        total = _softmax(scores, scale)
        acc = np.zeros(q.size, dtype=np.float32)
        _weigh(scores, values, acc, 0, n)
        out[b, lo:hi] = acc * (np.float32(1.0) / total)

    @njit(fastmath=_FAST, cache=_CACHE)
    def _attend_two(work: Any, t: int) -> None:
        """Tasks t and t + 1 at once, the keys (then the values) of both read side by side: two streams
        from memory for the thread where one task's reads are one."""
        scale, out = work[7:]
        qa, ka, va, na, (ra, la, ha) = _task(work, t)
        qb, kb, vb, nb, (rb, lb, hb) = _task(work, t + 1)
        sa, sb = np.empty(na, dtype=np.float32), np.empty(nb, dtype=np.float32)
        both, j = min(na, nb), 0
        while j + 2 <= both:  # two keys of each task a pass
            a0, a1, b0, b1 = ka[j], ka[j + 1], kb[j], kb[j + 1]
            x0 = x1 = y0 = y1 = np.float32(0.0)
            for i in range(qa.size):
                x0 += qa[i] * _widen(a0[i])
                x1 += qa[i] * _widen(a1[i])
                y0 += qb[i] * _widen(b0[i])
                y1 += qb[i] * _widen(b1[i])
            sa[j], sa[j + 1], sb[j], sb[j + 1] = x0, x1, y0, y1
            j += 2
        _scores(qa, ka, sa, j, na)
        _scores(qb, kb, sb, j, nb)
        ta, tb = _softmax(sa, scale), _softmax(sb, scale)
        acc_a, acc_b = np.zeros(qa.size, dtype=np.float32), np.zeros(qb.size, dtype=np.float32)
        for j in range(both):  # a value of each task a pass
            pa, pb, a0, b0 = sa[j], sb[j], va[j], vb[j]
            for i in range(acc_a.size):
                acc_a[i] += pa * _widen(a0[i])
                acc_b[i] += pb * _widen(b0[i])
        _weigh(sa, va, acc_a, both, na)
        _weigh(sb, vb, acc_b, both, nb)
        out[ra, la:ha] = acc_a * (np.float32(1.0) / ta)
        out[rb, lb:hb] = acc_b * (np.float32(1.0) / tb)

    @njit(fastmath=_FAST, cache=_CACHE, parallel=True)
    def _attend(
        qkv: Any,
        kc: Any,
        vc: Any,
        n_head: int,
        n_kv: int,
        positions: Any,
        cache_rows: Any,
        scale: float,
        out: Any,
        threads: int,
    ) -> None:
        """Each row's one query per head over the slots its key/value head has filled in its cache row
        (`cache_rows`), into out (rows, n_head * hd). With four (row, head) tasks a thread or more, two
        at a time (`_attend_two`: two streams of keys and values from memory keep more reads in flight
        than one); fewer, one at a time, so that the threads' shares stay even."""
        tasks = qkv.shape[0] * n_head
        paired = tasks >= 4 * threads
        items = (tasks + 1) // 2 if paired else tasks
        work = (qkv, kc, vc, n_head, n_kv, positions, cache_rows, scale, out)
        for item in prange(items):
            t = np.int64(item) * (2 if paired else 1)  # prange's index may be unsigned
            if paired and t + 1 < tasks:
                _attend_two(work, t)
            else:
                _attend_one(work, t)

    @njit(fastmath=_FAST, cache=_CACHE, parallel=True)
    def _activate(h: Any, activation: int) -> Any:
        """GELU (tanh form), ReLU² or SwiGLU (h's first half the gate's outputs) of each row of h, the
        rows shared between threads (an exp an element: a batch's largest element-wise cost, so `_exp`)."""
        if activation == 2:
            half = h.shape[1] // 2
            out = np.empty((h.shape[0], half), dtype=np.float32)
            for b in prange(h.shape[0]):
                for i in range(half):
                    g = h[b, i]
                    out[b, i] = g / (np.float32(1.0) + _exp(-g)) * h[b, half + i]
            return out
        c = np.float32(math.sqrt(2.0 / math.pi))
        for b in prange(h.shape[0]):
            for i in range(h.shape[1]):
                x = h[b, i]
                if activation == 1:
                    x = max(x, np.float32(0.0))
                    h[b, i] = x * x
                else:  # x sigmoid(2u), u = c (x + 0.044715 x³), as `numpy.gelu_tanh`
                    h[b, i] = x / (
                        np.float32(1.0) + _exp(np.float32(-2.0) * c * (x + np.float32(0.044715) * x * x * x))
                    )
        return h

    @njit(cache=_CACHE, inline="always")
    def _exp_weight(z: Any) -> Any:
        """exp of a float64 z <= 0 in float64 arithmetic that LLVM vectorises (`_exp`'s way, where numba
        calls libm's exp once per element): z = k ln2 + r with |r| <= ln2/2 (ln2 in two parts, Cephes',
        so k ln2 is exact), e^r by its Taylor series to r^13 (the next term under 5e-18), 2^k put into the
        exponent bits: within 2 units in the last place of the exact value. Below -708, where 2^k would
        leave float64's normal numbers, it is 0: a weight under 1e-307 of the largest one's."""
        under = z < -708.0
        z = max(z, -708.0)
        k = np.floor(z * 1.4426950408889634 + 0.5)
        r = (z - k * 6.93145751953125e-1) - k * 1.42860682030941723212e-6
        p = 1.6059043836821613e-10  # 1/13!, then each 1/n! down to 1
        for c in _TAYLOR:
            p = p * r + c
        y = p * _double_from_bits((np.int64(k) + np.int64(1023)) << np.int64(52))
        return 0.0 if under else y

    @njit(cache=_CACHE)
    def _draw_row(logits: Any, temperature: float, u: float, cdf: Any) -> int:
        """The token `_draw` draws for one row of logits (V,), cdf a (V,) float64 buffer."""
        vocab = logits.shape[0]
        most = np.float32(-np.inf)
        for v in range(vocab):
            most = max(most, logits[v])
        top = np.float64(most)
        for v in range(vocab):
            cdf[v] = _exp_weight((np.float64(logits[v]) - top) / temperature)
        total = 0.0
        for v in range(vocab):
            total += cdf[v]
            cdf[v] = total
        target = u * total
        lo, hi = 0, vocab  # the first v with cdf[v] > target: a zero weight's empty step is never it
        while lo < hi:
            mid = (lo + hi) // 2
            if cdf[mid] > target:
                hi = mid
            else:
                lo = mid + 1
        return min(lo, vocab - 1)

    @njit(cache=_CACHE, parallel=True)
    def _draw(logits: Any, temperature: float, u: Any, out: Any) -> None:
        """out[r] = the token drawn for row r of logits (B, V) at `temperature` by the uniform u[r] in [0, 1),
        as `numpy.sample_next` draws without top-k or top-p: the first token whose running sum of the
        weights exp(z), z = (logits - max logits) / temperature in float64 (shifted first: a tiny temperature
        gives 0 and -inf, never NaN), passes u times their total. The weights first, a loop LLVM vectorises
        (`_exp_weight`), then their running sum in order, without fast-math: each sum is the one a NumPy
        cumsum makes of them. A batch's rows are drawn on every thread, where they are enough to repay
        waking the threads (SPREAD_FROM values: a vocabulary of tens of thousands)."""
        rows, vocab = logits.shape
        cdf = np.empty((rows, vocab), dtype=np.float64)
        if logits.size < SPREAD_FROM:
            for r in range(rows):
                out[r] = _draw_row(logits[r], temperature, u[r], cdf[r])
        else:
            for r in prange(rows):
                out[r] = _draw_row(logits[r], temperature, u[r], cdf[r])

    @njit(fastmath=_FAST, cache=_CACHE)
    def _store_kv(
        qkv: Any, n_head: int, n_kv: int, hd: int, kc: Any, vc: Any, positions: Any, cache_rows: Any
    ) -> None:
        """Each row's new keys and values into its cache row (`cache_rows`) at slot position % capacity,
        in the cache's type (a float16 cache: clamped to float16's largest finite value first, so that a
        huge key is a large score, not inf)."""
        top = _largest(kc)
        for b in range(qkv.shape[0]):
            slot, c = positions[b] % kc.shape[2], cache_rows[b]
            for g in range(n_kv):
                k0, v0 = (n_head + g) * hd, (n_head + n_kv + g) * hd
                for i in range(hd):
                    kc[c, g, slot, i] = _narrow(min(max(qkv[b, k0 + i], -top), top), kc)
                    vc[c, g, slot, i] = _narrow(min(max(qkv[b, v0 + i], -top), top), vc)

    # A step's tensors lie in two buffers (`model_args`): the float32 one, and the uint8 one of int8
    # weights held as `quantized_bands` (empty for a float32 model); a row of the table for each,
    # (offset, rows, cols), cols 0 for a vector, rows 0 for a tensor the model lacks.
    @njit(cache=_CACHE, inline="always")
    def _vec(buf: Any, table: Any, slot: int) -> Any:
        return buf[table[slot, 0] : table[slot, 0] + table[slot, 1]]

    @njit(cache=_CACHE, inline="always")
    def _mat(buf: Any, table: Any, slot: int) -> Any:
        start, rows, cols = table[slot, 0], table[slot, 1], table[slot, 2]
        return buf[start : start + rows * cols].reshape((rows, cols))

    @njit(fastmath=_FAST, cache=_CACHE)
    def _linear(f32: Any, quant: Any, table: Any, slot: int, form: int, x: Any, near: int, far: int) -> Any:
        """x through the linear layer whose weight is at `slot` of the table, its scales and bias the next
        two slots of f32, read as `form` says (ROWS, TILES: `_matvec`; BANDS: `_bands`, in f32, asking
        for weights `near` and `far` bytes ahead; QBANDS: `_qbands`, in `quant`, as many outputs as
        scales)."""
        scale, bias = _vec(f32, table, slot + 1), _vec(f32, table, slot + 2)
        if form == QBANDS:  # out as long as the bands, cut to the outputs (a copy where they are padded)
            out = np.empty((x.shape[0], table[slot, 1]), dtype=np.float32)
            _qbands(quant, table[slot, 0], table[slot, 2], scale, x, bias, out)
            return out if scale.size == out.shape[1] else np.ascontiguousarray(out[:, : scale.size])
        out = np.empty((x.shape[0], table[slot, 1]), dtype=np.float32)
        if form == BANDS:
            _bands(f32, table[slot, 0], x, bias, out, near, far)
        else:
            _matvec(_mat(f32, table, slot), x, bias, out, form == TILES)
        return out

    @njit(fastmath=_FAST, cache=_CACHE)
    def _block_step(
        x: Any,
        model: tuple[Any, Any, Any],
        first: int,
        ints: Any,
        reals: Any,
        rope: tuple[Any, Any],
        v_rows: Any,
        cache: tuple[Any, Any],
        positions: Any,
        cache_rows: Any,
        threads: int,
    ) -> Any:
        """One block over x, its tensors from slot `first` of the table on (`_LAYER`), its shapes and
        options `ints` (`_block_ints`) and `reals` (norm eps, QK-norm eps, score scale)."""
        f32, quant, table = model
        rows, width = x.shape
        n_head, n_kv, hd, activation, rms = ints[0], ints[1], ints[2], ints[3], ints[4] != 0
        kc, vc = cache
        h = np.empty_like(x)
        _norm(x, _vec(f32, table, first), _vec(f32, table, first + 1), reals[0], rms, h)
        near, far = ints[9], ints[10]
        qkv = _linear(f32, quant, table, first + _QKV, ints[5], h, near, far)
        if v_rows.size:  # value embeddings: added to the values before they are cached
            qkv[:, (n_head + n_kv) * hd :] += v_rows
        qn, kn = _vec(f32, table, first + _QK), _vec(f32, table, first + _QK + 1)
        _prepare_heads(qkv, n_head, n_kv, hd, qn, kn, reals[1], rope[0], rope[1])
        _store_kv(qkv, n_head, n_kv, hd, kc, vc, positions, cache_rows)
        y = np.empty((rows, n_head * hd), dtype=np.float32)
        _attend(qkv, kc, vc, n_head, n_kv, positions, cache_rows, reals[2], y, threads)
        out = _linear(f32, quant, table, first + _PROJ, ints[6], y, near, far)
        out += x
        _norm(out, _vec(f32, table, first + 2), _vec(f32, table, first + 3), reals[0], rms, h)
        up = _linear(f32, quant, table, first + _FC, ints[7], h, near, far)
        out += _linear(f32, quant, table, first + _DOWN, ints[8], _activate(up, activation), near, far)
        return out

    @njit(fastmath=_FAST, cache=_CACHE)
    def _embed(tokens: Any, positions: Any, f32: Any, table: Any) -> Any:
        """The token embeddings of `tokens`, plus learned positions' where the model has them."""
        wte, wpe = _mat(f32, table, _WTE), _mat(f32, table, _WPE)
        x = np.empty((tokens.shape[0], wte.shape[1]), dtype=np.float32)
        for b in range(tokens.shape[0]):
            if not 0 <= tokens[b] < wte.shape[0]:
                raise IndexError("token id outside the vocabulary")
            x[b] = wte[tokens[b]]
            if wpe.size:
                x[b] += wpe[positions[b]]
        return x

    @njit(fastmath=_FAST, cache=_CACHE)
    def _model_step(
        tokens: Any,
        model: tuple[Any, Any, Any, Any, Any, Any, tuple[float, bool, int, float]],
        cache: tuple[Any, Any, int],
        positions: Any,
        cache_rows: Any,
        rope: tuple[Any, Any],
        logit_rows: Any,
        threads: int,
    ) -> Any:
        f32, quant, table, ints, reals, pairs, final = model
        kv, slots, cache_batch = cache
        x = _embed(tokens, positions, f32, table)
        rows, width = x.shape
        skips = _vec(f32, table, _SKIPS)
        inputs = np.empty((pairs.shape[0], rows, width), dtype=np.float32)  # what U-net skips carry
        for layer in range(ints.shape[0]):
            for i in range(pairs.shape[0]):
                if pairs[i, 1] == layer:
                    x = x + skips[i] * inputs[pairs[i, 0]]
            if layer < pairs.shape[0]:
                inputs[layer] = x
            first = _GLOBALS + layer * _LAYER
            table_v = _mat(f32, table, first + _VE)
            v_rows = np.empty((rows, table_v.shape[1]), dtype=np.float32)
            for b in range(rows if table_v.size else 0):
                v_rows[b] = table_v[tokens[b]]
            shape = (cache_batch, ints[layer, 1], slots[layer, 2], ints[layer, 2])
            size = shape[0] * shape[1] * shape[2] * shape[3]
            kc = kv[slots[layer, 0] : slots[layer, 0] + size].reshape(shape)
            vc = kv[slots[layer, 1] : slots[layer, 1] + size].reshape(shape)
            x = _block_step(
                x, (f32, quant, table), first, ints[layer], reals[layer], rope, v_rows, (kc, vc),
                positions, cache_rows, threads,
            )  # fmt: skip
        eps, rms, form, logit_cap = final
        h = np.empty((logit_rows.shape[0], width), dtype=np.float32)
        _norm(x[logit_rows], _vec(f32, table, _LNF), _vec(f32, table, _LNF + 1), eps, rms, h)
        logits = _linear(f32, quant, table, _HEAD, form, h, 0, 0)  # the head is never float32 bands
        if logit_cap > 0:
            cap = np.float32(logit_cap)
            for b in range(h.shape[0]):
                for v in range(logits.shape[1]):
                    logits[b, v] = cap * np.tanh(logits[b, v] / cap)
        return logits


def _array(a: np.ndarray | None) -> np.ndarray:
    return _EMPTY if a is None else a


def tiled(w: LinearWeights[np.ndarray], tile_from: int | None) -> bool:
    """Whether batches of four rows or more go through `_tile` for the output-major w: its rows are
    `tile_from` long or longer (None: never). Which lengths gain depends on the CPU and the matrix, so
    the engine measures it (`NumpyEngine._pick_tiles`)."""
    return tile_from is not None and w.weight.ndim == 2 and w.weight.shape[1] >= tile_from


def form(w: LinearWeights[np.ndarray], tile_from: int | None) -> int:
    """How the kernels read w: QBANDS where it is held as int8 bands (`numpy_engine.quantized_bands`),
    BANDS as float32 ones (`numpy_engine.banded`), else TILES or ROWS (`tiled`)."""
    return {4: QBANDS, 3: BANDS}.get(w.weight.ndim, TILES if tiled(w, tile_from) else ROWS)


def out_features(w: LinearWeights[np.ndarray]) -> int:
    """How many outputs w has, in whichever form its weight is held (int8 bands: one scale each, the
    bands padded past them)."""
    shape = w.weight.shape
    if len(shape) == 4:
        assert w.scale is not None
        return len(w.scale)
    return shape[0] * shape[2] if len(shape) == 3 else shape[1] if w.input_major else shape[0]


def matvec(
    w: LinearWeights[np.ndarray],
    x: np.ndarray,
    tile_from: int | None = None,
    ahead: tuple[int, int] = PREFETCHES["none"],
) -> np.ndarray:
    """x (B, in) through a float32 linear layer held output-major or as bands, or an int8 one held as
    int8 bands: (B, out), as `numpy.linear` (`form` by `tile_from`; bands asking for weights `ahead`)."""
    out = np.empty((x.shape[0], out_features(w)), dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    bias = _array(w.bias)
    if w.weight.ndim == 4:
        weight = np.ascontiguousarray(w.weight)
        full = np.empty((x.shape[0], weight.shape[0] * LANES), dtype=np.float32)
        _qbands(weight.reshape(-1), 0, weight.shape[1] * 4, w.scale, x, bias, full)
        out[:] = full[:, : out.shape[1]]
    elif w.weight.ndim == 3:
        _bands(np.ascontiguousarray(w.weight).reshape(-1), 0, x, bias, out, *ahead)
    else:
        _matvec(w.weight, x, bias, out, tiled(w, tile_from))
    return out


def draw(logits: np.ndarray, temperature: float, u: np.ndarray) -> np.ndarray:
    """Token ids (B,) drawn from logits (B, V) at `temperature` > 0 by uniforms u (B,), in one compiled call
    (`_draw`) rather than sampling's dozen NumPy calls, each of which would start from caches a step's
    weights have just streamed through."""
    out = np.empty(logits.shape[0], dtype=np.int64)
    # one argument type (`entries`): a batch's first logits are one row broadcast to all (read-only, stride 0)
    _draw(np.require(logits, np.float32, "CW"), float(temperature), np.require(u, np.float64, "CW"), out)
    return out


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns a's memory (NumPy points every view's `base` at it)."""
    return a if a.base is None else a.base


def _place(a: np.ndarray | None, buffer: np.ndarray) -> tuple[int, int, int]:
    """Where tensor a lies in `buffer`: (offset, rows, cols), cols 0 for a vector, a matrix held as
    bands (out / LANES, in, LANES) or int8 bands (out / LANES, in / 4, LANES, 4) as its (out, in);
    (0, 0, 0) for none."""
    if a is None or a.size == 0:
        return (0, 0, 0)
    if not (_root(a) is buffer and a.flags.c_contiguous and a.ndim in (1, 2, 3, 4)):
        raise ValueError("the kernels read a model whose tensors are packed into one buffer (numpy.packed)")
    offset = (a.ctypes.data - buffer.ctypes.data) // a.itemsize
    if a.ndim >= 3:
        return (offset, a.shape[0] * a.shape[2], a.size // (a.shape[0] * a.shape[2]))
    return (offset, a.shape[0], a.shape[1] if a.ndim == 2 else 0)


def _linear_places(
    lin: LinearWeights[np.ndarray], f32: np.ndarray, quant: np.ndarray
) -> list[tuple[int, int, int]]:
    """A linear layer's rows of the table: its weight (in `quant` if int8 bands), scales and bias."""
    weight = _place(lin.weight, quant if lin.weight.dtype == np.uint8 else f32)
    return [weight, _place(lin.scale, f32), _place(lin.bias, f32)]


def _block_places(
    w: BlockWeights[np.ndarray], f32: np.ndarray, quant: np.ndarray
) -> list[tuple[int, int, int]]:
    """A block's rows of the table, in `_LAYER`'s order."""
    a = w.attn
    places = [_place(n, f32) for n in (w.ln_1.weight, w.ln_1.bias, w.ln_2.weight, w.ln_2.bias)]
    places += [_place(n and n.weight, f32) for n in (a.q_norm, a.k_norm)]
    places.append(_place(a.v_embed, f32))
    for lin in (a.c_attn, a.c_proj, w.mlp.c_fc, w.mlp.c_proj):
        places += _linear_places(lin, f32, quant)
    return places


def _block_ints(w: BlockWeights[np.ndarray], tile_from: int | None, ahead: tuple[int, int]) -> list[int]:
    """A block's shapes and options: n_head, n_kv_head, head_dim, ACTIVATIONS' code, RMSNorm, how each of
    its four products reads its weight (`form`), and how far ahead float32 bands ask for weights (`ahead`,
    a value of `PREFETCHES`)."""
    a = w.attn
    lins = (a.c_attn, a.c_proj, w.mlp.c_fc, w.mlp.c_proj)
    shapes = [a.n_head, a.n_kv_head, _head_dim(w), ACTIVATIONS[w.mlp.activation], int(w.ln_1.rms)]
    return shapes + [form(lin, tile_from) for lin in lins] + list(ahead)


ModelArgs = tuple[Any, ...]


def model_args(
    w: ModelWeights[np.ndarray],
    head: LinearWeights[np.ndarray],
    tile_from: int | None = None,
    ahead: tuple[int, int] = PREFETCHES["none"],
) -> ModelArgs:
    """A model as `model_step` hands it to the kernel, built once per engine (every block `supported`;
    `head`: the LM head as an output-major linear layer; batches through `_tile` for weight rows
    `tile_from` long or longer; float32 bands asking for weights `ahead` bytes ahead). Its tensors must lie in one float32 buffer, the int8 bands in one uint8
    buffer (`numpy.packed`): the kernel is handed the two buffers and a table of where each tensor lies,
    not the tensors, because numba unpacks every array it is handed at every call, and a model has tens
    of them a block: handing them over would cost every token a share of its step that grows with the
    model's depth. One type of arguments for float32 and int8 models (a float32 model's uint8 buffer
    empty): one compiled step serves both."""
    f32 = _root(w.wte)
    quant = next(
        (_root(lin.weight) for lin in (head, w.h[0].attn.c_attn) if lin.weight.dtype == np.uint8),
        _EMPTY_BYTES,
    )
    places = [
        _place(w.wte, f32), _place(w.wpe, f32), _place(w.skips, f32), _place(w.ln_f.weight, f32),
        _place(w.ln_f.bias, f32), *_linear_places(head, f32, quant),
    ]  # fmt: skip
    for block in w.h:
        places += _block_places(block, f32, quant)
    reals = [
        (float(b.ln_1.eps), float(b.attn.q_norm.eps) if b.attn.q_norm else 0.0, _score_scale(b)) for b in w.h
    ]
    final = (float(w.ln_f.eps), w.ln_f.rms, form(head, tile_from), float(w.logit_cap or 0.0))
    return (
        f32,
        quant,
        np.array(places, dtype=np.int64),
        np.array([_block_ints(b, tile_from, ahead) for b in w.h], dtype=np.int64),
        np.array(reals, dtype=np.float64),
        np.array(w.skip_pairs, dtype=np.int64).reshape(-1, 2),
        final,
    )


def _head_dim(w: BlockWeights[np.ndarray]) -> int:
    return out_features(w.attn.c_attn) // (w.attn.n_head + 2 * w.attn.n_kv_head)


def _score_scale(w: BlockWeights[np.ndarray]) -> float:
    return 1.0 / math.sqrt(_head_dim(w)) if w.attn.score == "scaled" else 1.0


def cache_args(k: Sequence[np.ndarray], v: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """A KV cache as `model_step` takes it: its one buffer (float16 as its bits: numba has no float16 on
    the CPU), where each layer's keys and values start and their capacity, and its rows."""
    buffer = _root(k[0])
    slots = [
        (_place(a.reshape(-1), buffer)[0], _place(b.reshape(-1), buffer)[0], a.shape[2])
        for a, b in zip(k, v, strict=True)
    ]
    flat = buffer.view(np.uint16) if buffer.dtype == np.float16 else buffer
    return flat, np.array(slots, dtype=np.int64), k[0].shape[0]


@functools.cache
def _every(n: int) -> np.ndarray:
    """0..n-1 as the kernels' row indices (kept: a step would otherwise build two of them)."""
    return np.arange(n, dtype=np.int64)


def model_step(
    args: ModelArgs,
    tokens: np.ndarray,
    cache: tuple[np.ndarray, np.ndarray, int],
    positions: np.ndarray,
    rope: tuple[np.ndarray, np.ndarray] | None,
    cache_rows: np.ndarray | None = None,
    logit_rows: np.ndarray | None = None,
) -> np.ndarray:
    """The logits of new tokens (`tokens` (N,), int64), each at its position (`positions` (N,), int64)
    in its row of the cache (`cache_rows` (N,); None: token b in row b), through the model `args` holds
    (`model_args`), as one compiled call: `numpy.transformer` and `numpy.head`, each block `_block_step`.
    One token a row is a decoding step (rows may stand at different positions); several tokens of one
    row at consecutive positions are a prefill (each attends to the slots up to its own position, so it
    must not wrap the ring: position < capacity). Each layer's keys and values are written into the
    cache (`cache_args`: rows x n_kv_head x capacity x hd a layer) at slot position % capacity,
    attention reading the first min(position + 1, capacity) slots of the row. rope: the cos and sin rows
    of the tokens' positions (`numpy.rotary`), one a token or one for all. Logits (len(logit_rows), V)
    of the tokens `logit_rows` picks (None: every token). One call, not one a block: the Python and NumPy
    calls between per-block calls would each start from caches the weights had just streamed through. A
    token id outside the vocabulary raises
    IndexError."""
    rope = (_EMPTY_ROWS, _EMPTY_ROWS) if rope is None else rope
    every = _every(len(tokens))
    return _model_step(
        tokens, args, cache, positions, every if cache_rows is None else cache_rows, rope,
        every if logit_rows is None else logit_rows, numba.get_num_threads(),
    )  # fmt: skip


# --- what numba's cache must hold: the entry points and their argument types ----------------------------

Entry = tuple[Any, tuple[Any, ...]]  # a compiled function and the numba types of its arguments


def entries(quantize: str, kv_cache: str) -> list[Entry]:
    """Every compiled function the engine calls from Python, with the argument types it calls it with for
    blocks' weights in `quantize` form ('none', 'int8') and a `kv_cache` KV cache ('float32', 'float16'):
    numba compiles, and caches, a function once for each set of argument types (its callees with it), so
    a load whose types its cache lacks compiles them. `model_step` (steps and prefills: one set of types
    for float32 and int8 models, whose int8 buffer is then empty), `draw`, and `matvec` by bands or rows
    (a prefill's products, the head's by rows in float32), or by int8 bands. Each type is the numba type
    of a value of the kind the engine passes (`numba.typeof`, as a call types its arguments)."""
    f32, ids, rows = np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.int64), np.zeros((1, 1), np.float32)
    table = np.zeros((1, 1), dtype=np.int64)
    model = (f32, _EMPTY_BYTES, table, table, np.zeros((1, 1)), table, (0.0, False, 0, 0.0))
    kv = np.zeros(1, dtype=np.uint16 if kv_cache == "float16" else np.float32)
    calls: list[tuple[Any, tuple[Any, ...]]] = [
        (_model_step, (ids, model, (kv, table, 0), ids, ids, (rows, rows), ids, 0)),
        (_draw, (rows, 0.0, np.zeros(1), ids)),
        (_bands, (f32, 0, rows, f32, rows, 0, 0)),
        (_matvec, (rows, rows, f32, rows, False)),
    ]
    if quantize == "int8":
        calls.append((_qbands, (_EMPTY_BYTES, 0, 0, f32, rows, f32, rows)))
    return [(f, tuple(numba.typeof(a, Purpose.argument) for a in args)) for f, args in calls]


def missing(wanted: Sequence[Entry]) -> list[Entry]:
    """The entries numba's cache does not hold for this machine and this source (reading its index files,
    as a call would before compiling). Where numba's cache internals have moved, none: the caller then
    loads the kernels as before, compiling what it must."""
    try:
        return [
            (f, sig)
            for f, sig in wanted
            if f._cache._index_key(sig, f.targetctx.codegen()) not in f._cache._cache_file._load_index()
        ]
    except AttributeError:
        return []


def compile_entries(wanted: Sequence[Entry]) -> None:
    """Compile each entry for its argument types (numba writes each function's machine code to its cache
    as it is compiled, its callees first: an interrupted compile keeps what it finished)."""
    for f, sig in wanted:
        f.compile(sig)


def cache_folder() -> str | None:
    """The folder numba keeps this module's compiled code in (`__pycache__` beside it, a user-wide one, or
    under NUMBA_CACHE_DIR, by numba's rules), or None where it keeps none: no folder it can write, or
    cache internals that have moved."""
    if not _CACHE:
        return None
    try:
        return str(_model_step._cache._cache_path)
    except AttributeError:
        return None


def caches() -> bool:
    """Whether numba keeps the kernels' compiled code anywhere (else each process compiles them again)."""
    return _CACHE
