"""The Triton path of exact top-k (ds4/kernels/topk.py holds the spec, its torch reference and the entry point).

A row is cut into groups of G entries (G chosen so a full-length row has >= groups_per_k * k groups), groups
into coarse groups of C (so it has >= units_per_k * k of those), and, when rows are few, into splits that
separate programs work on. One launch per call when each row has one program, two when rows are split (on
sm_90+ the count launch starts while the scan's last programs run and waits for them on the device:
programmatic dependent launch); no program ever waits on another, and nothing but the shapes sizes the
workspaces (no host sync, graph-safe).
  1. scan (rows x splits): one read of the row in 16-byte loads; each group's and each coarse group's
     maximum order key go to a workspace. Nothing else: the read runs at copy speed.
  2. count (rows x count splits; the scan program itself when a row has one): every program derives the
     row's threshold tau, a lower bound of the k-th largest coarse maximum, from two histograms of them
     placed linearly in their range or from a radix select over them. Each maximum is a distinct entry, so
     at least k entries are >= tau; the top k are among them, and they can only sit in groups whose maximum
     reaches tau. The program lists its split's hot groups (or only the groups of the coarse groups that
     reach tau, found from the same load of the coarse maxima as tau), re-reads only those, and writes
     their entries >= tau in column order to its split's own candidate area (CAP slots; more are only
     counted).
  3. finish, by the row's last split to arrive (an atomic count): the splits' areas are joined into
     one column-ordered block (each slot's split found by a running maximum over the splits' first
     slots), then an exact radix select over it in registers (and a second one over column numbers
     when the k-th value has more ties than places), written out in column order by a prefix sum.
     When the candidates did not fit in CAP (tie-dominated rows, for instance), an exact radix select
     over the whole row instead (4 byte passes, then an in-order gather that takes the lowest-column
     ties). An overflowing buffer only changes which path runs, never the result.
A row of one program no longer than the candidate block (CAP entries; at k 512 the indexer's row of a context up
to 4096 tokens, however wide the block tables make the launch) skips steps 1-2: it is its own candidate set, so
the program reads it once into registers and selects as step 3 does, with no maxima, workspaces or second read.
Radix selects use 5-bit digits (a 32-bin tl.histogram costs a third of a 256-bin one per bit), read
digits that all live keys share off the largest key, and stop at the first digit whose threshold bin
holds exactly the keys still wanted, so a select over spread-out values takes two or three histograms.

Two row layouts, each with its own settings (`Layout`): rows split over several programs (batches of
fewer rows than a wave of programs), and rows of one program each, where the scan program counts and
selects too while the row's maxima are fresh. That program has more of its work after the read, so it
takes more warps and a register cap that keeps `programs_per_sm` of them on an SM, and it keeps its loads
in flight with a larger tile rather than a second tile in registers. Its first wave starts staggered:
program p waits (p // SMs) times the time the memory takes, at its peak rate, to deliver one row to every
SM, so that the programs sharing an SM read and count out of step (some read while others count) instead
of all reading and then all counting while the memory idles.

`settings_for(device)` gives the chosen settings, completed from what the device reports (SM count,
register file, memory clock and bus width, compute capability); `launch` runs with any `Settings`, which
is how the tests reach every path at small sizes and how `ds4 bench kernels --all-tiles` sweeps variants.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ds4.kernels._device import cuda_index, launches_dependents_early, num_sms


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the programs of one row layout read and count."""

    tile: int  # entries per scan step
    prefetch: bool  # the next tile's load is issued before this one is reduced
    tau_linear: bool  # tau from two histograms placed linearly in the coarse maxima's range (else a radix select)
    coarse_list: bool  # hot groups looked for only in the coarse groups that reach tau (fewer maxima read)
    warps: int  # of the launch that scans these rows
    max_registers: int | None = None  # per thread, of that launch (None: the compiler's choice)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a launch is planned from. The defaults are the chosen values; `settings_for` fills in what
    comes from the device (sms, one_program.max_registers, early_count_launch, stagger_ns_per_byte)."""

    sms: int  # a wave is programs_per_sm * sms programs
    programs_per_sm: int = 4  # a batch of fewer rows than programs_per_sm * sms (a wave) has its rows split
    split: Layout = Layout(tile=4096, prefetch=True, tau_linear=True, coarse_list=False, warps=4)
    one_program: Layout = Layout(tile=8192, prefetch=False, tau_linear=False, coarse_list=True, warps=8)
    count_warps: int = 8  # count programs are latency-bound chains of block-wide steps
    count_merge: int = 2  # scan splits per count program (fewer programs join each row's candidates)
    groups_per_k: int = 16  # a full row has >= 16k groups: few entries to re-read per hot group
    units_per_k: int = 4  # tau from >= 4k coarse maxima: candidates little more than k on spread-out data
    cap_per_k: int = 2  # candidate slots per wanted entry
    gm_block: int = 2048  # group maxima per listing step
    gather: int = 1024  # entries per candidate-gather step
    unit_block: int = 2048  # coarse maxima held in registers for tau (more are streamed, once per digit)
    early_count_launch: bool = False  # programmatic dependent launch of the count launch (sm_90+)
    stagger_ns_per_byte: float = 0.0  # the one-program first wave's offsets per byte of a row and SM (0: none)


@functools.cache
def _cuda_settings(index: int, sms: int, early_count_launch: bool) -> Settings:
    reported = triton.runtime.driver.active.utils.get_device_properties(index)
    chosen = Settings(sms=sms)
    one_program = chosen.one_program
    registers = reported.get("max_num_regs", 0)  # a block's share of the register file: an SM's on sm_80-sm_120
    if registers:
        cap = registers // (chosen.programs_per_sm * one_program.warps * 32)
        one_program = dataclasses.replace(one_program, max_registers=cap)
    peak_bytes_per_s = 2 * reported.get("mem_clock_rate", 0) * 1e3 * reported.get("mem_bus_width", 0) / 8
    return dataclasses.replace(
        chosen,
        one_program=one_program,
        early_count_launch=early_count_launch,
        stagger_ns_per_byte=1e9 / peak_bytes_per_s if peak_bytes_per_s > 0 else 0.0,
    )


def settings_for(device: torch.device) -> Settings:
    """The chosen settings on `device`. The CPU interpreter runs programs one after another: no register cap,
    early launch or stagger there."""
    if device.type != "cuda":
        return Settings(sms=num_sms(device))
    index = cuda_index(device)
    return _cuda_settings(index, num_sms(device), launches_dependents_early(device))


MAX_GROUP = 256
MIN_CAP = 256
RADIX_BITS = tl.constexpr(5)
TAU_HISTS = tl.constexpr(3)  # tau is precise to 15 key bits below the ones all units share
EXACT_TILE = tl.constexpr(1024)  # the rare whole-row fallback's step: small, so it costs no registers elsewhere
SPLIT_BLOCK = tl.constexpr(1024)  # split counts per step of the finish's join
INT_MIN = tl.constexpr(-(2**31))
INT_MAX = tl.constexpr(2**31 - 1)
POS_INF_KEY = tl.constexpr(0x7F800000)  # order keys of +inf and -inf
NEG_INF_KEY = tl.constexpr(-0x7F800001)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _order_key(x):
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    return tl.where(x != x, INT_MAX, key)


@triton.jit
def _digit(u, p: tl.constexpr, BITS: tl.constexpr):
    """Digit p, counted from the top, of the unsigned-order key u (key ^ INT_MIN): BITS wide, the last narrower."""
    if 32 - BITS * (p + 1) >= 0:
        d = (u >> (32 - BITS * (p + 1))) & (2**BITS - 1)
    else:
        d = u & (2 ** (32 - BITS * p) - 1)
    return d


@triton.jit
def _digit_shift(p: tl.constexpr, BITS: tl.constexpr):
    """Where digit p starts: the bit its lowest bit sits at."""
    shift: tl.constexpr = 32 - BITS * (p + 1) if 32 - BITS * (p + 1) >= 0 else 0
    return shift


@triton.jit
def _above_digit(u, p: tl.constexpr, BITS: tl.constexpr):
    """The bits of u above digit p (a key's radix prefix before pass p)."""
    return u >> (32 - BITS * p)


@triton.jit
def _bin_counts(count_a, max_a, min_a, count_b, max_b, min_b):
    return count_a + count_b, tl.maximum(max_a, max_b), tl.minimum(min_a, min_b)


@triton.jit
def _max_and_min(max_a, min_a, max_b, min_b):
    return tl.maximum(max_a, max_b), tl.minimum(min_a, min_b)


@triton.jit
def _count_max_min_min(count_a, max_a, min_a, other_min_a, count_b, max_b, min_b, other_min_b):
    return count_a + count_b, tl.maximum(max_a, max_b), tl.minimum(min_a, min_b), tl.minimum(other_min_a, other_min_b)


@triton.jit
def _threshold_bin(hist, rank):
    """Highest bin b whose count together with all higher bins reaches `rank`, the count above b, and the
    count at or above b. Those counts fall with the bin, so b is one less than the number of bins that
    reach `rank`, the count above b is the largest that does not, and the count at or above b the
    smallest that does (one reduction for all three)."""
    at_or_above = tl.cumsum(hist, axis=0, reverse=True)
    reach = at_or_above >= rank
    n_reach, above, at = tl.reduce(
        (reach.to(tl.int32), tl.where(reach, 0, at_or_above), tl.where(reach, at_or_above, INT_MAX)), 0, _bin_counts
    )
    return n_reach - 1, above, at


@triton.jit
def _running_count(flags):
    """Inclusive prefix sum of a 1-D int32 block (a slot for each flagged entry). Summed first within runs of
    four, then over the runs: a quarter of the cross-thread steps of tl.cumsum over the whole block."""
    N: tl.constexpr = flags.shape[0]
    R: tl.constexpr = 4 if N >= 4 else 1
    runs = tl.reshape(flags, [N // R, R])
    run_totals = tl.sum(runs, axis=1)
    before = tl.cumsum(run_totals, axis=0) - run_totals
    return tl.reshape(before[:, None] + tl.cumsum(runs, axis=1), [N])


@triton.jit
def _radix_select(keys, live, rank, BITS: tl.constexpr, HISTS: tl.constexpr):
    """Radix select over keys[live], BITS per digit, with at most HISTS histogram passes: the largest t of
    the form (leading digits of a key, zeros below) with at least `rank` live keys >= t, how many live keys
    exceed t, and whether it settled. Digits on which all live keys agree are read off the largest key
    without a histogram, and the select settles as soon as exactly `rank` live keys reach a digit's bin:
    then exactly `rank` live keys are >= t (and the count above t is not computed). Otherwise, with HISTS >=
    the digit count, t is exactly the rank-th largest live key."""
    hi, lo = tl.reduce((tl.where(live, keys, INT_MIN), tl.where(live, keys, INT_MAX)), 0, _max_and_min)
    differ = hi ^ lo  # the bits above its highest set bit are shared by every live key
    hi_u = hi ^ INT_MIN
    u = keys ^ INT_MIN
    prefix = hi_u * 0
    above = hi_u * 0
    hists = hi_u * 0
    settled = hi_u * 0
    for p in tl.static_range((32 + BITS - 1) // BITS):
        if settled == 0:
            if (differ >> _digit_shift(p, BITS)) == 0:
                prefix = prefix | (_digit(hi_u, p, BITS) << _digit_shift(p, BITS))
            elif hists < HISTS:
                match = live
                if p > 0:
                    match = live & (_above_digit(u, p, BITS) == _above_digit(prefix, p, BITS))
                hist = tl.histogram(_digit(u, p, BITS), 2**BITS, mask=match)
                b, more, at = _threshold_bin(hist, rank - above)
                prefix = prefix | (b << _digit_shift(p, BITS))
                settled = (at == rank - above).to(tl.int32)
                above += more
                hists += 1
    return prefix ^ INT_MIN, above, settled


@triton.jit
def _linear_threshold(keys, live, rank, BITS: tl.constexpr):
    """A t with at least `rank` live keys >= t, from two histograms of keys placed linearly between the
    live finite keys' extremes (2 * BITS bits of that range; keys outside it are clamped to its ends):
    the smallest live key in the finest bin that, with all above it, holds `rank` keys. A key's bin never
    falls as the key grows, so every key in those bins is >= t. Cheaper than a radix select when digits
    far from the data's spread (the exponent's) would cost a histogram each. The range starts at the smallest
    non-negative key when at least `rank` keys are non-negative: the keys of -1.0 and 1.0 lie about 2^31 apart,
    those of 1.0 and 2.0 only 2^23, so a range across both signs would leave a few bins to the keys that
    matter."""
    NB: tl.constexpr = 2**BITS
    finite = live & (keys > NEG_INF_KEY) & (keys < POS_INF_KEY)
    n_nonneg, hi, lo, lo_nonneg = tl.reduce(
        (
            (live & (keys >= 0)).to(tl.int32),
            tl.where(finite, keys, INT_MIN),
            tl.where(finite, keys, INT_MAX),
            tl.where(finite & (keys >= 0), keys, INT_MAX),
        ),
        0,
        _count_max_min_min,
    )
    lo = tl.where(n_nonneg >= rank, lo_nonneg, lo)
    lo = tl.minimum(lo, hi).to(tl.float32)
    scale = (NB * NB) / (tl.maximum(hi.to(tl.float32) - lo, 0.0) + 1.0)
    place = tl.minimum(tl.maximum((keys.to(tl.float32) - lo) * scale, 0.0), NB * NB - 1).to(tl.int32)
    b, above, _ = _threshold_bin(tl.histogram(place >> BITS, NB, mask=live), rank)
    fine = tl.histogram(place & (NB - 1), NB, mask=live & ((place >> BITS) == b))
    cut = b * NB + _threshold_bin(fine, rank - above)[0]
    return tl.min(tl.where(live & (place >= cut), keys, INT_MAX), axis=0)


@triton.jit
def _row_length(lengths_ptr, row, n_cols):
    return tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), n_cols)


@triton.jit
def _row_scores(scores_ptr, row, stride_row, VEC: tl.constexpr):
    """The row's base pointer; VEC promises 16-byte aligned rows, so whole tiles load as 16-byte vectors."""
    offset = row.to(tl.int64) * stride_row
    if VEC:
        offset = tl.multiple_of(offset, 4)
    return scores_ptr + offset


@triton.jit
def _tile_scores(row_scores, off, limit, G: tl.constexpr, TILE: tl.constexpr, MASKED: tl.constexpr = True):
    """The scores of the tile at column `off` as [TILE // G, G] (one group a row), -inf from column `limit` on
    (not MASKED: the tile is whole, and loads without a mask to fill or test)."""
    cols = off + tl.arange(0, TILE // G)[:, None] * G + tl.arange(0, G)[None, :]
    if MASKED:
        return tl.load(row_scores + cols, mask=cols < limit, other=float("-inf"))
    return tl.load(row_scores + cols)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _group_max_keys(x):
    """The order key of each row of x's largest entry: the key of a NaN-propagating float maximum, which is the
    largest key (keys rise with the value, NaN's is the largest, and -0.0 and +0.0 share one), at one
    instruction an entry instead of a key each."""
    return _order_key(tl.reduce(x, 1, _nan_max))


@triton.jit
def _store_maxima(
    row_gm, row_cm, t, gmax, length, G: tl.constexpr, C: tl.constexpr, TILE: tl.constexpr, MASKED: tl.constexpr
):
    """Stores tile t's group maxima and (C > 1) the maxima of its coarse groups of C groups."""
    group = t * (TILE // G) + tl.arange(0, TILE // G)
    coarse = t * (TILE // (G * C)) + tl.arange(0, TILE // (G * C))
    if MASKED:
        tl.store(row_gm + group, gmax, mask=group * G < length)
    else:
        tl.store(row_gm + group, gmax)
    if C > 1:
        cmax = tl.max(tl.reshape(gmax, [TILE // (G * C), C]), axis=1)
        if MASKED:
            tl.store(row_cm + coarse, cmax, mask=coarse * (G * C) < length)
        else:
            tl.store(row_cm + coarse, cmax)


@triton.jit
def _scan_split(
    row_scores,
    row_gm,
    row_cm,
    length,
    first,
    tiles_per_split,
    G: tl.constexpr,
    C: tl.constexpr,
    TILE: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Step 1 over tiles [first, first + tiles_per_split) of a row: stores the group and coarse maxima.
    PREFETCH: the next tile's load is issued before this one is reduced."""
    end = tl.maximum(first, tl.minimum(first + tiles_per_split, (length + TILE - 1) // TILE))
    full = tl.minimum(end, tl.maximum(first, length // TILE))
    if PREFETCH:
        if first < full:  # the last whole tile is loaded twice rather than a tile past the row (or a mask) once
            ahead = _tile_scores(row_scores, first * TILE, 0, G, TILE, False)
            for t in range(first, full):
                x = ahead
                ahead = _tile_scores(row_scores, tl.minimum(t + 1, full - 1) * TILE, 0, G, TILE, False)
                _store_maxima(row_gm, row_cm, t, _group_max_keys(x), length, G, C, TILE, False)
    else:
        for t in range(first, full):
            x = _tile_scores(row_scores, t * TILE, 0, G, TILE, False)
            _store_maxima(row_gm, row_cm, t, _group_max_keys(x), length, G, C, TILE, False)
    if full < end:
        x = _tile_scores(row_scores, full * TILE, length, G, TILE)  # a group's entries past the row are -inf
        _store_maxima(row_gm, row_cm, full, _group_max_keys(x), length, G, C, TILE, True)


@triton.jit
def _row_tau(
    row_gm,
    cm_offset,
    length,
    k,
    G: tl.constexpr,
    C: tl.constexpr,
    UNIT_BLOCK: tl.constexpr,
    TAU_LINEAR: tl.constexpr,
):
    """The row's collection threshold: a lower bound (TAU_HISTS digits precise) of the k-th largest of the
    row's coarse maxima (at row_gm + cm_offset; the group maxima when the row has k coarse groups or fewer).
    Each maximum is a distinct entry, so at least k entries reach it; INT_MIN when even the groups are k or
    fewer."""
    n_units = (length + G - 1) // G
    units = row_gm
    if C > 1:
        n_coarse = (length + G * C - 1) // (G * C)
        if n_coarse > k:
            n_units = n_coarse
            units = row_gm + cm_offset
    tau = n_units * 0 + INT_MIN
    if n_units > k:
        if n_units <= UNIT_BLOCK:
            u = tl.arange(0, UNIT_BLOCK)
            real = u < n_units
            unit_keys = tl.load(units + u, mask=real, other=INT_MIN)
            if TAU_LINEAR:
                tau = _linear_threshold(unit_keys, real, k, RADIX_BITS)
            else:
                tau = _radix_select(unit_keys, real, k, RADIX_BITS, TAU_HISTS)[0]
        else:  # rows of more than UNIT_BLOCK units: one pass over them per digit, no digit skipped
            prefix = tau * 0
            above = tau * 0
            for p in tl.static_range(TAU_HISTS):
                hist = tl.zeros([2**RADIX_BITS], dtype=tl.int32)
                for u0 in range(0, n_units, UNIT_BLOCK):
                    u = u0 + tl.arange(0, UNIT_BLOCK)
                    real = u < n_units
                    key_u = tl.load(units + u, mask=real, other=INT_MIN) ^ INT_MIN
                    match = real
                    if p > 0:
                        match = real & (_above_digit(key_u, p, RADIX_BITS) == _above_digit(prefix, p, RADIX_BITS))
                    hist += tl.histogram(_digit(key_u, p, RADIX_BITS), 2**RADIX_BITS, mask=match)
                b, more, _ = _threshold_bin(hist, k - above)
                above += more
                prefix = prefix | (b << _digit_shift(p, RADIX_BITS))
            tau = prefix ^ INT_MIN
    return tau


@triton.jit
def _list_hot_groups(row_gm, hot_list, g_first, g_end, tau, first_block, GM_BLOCK: tl.constexpr):
    """Writes the numbers of the groups in [g_first, g_end) whose maximum reaches tau, ascending, to
    hot_list[0:]; returns how many there are. first_block: the maxima of the first GM_BLOCK groups, loaded
    by the caller before tau was known."""
    g = g_first + tl.arange(0, GM_BLOCK)
    hot = (g < g_end) & (first_block >= tau)
    tl.store(hot_list + _running_count(hot.to(tl.int32)) - 1, g, mask=hot)
    hot_count = tl.sum(hot.to(tl.int32), axis=0)
    for g0 in range(g_first + GM_BLOCK, g_end, GM_BLOCK):
        g = g0 + tl.arange(0, GM_BLOCK)
        real = g < g_end
        hot = real & (tl.load(row_gm + g, mask=real, other=INT_MIN) >= tau)
        slot = hot_count + _running_count(hot.to(tl.int32)) - 1
        tl.store(hot_list + slot, g, mask=hot)
        hot_count += tl.sum(hot.to(tl.int32), axis=0)
    return hot_count


@triton.jit
def _list_hot_groups_by_coarse(
    row_gm, row_cm, hot_list, g_first, g_end, n_coarse, tau, C: tl.constexpr, GM_BLOCK: tl.constexpr
):
    """_list_hot_groups reading fewer maxima: a group's maximum is at most its coarse group's, so only the
    groups of coarse groups that reach tau are checked. The hot coarse groups' numbers go to the coarse
    maxima's unused tail (row_cm[n_coarse:], each split at its own offset; the row holds as many groups as
    slots, at least twice its coarse groups). Splits start on a coarse group's boundary."""
    c_first = g_first // C
    c_end = (g_end + C - 1) // C
    hot_coarse = row_cm + n_coarse + c_first
    n_hot = c_first * 0
    for c0 in range(c_first, c_end, GM_BLOCK):
        c = c0 + tl.arange(0, GM_BLOCK)
        real = c < c_end
        hot = real & (tl.load(row_cm + c, mask=real, other=INT_MIN) >= tau)
        tl.store(hot_coarse + n_hot + _running_count(hot.to(tl.int32)) - 1, c, mask=hot)
        n_hot += tl.sum(hot.to(tl.int32), axis=0)
    tl.debug_barrier()
    return _list_groups_of_hot_coarse(row_gm, hot_list, hot_coarse, n_hot, g_end, tau, C, GM_BLOCK)


@triton.jit
def _list_groups_of_hot_coarse(
    row_gm, hot_list, hot_coarse, n_hot, g_end, tau, C: tl.constexpr, GM_BLOCK: tl.constexpr
):
    """Lists, ascending, the groups below g_end whose maximum reaches tau among the n_hot coarse groups
    numbered at hot_coarse (ascending); returns how many there are."""
    STEP: tl.constexpr = GM_BLOCK // C
    j = tl.arange(0, STEP)
    hot_count = n_hot * 0
    for h0 in range(0, n_hot, STEP):
        coarse = tl.load(hot_coarse + h0 + j, mask=h0 + j < n_hot, other=0)
        g = coarse[:, None] * C + tl.arange(0, C)[None, :]
        real = (h0 + j < n_hot)[:, None] & (g < g_end)
        hot = tl.reshape(real & (tl.load(row_gm + g, mask=real, other=INT_MIN) >= tau), [GM_BLOCK])
        slot = hot_count + _running_count(hot.to(tl.int32)) - 1
        tl.store(hot_list + slot, tl.reshape(g, [GM_BLOCK]), mask=hot)
        hot_count += tl.sum(hot.to(tl.int32), axis=0)
    return hot_count


@triton.jit
def _row_tau_and_hot_groups(
    row_gm,
    cm_offset,
    hot_list,
    length,
    k,
    G: tl.constexpr,
    C: tl.constexpr,
    UNIT_BLOCK: tl.constexpr,
    GM_BLOCK: tl.constexpr,
    TAU_LINEAR: tl.constexpr,
):
    """tau and the hot groups of a whole row (_row_tau, then _list_hot_groups_by_coarse) with one load of the
    coarse maxima when they fit in a block: tau and the hot coarse groups both come from it."""
    row_cm = row_gm + cm_offset
    n_groups = (length + G - 1) // G
    n_coarse = (length + G * C - 1) // (G * C)
    tau = n_coarse * 0
    hot_count = n_coarse * 0
    if n_coarse > k and n_coarse <= UNIT_BLOCK:
        u = tl.arange(0, UNIT_BLOCK)
        real = u < n_coarse
        unit_keys = tl.load(row_cm + u, mask=real, other=INT_MIN)
        if TAU_LINEAR:
            tau = _linear_threshold(unit_keys, real, k, RADIX_BITS)
        else:
            tau = _radix_select(unit_keys, real, k, RADIX_BITS, TAU_HISTS)[0]
        hot = real & (unit_keys >= tau)
        hot_coarse = row_cm + n_coarse
        tl.store(hot_coarse + _running_count(hot.to(tl.int32)) - 1, u, mask=hot)
        tl.debug_barrier()
        hot_count = _list_groups_of_hot_coarse(
            row_gm, hot_list, hot_coarse, tl.sum(hot.to(tl.int32), axis=0), n_groups, tau, C, GM_BLOCK
        )
    else:
        tau = _row_tau(row_gm, cm_offset, length, k, G, C, UNIT_BLOCK, TAU_LINEAR)
        hot_count = _list_hot_groups_by_coarse(row_gm, row_cm, hot_list, 0, n_groups, n_coarse, tau, C, GM_BLOCK)
    return tau, hot_count


@triton.jit
def _gather_candidates(
    row_scores, hot_list, hot_count, length, tau, cand_row, G: tl.constexpr, GATHER: tl.constexpr, CAP: tl.constexpr
):
    """Stores the entries >= tau of the listed groups as (order keys, columns) in column order at
    cand_row[0:CAP] and cand_row[CAP:2 CAP]; returns how many there are (those past CAP are only counted).
    Software-pipelined: each step's scores are loaded one step ahead and its group numbers two."""
    step: tl.constexpr = GATHER // G
    j = tl.arange(0, step)
    lane = tl.arange(0, G)[None, :]
    group = tl.load(hot_list + j, mask=j < hot_count, other=0)
    x = tl.load(
        row_scores + group[:, None] * G + lane,
        mask=(j < hot_count)[:, None] & (group[:, None] * G + lane < length),
        other=0.0,
    )
    after = tl.load(hot_list + step + j, mask=step + j < hot_count, other=0)
    found = hot_count * 0
    for h0 in range(0, hot_count, step):
        cols = group[:, None] * G + lane
        key = _order_key(x)
        take = tl.reshape((h0 + j < hot_count)[:, None] & (cols < length) & (key >= tau), [GATHER]).to(tl.int32)
        group = after
        x = tl.load(
            row_scores + group[:, None] * G + lane,
            mask=(h0 + step + j < hot_count)[:, None] & (group[:, None] * G + lane < length),
            other=0.0,
        )
        after = tl.load(hot_list + h0 + 2 * step + j, mask=h0 + 2 * step + j < hot_count, other=0)
        slot = found + _running_count(take) - 1
        keep = (take != 0) & (slot < CAP)
        tl.store(cand_row + slot, tl.reshape(key, [GATHER]), mask=keep)
        tl.store(cand_row + CAP + slot, tl.reshape(cols, [GATHER]), mask=keep)
        found += tl.sum(take, axis=0)
    return found


@triton.jit
def _select_candidates(keys, cols, live, rank, out_row, k, K_PAD: tl.constexpr, BITS: tl.constexpr):
    """Writes the columns of the top `rank` live candidates (which sit in column order) to out_row, then -1 up to k."""
    threshold, above, settled = _radix_select(keys, live, rank, BITS, (32 + BITS - 1) // BITS)
    take = live & (keys >= threshold) & (rank > 0)
    if settled == 0:  # threshold is the rank-th key exactly: its ties may outnumber the places left
        tie = live & (keys == threshold)
        ties_wanted = rank - above
        if tl.sum(tie.to(tl.int32), axis=0) > ties_wanted:
            lowest_first = INT_MAX - cols  # larger for lower columns, so ties resolve by the same select
            cut = _radix_select(lowest_first, tie, ties_wanted, BITS, (32 + BITS - 1) // BITS)[0]
            take = (live & (keys > threshold)) | (tie & (lowest_first >= cut))
    slot = _running_count(take.to(tl.int32)) - 1
    tl.store(out_row + slot, cols, mask=take)
    pad = tl.arange(0, K_PAD)
    tl.store(out_row + pad, tl.full([K_PAD], -1, tl.int32), mask=(pad >= rank) & (pad < k))


@triton.jit
def _exact_row(row_scores, length, rank, out_row, k, TILE: tl.constexpr, K_PAD: tl.constexpr):
    """Exact top-`rank` of one whole row by streaming radix select (a byte a pass); used when the candidates
    did not fit."""
    lanes = tl.arange(0, TILE)
    prefix = 0
    above = 0
    for p in tl.static_range(4):
        hist = tl.zeros([256], dtype=tl.int32)
        for off in range(0, length, TILE):
            cols = off + lanes
            inside = cols < length
            u = _order_key(tl.load(row_scores + cols, mask=inside, other=0.0)) ^ INT_MIN
            if p > 0:
                inside = inside & (_above_digit(u, p, 8) == _above_digit(prefix, p, 8))
            hist += tl.histogram(_digit(u, p, 8), 256, mask=inside)
        b, more, _ = _threshold_bin(hist, rank - above)
        above += more
        prefix = prefix | (b << _digit_shift(p, 8))
    threshold = prefix ^ INT_MIN
    ties_wanted = rank - above
    written = 0
    ties_seen = 0
    for off in range(0, length, TILE):
        cols = off + lanes
        inside = cols < length
        key = _order_key(tl.load(row_scores + cols, mask=inside, other=0.0))
        tie = inside & (key == threshold)
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = (inside & (key > threshold)) | (tie & (tie_rank < ties_wanted))
        slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, cols, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
    pad = tl.arange(0, K_PAD)
    tl.store(out_row + pad, tl.full([K_PAD], -1, tl.int32), mask=(pad >= rank) & (pad < k))


@triton.jit
def _select_row(row_scores, length, k, out_row, CAP: tl.constexpr, K_PAD: tl.constexpr):
    """Step 3 over a whole row of at most CAP entries, its own candidate set: read once, selected in registers."""
    cols = tl.arange(0, CAP)
    live = cols < length
    keys = _order_key(tl.load(row_scores + cols, mask=live, other=0.0))
    _select_candidates(keys, cols, live, tl.minimum(k, length), out_row, k, K_PAD, RADIX_BITS)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _gathered_candidates(counts_row, cand_row, place_row, n_splits, CAP: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """The candidates of all splits of a row as one column-ordered [CAP] block (keys, columns, live), and
    their number. Split s wrote its counts_row[s] candidates, in column order, to its own area of
    cand_row; slot j of the block belongs to the last split whose prefix (candidates before it) is <= j,
    found by marking each non-empty split's first slot and taking a running maximum."""
    slots = tl.arange(0, CAP)
    tl.store(place_row + slots, tl.full([CAP], -1, tl.int32))
    tl.debug_barrier()
    total = 0
    for s0 in range(0, n_splits, SPLIT_BLOCK):
        s = s0 + tl.arange(0, SPLIT_BLOCK)
        count = tl.load(counts_row + s, mask=s < n_splits, other=0, cache_modifier=".cg")
        prefix = total + tl.cumsum(count, axis=0) - count
        tl.store(place_row + CAP + s, prefix, mask=s < n_splits)
        tl.store(place_row + prefix, s, mask=(count > 0) & (prefix < CAP))
        total += tl.sum(count, axis=0)
    tl.debug_barrier()
    owner = tl.associative_scan(tl.load(place_row + slots), 0, _max_combine)
    live = slots < total
    owner = tl.where(live, owner, 0)
    at = owner.to(tl.int64) * (2 * CAP) + slots - tl.load(place_row + CAP + owner, mask=live, other=0)
    keys = tl.load(cand_row + at, mask=live, other=INT_MIN, cache_modifier=".cg")
    cols = tl.load(cand_row + CAP + at, mask=live, other=0, cache_modifier=".cg")
    return keys, cols, live, total


@triton.jit
def _finish(
    row_scores,
    length,
    k,
    counts_row,
    cand_row,
    place_row,
    out_row,
    n_splits,
    CAP: tl.constexpr,
    K_PAD: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """Step 3: the row's answer from its candidates, or from the whole row when they overflowed."""
    rank = tl.minimum(k, length)
    if SINGLE:
        total = tl.load(counts_row)
        slots = tl.arange(0, CAP)
        live = slots < total
        keys = tl.load(cand_row + slots, mask=live, other=INT_MIN)
        cols = tl.load(cand_row + CAP + slots, mask=live, other=0)
    else:
        keys, cols, live, total = _gathered_candidates(counts_row, cand_row, place_row, n_splits, CAP, SPLIT_BLOCK)
    if total <= CAP:
        _select_candidates(keys, cols, live, rank, out_row, k, K_PAD, RADIX_BITS)
    else:
        _exact_row(row_scores, length, rank, out_row, k, EXACT_TILE, K_PAD)


@triton.jit
def _count_split(
    row_scores,
    row_gm,
    cm_offset,
    row_hot,
    arrivals,
    counts_row,
    cand_row,
    place_row,
    out_row,
    length,
    k,
    split,
    groups_per_split,
    n_splits,
    G: tl.constexpr,
    C: tl.constexpr,
    UNIT_BLOCK: tl.constexpr,
    GM_BLOCK: tl.constexpr,
    GATHER: tl.constexpr,
    CAP: tl.constexpr,
    K_PAD: tl.constexpr,
    SINGLE: tl.constexpr,
    TAU_LINEAR: tl.constexpr,
    COARSE_LIST: tl.constexpr,
):
    """Steps 2-3 for one split (SINGLE: the row's only one): the row's tau, the split's hot groups and its
    candidates (in column order, in its own area); the row's last split to get there then finishes the row."""
    g_first = split * groups_per_split
    g_end = tl.maximum(g_first, tl.minimum(g_first + groups_per_split, (length + G - 1) // G))
    g = g_first + tl.arange(0, GM_BLOCK)
    if COARSE_LIST and C > 1 and C <= GM_BLOCK:
        if SINGLE:
            tau, hot_count = _row_tau_and_hot_groups(
                row_gm, cm_offset, row_hot, length, k, G, C, UNIT_BLOCK, GM_BLOCK, TAU_LINEAR
            )
        else:
            tau = _row_tau(row_gm, cm_offset, length, k, G, C, UNIT_BLOCK, TAU_LINEAR)
            hot_count = _list_hot_groups_by_coarse(
                row_gm,
                row_gm + cm_offset,
                row_hot + g_first,
                g_first,
                g_end,
                (length + G * C - 1) // (G * C),
                tau,
                C,
                GM_BLOCK,
            )
    else:
        if not SINGLE:  # in flight while tau is found (a whole row's first block would cost registers instead)
            first_block = tl.load(row_gm + g, mask=g < g_end, other=INT_MIN)
        tau = _row_tau(row_gm, cm_offset, length, k, G, C, UNIT_BLOCK, TAU_LINEAR)
        if SINGLE:
            first_block = tl.load(row_gm + g, mask=g < g_end, other=INT_MIN)
        hot_count = _list_hot_groups(row_gm, row_hot + g_first, g_first, g_end, tau, first_block, GM_BLOCK)
    tl.debug_barrier()
    split_cand = cand_row + split * (2 * CAP)
    found = _gather_candidates(row_scores, row_hot + g_first, hot_count, length, tau, split_cand, G, GATHER, CAP)
    tl.store(counts_row + split, found)
    tl.debug_barrier()
    last = True
    if not SINGLE:
        last = tl.atomic_add(arrivals, 1, sem="acq_rel") == n_splits - 1
    if last:
        _finish(
            row_scores,
            length,
            k,
            counts_row,
            cand_row,
            place_row,
            out_row,
            n_splits,
            CAP,
            K_PAD,
            SINGLE,
        )


@triton.jit
def _stagger_start(row, length, stagger_rows, sms, ns_per_entry):
    """Program p of the first stagger_rows waits (p // sms) * length * ns_per_entry. Programs p and p + sms
    usually share an SM, so its programs then read and count out of step (some read while others count)
    instead of all reading and then all counting while the memory idles; the programs that later take the
    places of ended ones keep the offsets."""
    if row < stagger_rows:
        until = tl.extra.cuda.globaltimer() + ((row // sms) * length * ns_per_entry).to(tl.uint64)
        while tl.extra.cuda.globaltimer() < until:
            pass


@triton.jit(
    do_not_specialize=[
        "stride_row",
        "n_cols",
        "stride_gm",
        "k",
        "tiles_per_split",
        "n_splits",
        "stagger_rows",
        "stagger_sms",
    ]
)
def _scan_kernel(
    scores_ptr,
    stride_row,
    lengths_ptr,
    n_cols,
    gm_ptr,
    hot_ptr,
    stride_gm,
    arrivals_ptr,
    counts_ptr,
    cand_ptr,
    place_ptr,
    out_ptr,
    k,
    tiles_per_split,
    n_splits,
    stagger_rows,
    stagger_sms,
    stagger_ns_per_entry,
    G: tl.constexpr,
    C: tl.constexpr,
    TILE: tl.constexpr,
    UNIT_BLOCK: tl.constexpr,
    GM_BLOCK: tl.constexpr,
    GATHER: tl.constexpr,
    CAP: tl.constexpr,
    K_PAD: tl.constexpr,
    VEC: tl.constexpr,
    TAU_LINEAR: tl.constexpr,
    COARSE_LIST: tl.constexpr,
    SINGLE: tl.constexpr,
    FUSED: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    STAGGER: tl.constexpr,
):
    """Step 1 over one split of a row. FUSED (one split per row): steps 2-3 follow in the same program,
    while the row's maxima are fresh. A split row's first split resets the row's arrival count, which the
    count launch (after this one) uses. PDL: the count launch may start once every scan program has."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    length = _row_length(lengths_ptr, row, n_cols)
    if FUSED:
        if length <= CAP:  # the row is its own candidate set
            _select_row(
                _row_scores(scores_ptr, row, stride_row, VEC), length, k, out_ptr + row.to(tl.int64) * k, CAP, K_PAD
            )
            return
    if STAGGER:
        _stagger_start(row, length, stagger_rows, stagger_sms, stagger_ns_per_entry)
    row_scores = _row_scores(scores_ptr, row, stride_row, VEC)
    stride_gm = tl.multiple_of(stride_gm, 16)  # the workspace rows are whole 64-byte lines
    row_gm = gm_ptr + row.to(tl.int64) * (2 * stride_gm)
    _scan_split(
        row_scores,
        row_gm,
        row_gm + stride_gm,
        length,
        tl.program_id(1) * tiles_per_split,
        tiles_per_split,
        G,
        C,
        TILE,
        PREFETCH,
    )
    if not SINGLE:
        if tl.program_id(1) == 0:
            tl.store(arrivals_ptr + row, 0)
    if FUSED:
        tl.debug_barrier()
        _count_split(
            row_scores,
            row_gm,
            stride_gm,
            hot_ptr + row.to(tl.int64) * stride_gm,
            arrivals_ptr,
            counts_ptr + row.to(tl.int64),
            cand_ptr + row.to(tl.int64) * (2 * CAP),
            place_ptr,
            out_ptr + row.to(tl.int64) * k,
            length,
            k,
            0,
            tiles_per_split * (TILE // G),
            1,
            G,
            C,
            UNIT_BLOCK,
            GM_BLOCK,
            GATHER,
            CAP,
            K_PAD,
            True,
            TAU_LINEAR,
            COARSE_LIST,
        )


@triton.jit(do_not_specialize=["stride_row", "n_cols", "stride_gm", "k", "tiles_per_split", "n_splits"])
def _count_kernel(
    scores_ptr,
    stride_row,
    lengths_ptr,
    n_cols,
    gm_ptr,
    hot_ptr,
    stride_gm,
    arrivals_ptr,
    counts_ptr,
    cand_ptr,
    place_ptr,
    out_ptr,
    k,
    tiles_per_split,
    n_splits,
    G: tl.constexpr,
    C: tl.constexpr,
    TILE: tl.constexpr,
    UNIT_BLOCK: tl.constexpr,
    GM_BLOCK: tl.constexpr,
    GATHER: tl.constexpr,
    CAP: tl.constexpr,
    K_PAD: tl.constexpr,
    VEC: tl.constexpr,
    TAU_LINEAR: tl.constexpr,
    COARSE_LIST: tl.constexpr,
    SINGLE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Steps 2-3 for one split of a row, after the scan launch stored every maximum of the row (PDL: the
    program may start before that, so it waits for the scan launch to finish before reading its results)."""
    row = tl.program_id(0)
    length = _row_length(lengths_ptr, row, n_cols)
    if PDL:
        tl.extra.cuda.gdc_wait()
    stride_gm = tl.multiple_of(stride_gm, 16)  # the workspace rows are whole 64-byte lines
    row_gm = gm_ptr + row.to(tl.int64) * (2 * stride_gm)
    _count_split(
        _row_scores(scores_ptr, row, stride_row, VEC),
        row_gm,
        stride_gm,
        hot_ptr + row.to(tl.int64) * stride_gm,
        arrivals_ptr + row,
        counts_ptr + row.to(tl.int64) * n_splits,
        cand_ptr + row.to(tl.int64) * (2 * CAP * n_splits),
        place_ptr + row.to(tl.int64) * (CAP + n_splits),
        out_ptr + row.to(tl.int64) * k,
        length,
        k,
        tl.program_id(1),
        tiles_per_split * (TILE // G),
        n_splits,
        G,
        C,
        UNIT_BLOCK,
        GM_BLOCK,
        GATHER,
        CAP,
        K_PAD,
        SINGLE,
        TAU_LINEAR,
        COARSE_LIST,
    )


# ----------------------------------------------------------------------------------------------
# launch plan
# ----------------------------------------------------------------------------------------------


def _group_size(n_cols: int, k: int, groups_per_k: int) -> int:
    """Largest power of two <= MAX_GROUP that leaves a full-length row at least groups_per_k * k groups."""
    g = 1
    while g < MAX_GROUP and n_cols // (2 * g) >= groups_per_k * k:
        g *= 2
    return g


def _coarse_size(n_cols: int, k: int, group: int, tile: int, units_per_k: int) -> int:
    """Groups per coarse group: the largest power of two that leaves a full-length row at least
    units_per_k * k coarse groups (a tile holds whole coarse groups)."""
    c = 1
    while 2 * c * group <= tile and n_cols // (2 * c * group) >= units_per_k * k:
        c *= 2
    return c


def topk_indices_triton(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """ds4.kernels.topk.topk_indices on the Triton path, with the device's chosen settings (arguments checked
    there)."""
    return launch(scores, lengths, k, settings_for(scores.device))


def launch(scores: torch.Tensor, lengths: torch.Tensor, k: int, settings: Settings) -> torch.Tensor:
    """The Triton path under the given settings: one program a row when the batch fills a wave of programs or
    a row fits one split tile, otherwise each row split over about a wave's share of programs."""
    rows, n_cols = scores.shape
    device = scores.device
    out = torch.empty((rows, k), dtype=torch.int32, device=device)
    if rows == 0:
        return out
    if n_cols == 0:
        return out.fill_(-1)
    wave = settings.programs_per_sm * settings.sms
    one_program = rows >= wave or n_cols <= settings.split.tile
    layout = settings.one_program if one_program else settings.split
    tile = layout.tile
    k_pad = triton.next_power_of_2(k)
    cap = max(settings.cap_per_k * k_pad, MIN_CAP)
    group = _group_size(n_cols, k, settings.groups_per_k)
    coarse = _coarse_size(n_cols, k, group, tile, settings.units_per_k)
    tiles = triton.cdiv(n_cols, tile)
    splits = 1 if one_program else max(1, min(tiles, triton.cdiv(wave, rows)))
    tiles_per_split = triton.cdiv(tiles, splits)
    n_splits = triton.cdiv(tiles, tiles_per_split)
    count_tiles = tiles_per_split * settings.count_merge
    count_splits = triton.cdiv(tiles, count_tiles)
    gm_stride = triton.cdiv(triton.cdiv(n_cols, group), 16) * 16
    stride = scores.stride(0)
    vec = scores.data_ptr() % 16 == 0 and stride % 4 == 0
    lengths = lengths.to(device=device, dtype=torch.int32)
    arrivals = torch.empty(rows if count_splits > 1 else 0, dtype=torch.int32, device=device)  # reset by the scan
    gm = torch.empty((rows, 2, gm_stride), dtype=torch.int32, device=device)  # group maxima, coarse maxima
    hot = torch.empty((rows, gm_stride), dtype=torch.int32, device=device)
    counts = torch.empty((rows, count_splits), dtype=torch.int32, device=device)
    cand = torch.empty((rows, count_splits, 2, cap), dtype=torch.int32, device=device)
    place = torch.empty((rows if count_splits > 1 else 0, cap + count_splits), dtype=torch.int32, device=device)
    blocks = dict(
        G=group,
        C=coarse,
        TILE=tile,
        UNIT_BLOCK=settings.unit_block,
        GM_BLOCK=settings.gm_block,
        GATHER=settings.gather,
        CAP=cap,
        K_PAD=k_pad,
        VEC=vec,
        TAU_LINEAR=layout.tau_linear,
        COARSE_LIST=layout.coarse_list,
    )
    head = (scores, stride, lengths, n_cols, gm, hot, gm_stride, arrivals, counts, cand, place, out, k)
    ns_per_entry = settings.stagger_ns_per_byte * settings.sms * scores.element_size()
    _scan_kernel[(rows, n_splits)](
        *head,
        tiles_per_split,
        n_splits,
        wave,
        settings.sms,
        ns_per_entry,
        **blocks,
        SINGLE=count_splits == 1,
        FUSED=one_program,
        PREFETCH=layout.prefetch,
        PDL=settings.early_count_launch and not one_program,
        STAGGER=one_program and ns_per_entry > 0,
        num_warps=layout.warps,
        **({} if layout.max_registers is None else dict(maxnreg=layout.max_registers)),
    )
    if not one_program:
        _count_kernel[(rows, count_splits)](
            *head,
            count_tiles,
            count_splits,
            **blocks,
            SINGLE=count_splits == 1,
            PDL=settings.early_count_launch,
            num_warps=settings.count_warps,
            launch_pdl=settings.early_count_launch,
        )
    return out
