"""The numba loops behind :mod:`mergelab.merge.kernels` (imported on first use only: importing
numba and loading the cached machine code takes over half a second, which a plain ``import
mergelab`` or a merge by another method should not pay). Read kernels' docstring first; every
function here mirrors a torch operation sequence named in its docstring.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .kernels import (
    DARE_LANES,
    DIVIDE_COUNT,
    DIVIDE_NONE,
    DIVIDE_WEIGHT_SUM,
    F_ALL_POSITIVE,
    F_ANY_FLIP,
    F_BAND,
    F_DIVIDE_BY,
    F_DIVISOR_PLAIN,
    F_KIND,
    F_MERGE_PLAIN,
    F_SCALE,
    F_SUM_DIVIDE,
    F_VOTE_COUNT,
    F_VOTE_PLAIN,
    FOUND_IN_INPUT,
    FOUND_IN_RESULT,
    KIND_SUM,
    P_DARE_DIVISOR,
    P_DARE_LIMIT,
    P_DIVISOR_W,
    P_FLIP,
    P_HIGH,
    P_LOW,
    P_MERGE_W,
    P_SUM_W,
    P_VOTE_W,
    RUN_HASH,
    S_LAMBDA,
    S_MIN_W,
    S_TOTAL,
    TILE,
)

_f32 = np.float32
_ZERO, _ONE, _MINUS_ONE = _f32(0.0), _f32(1.0), _f32(-1.0)
_MINUS_2_24 = _f32(-(2.0**24))


@intrinsic
def _u32_as_f32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """a·b + c rounded once (what torch's vectorised ``add_(b, alpha=a)`` computes)."""

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _trailing_zeros(typingctx, x):
    """The number of trailing zero bits of the uint64 ``x`` (not 0)."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fn = builder.module.declare_intrinsic(
            "llvm.cttz", [i64], ir.FunctionType(i64, [i64, ir.IntType(1)])
        )
        return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 1)])

    return types.uint64(types.uint64), codegen


@intrinsic
def _u16_pointer(typingctx, address):
    """The int64 ``address`` as a uint16 pointer (bfloat16 bits)."""
    pointer = types.CPointer(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(types.int64), codegen


@intrinsic
def _f32_pointer(typingctx, address):
    """The int64 ``address`` as a float32 pointer."""
    pointer = types.CPointer(types.float32)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(types.int64), codegen


@intrinsic
def _prefetch(typingctx, address):
    """Ask the CPU to start loading the cache line at the int64 ``address`` (a hint: no fault,
    no result)."""

    def codegen(context, builder, signature, args):
        pointer = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", [pointer], ir.FunctionType(ir.VoidType(), [pointer, i32, i32, i32])
        )
        # read, keep in every cache level, data (not instructions)
        builder.call(fn, [builder.inttoptr(args[0], pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@intrinsic
def _sfc64_lanes(typingctx, states, rows, steps, stride):
    """``steps`` outputs of each of DARE_LANES SFC64 streams at once, the streams in the
    lanes of one vector register (NumPy's algorithm, step for step): ``states`` is a C-ordered
    uint64 [4, DARE_LANES] array (rows a, b, c, counter; advanced), lane l's p-th output goes to
    ``rows[l · stride + p]`` (a C-ordered uint64 array). LLVM does not vectorise the scalar
    form across streams (it cannot tell the state arrays from the output), so this writes the
    vector operations itself."""
    if states.layout != "C" or rows.layout != "C":
        return None  # the offsets below assume C order: no signature for other layouts
    sig = types.void(states, rows, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        state_type, rows_type, _, _ = signature.args
        state = context.make_array(state_type)(context, builder, args[0])
        out = context.make_array(rows_type)(context, builder, args[1])
        steps, stride = args[2], args[3]
        i64 = ir.IntType(64)
        vector = ir.VectorType(i64, DARE_LANES)
        first = builder.bitcast(state.data, i64.as_pointer())
        slots = [
            builder.bitcast(
                builder.gep(first, [ir.Constant(i64, r * DARE_LANES)]), vector.as_pointer()
            )
            for r in range(4)
        ]
        start = [builder.load(slot, align=8) for slot in slots]
        rows_start = builder.bitcast(out.data, i64.as_pointer())

        def splat(value):
            return ir.Constant(vector, [ir.Constant(i64, value)] * DARE_LANES)

        entry = builder.block
        header = builder.append_basic_block("sfc64_header")
        body = builder.append_basic_block("sfc64_body")
        done = builder.append_basic_block("sfc64_done")
        builder.branch(header)
        builder.position_at_end(header)
        p = builder.phi(i64)
        a, b, c, k = (builder.phi(vector) for _ in range(4))
        for phi, value in zip((p, a, b, c, k), (ir.Constant(i64, 0), *start)):
            phi.add_incoming(value, entry)
        builder.cbranch(builder.icmp_signed("<", p, steps), body, done)
        builder.position_at_end(body)
        output = builder.add(builder.add(a, b), k)
        rotated = builder.or_(builder.shl(c, splat(24)), builder.lshr(c, splat(40)))
        advanced = (
            builder.xor(b, builder.lshr(b, splat(11))),
            builder.add(c, builder.shl(c, splat(3))),
            builder.add(rotated, output),
            builder.add(k, splat(1)),
        )
        for lane in range(DARE_LANES):
            at = builder.add(p, builder.mul(stride, ir.Constant(i64, lane)))
            value = builder.extract_element(output, ir.Constant(ir.IntType(32), lane))
            builder.store(value, builder.gep(rows_start, [at]), align=8)
        following = builder.add(p, ir.Constant(i64, 1))
        for phi, value in zip((p, a, b, c, k), (following, *advanced)):
            phi.add_incoming(value, body)
        builder.branch(header)
        builder.position_at_end(done)
        for slot, value in zip(slots, (a, b, c, k)):
            builder.store(value, slot, align=8)
        return context.get_dummy_value()

    return sig, codegen


_jit = numba.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)
_inline = numba.njit(
    nogil=True, cache=True, error_model="numpy", boundscheck=False, inline="always"
)


@_jit
def _hardshrink(x, lam):
    """torch.hardshrink: +0.0 where −λ ≤ x ≤ λ, else x (λ < 0 keeps everything)."""
    return _ZERO if (x >= -lam) & (x <= lam) else x


@_jit
def _sign(x):
    """torch.sign: ±1, and +0.0 for ±0."""
    return _ONE if x > _ZERO else (_MINUS_ONE if x < _ZERO else _ZERO)


@_jit
def _bf16_to_f32(bits):
    return _u32_as_f32(np.uint32(np.uint32(bits) << np.uint32(16)))


@_jit
def _f32_to_bf16(v):
    """Round to nearest even, as torch (NaN: 0xFFFF, what torch's vectorised cast gives)."""
    u = np.uint32(_f32_as_u32(v))
    rounded = np.uint32(u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.uint16(0xFFFF) if nan else np.uint16(rounded >> np.uint32(16))


@_jit
def _bf16_nonfinite(bits):
    """1 if the bfloat16 bit pattern is NaN or Inf (every exponent bit set), else 0."""
    return np.uint32((np.uint32(bits) & np.uint32(0x7F80)) == np.uint32(0x7F80))


@_jit
def _f32_nonfinite(v):
    """1 if the float32 is NaN or Inf (every exponent bit set), else 0."""
    return np.uint32((_f32_as_u32(v) & np.uint32(0x7F800000)) == np.uint32(0x7F800000))


@_jit
def _load(address, bf16, start, count, dst):
    """Entries [start, start + count) of the array at ``address`` (bfloat16 bits or float32),
    widened to float32 into ``dst``. The dtype is a run-time flag, so every loop here is
    compiled once, not once per dtype."""
    if bf16:
        src = numba.carray(_u16_pointer(address + 2 * start), (count,))
        for j in range(count):
            dst[j] = _bf16_to_f32(src[j])
    else:
        src32 = numba.carray(_f32_pointer(address + 4 * start), (count,))
        for j in range(count):
            dst[j] = src32[j]


@_jit
def _load_checked(address, bf16, start, count, dst):
    """:func:`_load`, and whether any of the entries is NaN or Inf (1, else 0): every exponent
    bit set, tested on the stored bits while they are loaded anyway."""
    found = np.uint32(0)
    if bf16:
        src = numba.carray(_u16_pointer(address + 2 * start), (count,))
        for j in range(count):
            found |= _bf16_nonfinite(src[j])
            dst[j] = _bf16_to_f32(src[j])
    else:
        src32 = numba.carray(_f32_pointer(address + 4 * start), (count,))
        for j in range(count):
            found |= _f32_nonfinite(src32[j])
            dst[j] = src32[j]
    return np.int64(found != 0)


@_jit
def _emit_checked(address, bf16, start, count, src):
    """``src[:count]`` into entries [start, start + count) at ``address``, rounded to bfloat16
    or stored as float32, and whether any stored entry is NaN or Inf (1, else 0; checked after
    rounding: a float32 beyond bfloat16's range rounds to Inf)."""
    found = np.uint32(0)
    if bf16:
        dst = numba.carray(_u16_pointer(address + 2 * start), (count,))
        for j in range(count):
            h = _f32_to_bf16(src[j])
            found |= _bf16_nonfinite(h)
            dst[j] = h
    else:
        dst32 = numba.carray(_f32_pointer(address + 4 * start), (count,))
        for j in range(count):
            found |= _f32_nonfinite(src[j])
            dst32[j] = src[j]
    return np.int64(found != 0)


@_jit
def sfc64_fill(states, rows, steps):
    """:func:`_sfc64_lanes` for every group of DARE_LANES streams: ``states`` [g, 4,
    DARE_LANES] (uint64, advanced), ``rows`` [g · DARE_LANES, ≥ steps]: stream l's outputs in
    row l."""
    for g in range(states.shape[0]):
        _sfc64_lanes(states[g], rows[g * DARE_LANES :], steps, rows.shape[1])


@_jit
def _keep_value(half, limit):
    """DARE's float mask entry from 32 random bits (ops.dare_keep_block, operation for
    operation): 1 + u·2⁻²³ from the low 23 bits, then clamp((x − limit)·(−2²⁴), 0, 1)."""
    x = _u32_as_f32(np.uint32((half & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)))
    k = (x - limit) * _MINUS_2_24
    k = _ZERO if k < _ZERO else k
    return _ONE if k > _ONE else k


@_jit
def _add_row(acc, x, length, first, plain, w):
    """One step of ops._weighted_rows_sum over a tile: acc = x (· w) for the first row, then
    acc + x, or fma(x, w, acc) (torch's ``add_(x, alpha=w)``)."""
    if first:
        if plain:
            for j in range(length):
                acc[j] = x[j]
        else:
            for j in range(length):
                acc[j] = x[j] * w
    elif plain:
        for j in range(length):
            acc[j] = acc[j] + x[j]
    else:
        for j in range(length):
            acc[j] = _fma(x[j], w, acc[j])


@_jit
def merge_chunk(
    addresses, bf16_in, m, out_address, bf16_out, params, scalars, flags, states, lanes, block
):
    """One chunk of m positions. ``addresses``: base then experts (int64, pointing at the
    chunk's first entry; bfloat16 bits if ``bf16_in`` else float32); ``out_address``: m entries
    (bfloat16 bits if ``bf16_out`` else float32); ``params``/``scalars``/``flags``: see the
    P_/S_/F_ constants. Returns the NaN/Inf flags (FOUND_IN_INPUT: an input entry,
    FOUND_IN_RESULT: a stored result entry).

    DARE: the chunk is whole blocks of ``block`` entries (the last may be partial), each
    expert's random bits in a block one SFC64 stream; ``lanes[bk, i]`` is the stream of block
    bk and expert i (−1: it does not drop; no rows: no DARE), stream l's state is
    ``states[l // DARE_LANES, :, l % DARE_LANES]`` (uint64 a, b, c, counter). All streams of
    the chunk advance together, DARE_LANES in one vector (:func:`_sfc64_lanes`), so the
    blocks are merged a tile of each in turn.

    Each step is a straight loop over a tile (no data-dependent branches: LLVM vectorises
    them), in the order of the torch operations it replaces."""
    n = addresses.shape[0] - 1
    tau = np.empty((n, TILE), dtype=np.float32)
    work = np.empty((8, TILE), dtype=np.float32)
    raw = np.empty((states.shape[0] * DARE_LANES, TILE // 2), dtype=np.uint64)
    halves = raw.view(np.uint32)  # little-endian: entry j's 32 bits, low half first
    state = states.copy()
    bad_input = np.int64(0)
    bad_result = np.int64(0)
    if lanes.shape[0] == 0:
        none = np.full(n, -1, dtype=np.int64)
        for t0 in range(0, m, TILE):
            bad = _merge_tile(addresses, bf16_in, t0, min(TILE, m - t0), out_address, bf16_out,
                              params, scalars, flags, tau, work, halves, none)  # fmt: skip
            bad_input |= bad[0]
            bad_result |= bad[1]
    else:
        for t0 in range(0, min(block, m), TILE):
            # this tile's random bits of every stream (the first block is the longest)
            sfc64_fill(state, raw, (min(TILE, m - t0) + 1) // 2)
            for bk in range(lanes.shape[0]):
                first = bk * block + t0
                if first < m:
                    length = min(TILE, m - first, (bk + 1) * block - first)
                    bad = _merge_tile(addresses, bf16_in, first, length, out_address, bf16_out,
                                      params, scalars, flags, tau, work, halves, lanes[bk])  # fmt: skip
                    bad_input |= bad[0]
                    bad_result |= bad[1]
    return bad_input * FOUND_IN_INPUT + bad_result * FOUND_IN_RESULT


@_inline
def _merge_tile(
    addresses, bf16_in, t0, length, out_address, bf16_out, params, scalars, flags, tau, work,
    halves, lanes
):  # fmt: skip
    """merge_chunk's work on the tile of ``length`` positions from ``t0``; ``halves[lanes[i]]``:
    expert i's random bits for it (DARE). Returns whether it met NaN/Inf in an input and in
    a stored result (1 or 0 each). Inlined into merge_chunk (numba's IR inlining), as if
    written there."""
    n = tau.shape[0]
    b, x = work[0], work[7]
    band = flags[F_BAND] != 0
    bad_input = _load_checked(addresses[0], bf16_in, t0, length, b)
    for i in range(n):
        bad_input |= _load_checked(addresses[1 + i], bf16_in, t0, length, x)
        low, high = params[i, P_LOW], params[i, P_HIGH]
        row = tau[i]
        if band:  # breadcrumbs: trim below, then τ − hardshrink(τ, largest)
            for j in range(length):
                d = x[j] - b[j]
                row[j] = _hardshrink(d, low) - _hardshrink(d, high)
        else:
            for j in range(length):
                row[j] = _hardshrink(x[j] - b[j], low)
        limit = params[i, P_DARE_LIMIT]
        if limit != _ZERO:
            bits = halves[lanes[i]]
            for j in range(length):
                row[j] = row[j] * _keep_value(bits[j], limit)
            divisor = params[i, P_DARE_DIVISOR]
            if divisor != _ZERO:
                for j in range(length):
                    row[j] = row[j] / divisor
    if flags[F_KIND] == KIND_SUM:
        result = _sum_rows(tau, work, length, params, flags, scalars)
    elif n == 2:
        result = _elect_merge_two(tau, work, length, params, flags, scalars)
    else:
        result = _elect_merge(tau, work, length, params, flags, scalars)
    return bad_input, _emit_checked(out_address, bf16_out, t0, length, result)


@_jit
def sum_chunk(addresses, has_base, bf16_in, m, out_address, bf16_out, weights, scalars, flags):
    """methods._combine for one chunk of m positions: Σ_i w_i x_i without a base, else
    θ_b + λ Σ_i w_i (x_i − θ_b); the sum divided by Σ w_i where ``flags[F_SUM_DIVIDE]``.
    ``addresses``: the base (if ``has_base``) then the experts, as in :func:`merge_chunk`;
    ``weights``: float32, one per expert; ``scalars``: S_LAMBDA, S_TOTAL. Returns the NaN/Inf
    flags as :func:`merge_chunk` does. torch's operations in its order: the first term
    multiplied, the others added by ``add_(x, alpha=w)`` (an FMA), then ``div_``, then
    ``torch.add(θ_b, Σ, alpha=λ)`` (an FMA too)."""
    first = 1 if has_base else 0
    n = addresses.shape[0] - first
    work = np.empty((3, TILE), dtype=np.float32)
    b, x, acc = work[0], work[1], work[2]
    divide = flags[F_SUM_DIVIDE] != 0
    total, lam = scalars[S_TOTAL], scalars[S_LAMBDA]
    bad_input = np.int64(0)
    bad_result = np.int64(0)
    for t0 in range(0, m, TILE):
        length = min(TILE, m - t0)
        if has_base:
            bad_input |= _load_checked(addresses[0], bf16_in, t0, length, b)
        for i in range(n):
            bad_input |= _load_checked(addresses[first + i], bf16_in, t0, length, x)
            if has_base:
                for j in range(length):
                    x[j] = x[j] - b[j]
            _add_row(acc, x, length, i == 0, False, weights[i])
        if divide:
            for j in range(length):
                acc[j] = acc[j] / total
        if has_base:
            for j in range(length):
                acc[j] = _fma(acc[j], lam, b[j])
        bad_result |= _emit_checked(out_address, bf16_out, t0, length, acc)
    return bad_input * FOUND_IN_INPUT + bad_result * FOUND_IN_RESULT


@_jit
def _sum_rows(tau, work, length, params, flags, scalars):
    """θ_b + λ Σ_i w_i τ_i (÷ Σ w_i) for a tile, into work[1]: methods._sum_rows_into,
    operation for operation."""
    b, acc = work[0], work[1]
    if tau.shape[0] == 2:  # one loop for the common case, the same operations in order
        t0, t1 = tau[0], tau[1]
        w0, w1 = params[0, P_SUM_W], params[1, P_SUM_W]
        divide, scale = flags[F_SUM_DIVIDE] != 0, flags[F_SCALE] != 0
        total, lam = scalars[S_TOTAL], scalars[S_LAMBDA]
        for j in range(length):
            v = _fma(t1[j], w1, t0[j] * w0)
            if divide:
                v = v / total
            if scale:
                v = v * lam
            acc[j] = v + b[j]
        return acc
    for i in range(tau.shape[0]):  # weighted_sum multiplies the first row too
        _add_row(acc, tau[i], length, i == 0, False, params[i, P_SUM_W])
    if flags[F_SUM_DIVIDE] != 0:
        total = scalars[S_TOTAL]
        for j in range(length):
            acc[j] = acc[j] / total
    if flags[F_SCALE] != 0:
        lam = scalars[S_LAMBDA]
        for j in range(length):
            acc[j] = acc[j] * lam
    for j in range(length):
        acc[j] = acc[j] + b[j]
    return acc


@_jit
def _elect_merge_two(tau, work, length, params, flags, scalars):
    """:func:`_elect_merge` for two experts, every step of a position in one loop, without a
    branch on the options inside it (so LLVM vectorises it): a "plain" weight is 1, and
    x · 1, fma(y, 1, x) = x + y and a division by 1 change no bits, so the loop always
    multiplies and divides, and picks each option's value with a select."""
    b, merged = work[0], work[2]
    t0, t1 = tau[0], tau[1]
    count_votes = flags[F_VOTE_COUNT] != 0
    all_positive = flags[F_ALL_POSITIVE] != 0
    by_count = flags[F_DIVIDE_BY] == DIVIDE_COUNT
    by_weight = flags[F_DIVIDE_BY] == DIVIDE_WEIGHT_SUM
    vw0, vw1 = _weights_or_ones(params, P_VOTE_W, flags[F_VOTE_PLAIN])
    mw0, mw1 = _weights_or_ones(params, P_MERGE_W, flags[F_MERGE_PLAIN])
    dw0, dw1 = _weights_or_ones(params, P_DIVISOR_W, flags[F_DIVISOR_PLAIN])
    f0, f1 = params[0, P_FLIP], params[1, P_FLIP]  # 1 unless flags[F_ANY_FLIP]
    lam, min_w = scalars[S_LAMBDA], scalars[S_MIN_W]
    for j in range(length):
        x0, x1 = t0[j], t1[j]
        r0 = _sign(x0) if count_votes else x0
        r1 = _sign(x1) if count_votes else x1
        votes = _fma(r1, vw1, r0 * vw0)
        elected = _MINUS_ONE if votes < _ZERO else _ONE
        m0, m1 = x0 * elected * f0, x1 * elected * f1
        m0 = _ZERO if m0 < _ZERO else m0  # relu keeps −0.0
        m1 = _ZERO if m1 < _ZERO else m1
        total = _fma(m1, mw1, m0 * mw0) * elected
        a0 = _ONE if m0 > _ZERO else _ZERO
        a1 = _ONE if m1 > _ZERO else _ZERO
        count = a0 + a1
        weights = _fma(a1, dw1, a0 * dw0)
        if all_positive:
            weights = min_w if weights < min_w else weights
        else:
            weights = _ONE if weights == _ZERO else weights
        divisor = (_ONE if count < _ONE else count) if by_count else _ONE
        divisor = weights if by_weight else divisor
        merged[j] = _fma(total / divisor, lam, b[j])
    return merged


@_jit
def _weights_or_ones(params, column, plain):
    """The two experts' weights in ``column``, or 1 and 1 where ``plain``."""
    if plain != 0:
        return _ONE, _ONE
    return params[0, column], params[1, column]


@_jit
def _elect_merge(tau, work, length, params, flags, scalars):
    """θ_b + λ · disjoint_merge(elect_sign(τ)) for a tile, into work[2]: ops.elect_sign and
    ops.disjoint_merge_, operation for operation."""
    b, votes, merged, agreeing, divisor, x, agrees = (
        work[0],
        work[1],
        work[2],
        work[3],
        work[4],
        work[5],
        work[6],
    )
    elected = votes  # the votes are only needed for their sign
    n = tau.shape[0]
    count_votes, plain_votes = flags[F_VOTE_COUNT] != 0, flags[F_VOTE_PLAIN] != 0
    any_flip, plain_merge = flags[F_ANY_FLIP] != 0, flags[F_MERGE_PLAIN] != 0
    divide_by, plain_divisor = flags[F_DIVIDE_BY], flags[F_DIVISOR_PLAIN] != 0
    for i in range(n):
        row = tau[i]
        if count_votes:
            for j in range(length):
                x[j] = _sign(row[j])
            _add_row(votes, x, length, i == 0, plain_votes, params[i, P_VOTE_W])
        else:
            _add_row(votes, row, length, i == 0, plain_votes, params[i, P_VOTE_W])
    for j in range(length):  # sign(votes) + 0.5, signed again: −1, or +1 for ties
        elected[j] = _MINUS_ONE if votes[j] < _ZERO else _ONE
    for i in range(n):
        row = tau[i]
        flip = params[i, P_FLIP]
        for j in range(length):
            mag = row[j] * elected[j]
            if any_flip:
                mag = mag * flip
            x[j] = _ZERO if mag < _ZERO else mag  # relu keeps −0.0
        _add_row(merged, x, length, i == 0, plain_merge, params[i, P_MERGE_W])
        if divide_by != DIVIDE_NONE:
            for j in range(length):
                agrees[j] = _ONE if x[j] > _ZERO else _ZERO
            if divide_by == DIVIDE_COUNT:
                _add_row(agreeing, agrees, length, i == 0, True, _ONE)
            else:
                _add_row(divisor, agrees, length, i == 0, plain_divisor, params[i, P_DIVISOR_W])
    for j in range(length):
        merged[j] = merged[j] * elected[j]
    if divide_by == DIVIDE_COUNT:
        for j in range(length):
            merged[j] = merged[j] / (_ONE if agreeing[j] < _ONE else agreeing[j])
    elif divide_by == DIVIDE_WEIGHT_SUM:
        if flags[F_ALL_POSITIVE] != 0:
            min_w = scalars[S_MIN_W]
            for j in range(length):
                merged[j] = merged[j] / (min_w if divisor[j] < min_w else divisor[j])
        else:
            for j in range(length):
                merged[j] = merged[j] / (_ONE if divisor[j] == _ZERO else divisor[j])
    lam = scalars[S_LAMBDA]
    for j in range(length):
        merged[j] = _fma(merged[j], lam, b[j])
    return merged


_F32_INF_BITS = 0x7F800000


@numba.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False, fastmath={"reassoc"})
def _band_tile(expert, base, length, lowest, highest, magnitudes, inside):
    """|τ| = |expert − base| into ``magnitudes`` and 1 into ``inside`` where lowest ≤ |τ| ≤
    highest (the band); returns how many entries lie in the band and above it (NaN counts as
    above, as its bits do). The counts are float sums, exact below 2²⁴: ``reassoc`` lets LLVM
    add them up in vector lanes (it changes nothing else here: one subtraction per entry)."""
    in_band = _ZERO
    above = _ZERO
    for j in range(length):
        v = abs(expert[j] - base[j])
        magnitudes[j] = v
        keep = (v >= lowest) & (v <= highest)
        in_band += _ONE if keep else _ZERO
        above += _ZERO if v <= highest else _ONE
        inside[j] = np.uint8(keep)
    return np.int64(in_band), np.int64(above)


_GROUPED = 1024  # entries per tile of a histogram pass (a multiple of 8 and of the sample run)


@_jit
def _load_sample(address, bf16, m, first, count, step, run, dst):
    """Sampled entries ``first`` … ``first + count − 1`` of m (all entries for ``step`` 1,
    else runs of ``run`` entries, one from every ``run · step``, at the offset ops.run_offsets
    gives, the first ``run`` of an incomplete last period; ``first`` a multiple of ``run``),
    widened to float32 into ``dst``."""
    if step == 1:
        _load(address, bf16, first, count, dst)
        return
    for r in range(0, count, run):
        start = _run_start((first + r) // run, m, step, run)
        _load(address, bf16, start, min(run, count - r, m - start), dst[r:])


@_inline
def _run_start(p, m, step, run):
    """Where the sampled run of period ``p`` starts among the m entries (ops._sample_runs)."""
    start = p * run * step
    if p < m // (run * step):  # a complete period: the run ops.run_offsets picks
        start += ((p * RUN_HASH) >> 16) % step * run
    return start


@_jit
def _prefetch_sample(address, bf16, m, first, count, step, run):
    """Start loading the cache lines :func:`_load_sample` will read for the same arguments
    (``step`` > 1): each run is a line or two at a hashed offset, not next to the last run's,
    so the CPU's own prefetchers do not fetch them ahead."""
    width = 2 if bf16 else 4
    for r in range(0, count, run):
        start = _run_start((first + r) // run, m, step, run)
        n = min(run, count - r, m - start)
        if n <= 0:
            break
        lo = address + width * start
        hi = lo + width * n - 1
        while lo <= hi:
            _prefetch(lo)
            lo += 64
        _prefetch(hi)


@_jit
def tau_abs_histograms(
    addresses, bf16, m, step, run, experts, top_bits, lows, widths, collect, counts, values, filled
):
    """Counts of :class:`ops.KthLargestAbs` passes over |τ_e| = |θ_e − θ_b| (float32 bits),
    one per row of ``counts``, for every ``step``-th of the m entries at ``addresses`` (base
    first, then the experts: bfloat16 bits if ``bf16``, else float32). Pass k counts expert
    ``experts[k]``: with ``top_bits[k]`` its top 16 bits (2¹⁵ bins), else ``bits − lows[k]``
    clamped to [0, widths[k] + 1]; with ``collect[k]`` only the entries below and above that
    band (into bins 0 and 1), the bit patterns inside it going to ``values[k, filled[k]]``
    (``filled[k]`` counts them all, even past the row's end, where none is stored). The base is
    read once for all passes. With ``step`` > 1 the pass reads runs of ``run`` entries, one
    every ``run · step`` (ops._sample_runs)."""
    period = run * step
    total = m if step == 1 else m // period * run + min(run, m % period)
    base = np.empty(_GROUPED, dtype=np.float32)
    expert = np.empty(_GROUPED, dtype=np.float32)
    magnitudes = np.empty(_GROUPED, dtype=np.float32)
    inside = np.zeros(_GROUPED, dtype=np.uint8)
    groups = inside.view(np.uint64)
    n_passes = experts.shape[0]
    ends = np.zeros((n_passes, 2), dtype=np.int64)  # below, above the band
    for t0 in range(0, total, _GROUPED):
        length = min(_GROUPED, total - t0)
        if step > 1 and t0 + _GROUPED < total:  # the next tile's runs, while this one counts
            after = min(_GROUPED, total - t0 - _GROUPED)
            _prefetch_sample(addresses[0], bf16, m, t0 + _GROUPED, after, step, run)
            for k in range(n_passes):
                if k == 0 or experts[k] != experts[k - 1]:
                    e = addresses[1 + experts[k]]
                    _prefetch_sample(e, bf16, m, t0 + _GROUPED, after, step, run)
        _load_sample(addresses[0], bf16, m, t0, length, step, run, base)
        loaded = -1
        for k in range(n_passes):
            if experts[k] != loaded:
                loaded = experts[k]
                _load_sample(addresses[1 + loaded], bf16, m, t0, length, step, run, expert)
            low = lows[k]
            row = counts[k]
            if top_bits[k]:
                for j in range(length):
                    bits = _f32_as_u32(expert[j] - base[j]) & np.uint32(0x7FFFFFFF)
                    row[bits >> np.uint32(16)] += 1
                continue
            highest = low + widths[k]  # the band: bits low + 1 … highest, bins 1 … width
            if highest >= _F32_INF_BITS:  # a band reaching Inf/NaN (only with such inputs)
                for j in range(length):
                    v = np.int64(_f32_as_u32(expert[j] - base[j]) & np.uint32(0x7FFFFFFF)) - low
                    if not collect[k]:
                        row[min(max(v, 0), widths[k] + 1)] += 1
                    elif v <= 0:
                        ends[k, 0] += 1
                    elif v > widths[k]:
                        ends[k, 1] += 1
                    else:
                        at = filled[k]
                        if at < values.shape[1]:
                            values[k, at] = np.int32(v + low)
                        filled[k] = at + 1
                continue
            # Most entries fall outside the band: a vectorised loop counts the entries in and
            # above it and flags those in it (a byte each), and a second loop visits only the
            # flagged bytes, eight at a time (a data-dependent branch per entry, or an
            # increment of the end bins for each, cost several times more).
            n_in, n_above = _band_tile(
                expert,
                base,
                length,
                _u32_as_f32(np.uint32(low + 1)),
                _u32_as_f32(np.uint32(highest)),
                magnitudes,
                inside,
            )
            for j in range(length, _GROUPED):
                inside[j] = 0
            if n_in != 0 and collect[k]:  # the band's bit patterns, kept while there is room
                kept, at = values[k], filled[k]
                for g in range(_GROUPED // 8):
                    flagged = groups[g]
                    while flagged != 0:  # each flagged byte, by its lowest set bit
                        j = 8 * g + np.int64(_trailing_zeros(flagged) >> np.uint64(3))
                        if at < kept.shape[0]:
                            kept[at] = np.int32(_f32_as_u32(magnitudes[j]))
                        at += 1
                        flagged &= flagged - np.uint64(1)
                filled[k] = at
            elif n_in != 0:
                for g in range(_GROUPED // 8):
                    flagged = groups[g]
                    while flagged != 0:
                        j = 8 * g + np.int64(_trailing_zeros(flagged) >> np.uint64(3))
                        row[np.int64(_f32_as_u32(magnitudes[j])) - low] += 1
                        flagged &= flagged - np.uint64(1)
            ends[k, 0] += length - n_in - n_above
            ends[k, 1] += n_above
    for k in range(n_passes):
        if not top_bits[k]:
            counts[k, 0] += ends[k, 0]
            counts[k, 1 if collect[k] else widths[k] + 1] += ends[k, 1]


@_jit
def kth_largest_bits(values, k):
    """ops._kth_largest_bits for one int32 array of non-negative bit patterns (1 ≤ k ≤ its
    size): the same two radix steps, counted in loops."""
    first, last = values.min() >> 16, values.max() >> 16
    buckets = np.zeros(last - first + 1, dtype=np.int64)
    for v in values:
        buckets[(v >> 16) - first] += 1
    bucket, rank = locate_from_top(buckets, k)
    lows = np.zeros(1 << 16, dtype=np.int64)
    for v in values:
        if (v >> 16) - first == bucket:
            lows[v & 0xFFFF] += 1
    low, _ = locate_from_top(lows, rank)
    return ((first + bucket) << 16) | low


@_jit
def locate_from_top(counts, k):
    """ops._locate: the bin holding the k-th largest item, and its rank inside it."""
    above = 0
    for i in range(counts.shape[0] - 1, -1, -1):
        if above + counts[i] >= k:
            return i, k - above
        above += counts[i]
    return 0, k - above


@_jit
def all_finite(address, bf16, m):
    """No NaN or Inf among the m entries at ``address`` (bfloat16 bits or float32): no entry
    with every exponent bit set."""
    found = np.uint32(0)
    if bf16:
        src = numba.carray(_u16_pointer(address), (m,))
        for j in range(m):
            found |= _bf16_nonfinite(src[j])
    else:
        src32 = numba.carray(_f32_pointer(address), (m,))
        for j in range(m):
            found |= _f32_nonfinite(src32[j])
    return found == 0
