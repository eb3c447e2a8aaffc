"""One group of calls to the fused kernel's ops, run in a child process by test_kernel_bad_args.py.

    python tests/kernel/_kernel_bad_args_worker.py GROUP [NAME_TO_SKIP ...]

Before each call it prints `CALL <name>` (flushed), after it `DONE <json>` with the call's name, what was expected
and what happened. A call that kills the process (SIGSEGV, SIGFPE, abort) leaves a CALL line without its DONE, so the
parent can name it; it then runs the group again without the calls already done, to find every crash.

Expectations: "raise" (a malformed call: must raise), "ok" (valid, including edge cases such as 0 tokens: must
return, and the result must pass the call's check), "either" (must not crash; raising is fine, and a result, if
returned, must pass the check: e.g. a non-contiguous tensor may be rejected or copied, but not misread).
"""

from __future__ import annotations

import json
import math
import sys
import traceback

import torch

from modeling_memoryformer import memory_ops

RAISES = (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError)  # TORCH_CHECK and schema errors
STRATEGIES = tuple(memory_ops.lookup_strategies())  # the kernel's own list
ISAS = ("AVX512", "AVX2", "NEON", "DEFAULT")

N, TAU, K, D = 5, 4, 4, 8  # 5 tokens, tau 4, 4 tables of P = 16 rows, 8 columns
P = 1 << TAU
HUGE_P = (1 << 62) + P  # K * HUGE_P wraps to K * P = the number of table rows in int64 arithmetic


def _rows_scores(x: torch.Tensor, tau: int = TAU) -> tuple[torch.Tensor, torch.Tensor]:
    rows = memory_ops.table_rows(memory_ops.hash_codes(x, tau), tau)
    return rows, memory_ops.hash_scores(x, tau).float()


def _reference_lookup(rows, scores, tables, bias):
    acc = torch.float64 if tables.dtype == torch.float64 else torch.float32
    y = (scores.to(acc)[..., None] * tables.to(acc)[rows]).sum(-2)
    if bias is not None:
        y = y + bias.to(acc)
    return y


def _close(actual, expected, tol: float) -> str | None:
    if not isinstance(actual, torch.Tensor):
        return f"returned {type(actual).__name__}, expected a tensor"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.numel() and not torch.allclose(actual.double(), expected.double(), atol=tol, rtol=tol):
        return f"values differ by up to {(actual.double() - expected.double()).abs().max().item():.3g}"
    return None


def _tol(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]


class Calls:
    """Collects (name, expect, thunk, check) for one group."""

    def __init__(self):
        self.items: list[tuple[str, str, object, object]] = []

    def add(self, name, expect, thunk, check=None):
        assert expect in ("raise", "ok", "either")
        assert all(name != item[0] for item in self.items), f"duplicate call name {name}"
        self.items.append((name, expect, thunk, check))


# ---------------------------------------------------------------------------------------------------------------------


def group_hash(ops, c: Calls) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, K * TAU, generator=g)

    def check_hash(x, tau, score, t):
        def check(out):
            rows, scores = out
            want_rows = memory_ops.table_rows(memory_ops.hash_codes(x, tau), tau)
            want_scores = memory_ops.hash_scores(x.float() if x.dtype != torch.float64 else x, tau,
                                                 score, t)
            return (None if torch.equal(rows, want_rows) else "rows differ from memory_ops.hash_codes") or _close(
                scores, want_scores, 1e-5 if x.dtype != torch.float64 else 1e-10)
        return check

    c.add("valid paper score", "ok", lambda: ops.hash(x, TAU, "paper", 1.0), check_hash(x, TAU, "paper", 1.0))
    c.add("valid l1 score, t=0.5", "ok", lambda: ops.hash(x, TAU, "l1", 0.5), check_hash(x, TAU, "l1", 0.5))
    for name in ("cosine", "", "L1", "paper "):
        c.add(f"score {name!r} (unknown: refused, never run as another)", "raise",
              lambda name=name: ops.hash(x, TAU, name, 1.0))
    empty = torch.randn(0, K * TAU)
    c.add("0 tokens", "ok", lambda: ops.hash(empty, TAU, "paper", 1.0), check_hash(empty, TAU, "paper", 1.0))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        xd = x.to(dtype)
        c.add(f"x {dtype}", "ok", lambda xd=xd: ops.hash(xd, TAU, "paper", 1.0),
              check_hash(xd.float() if dtype != torch.float64 else xd, TAU, "paper", 1.0))
    for tau in (1, 16):
        xt = torch.randn(3, 16, generator=g)
        c.add(f"hash_bits {tau}", "ok", lambda xt=xt, tau=tau: ops.hash(xt, tau, "paper", 1.0),
              check_hash(xt, tau, "paper", 1.0))

    c.add("x 1-D", "raise", lambda: ops.hash(x[0], TAU, "paper", 1.0))
    c.add("x 3-D", "raise", lambda: ops.hash(x[None], TAU, "paper", 1.0))
    c.add("x 0-D", "raise", lambda: ops.hash(torch.tensor(1.0), TAU, "paper", 1.0))
    for dtype in (torch.int64, torch.int32, torch.bool, torch.complex64):
        c.add(f"x {dtype}", "raise", lambda dtype=dtype: ops.hash(torch.ones(N, K * TAU, dtype=dtype), TAU, "paper", 1.0))
    for tau in (0, -1, 17, 3, 5, 64, 1 << 40):
        c.add(f"hash_bits {tau}", "raise", lambda tau=tau: ops.hash(x, tau, "paper", 1.0))
    for t in (0.0, -1.0, math.nan, -math.inf):
        c.add(f"temperature {t}", "raise", lambda t=t: ops.hash(x, TAU, "paper", t))

    def check_inf(out):  # the limit t -> inf: every factor is 1 + exp(0) = 2, p = 2**-tau
        return _close(out[1], torch.full((N, K), 2.0**-TAU), 1e-6)

    c.add("temperature inf", "either", lambda: ops.hash(x, TAU, "paper", math.inf), check_inf)
    xt = torch.randn(K * TAU, N, generator=g).t()
    c.add("x non-contiguous", "either", lambda: ops.hash(xt, TAU, "paper", 1.0), check_hash(xt, TAU, "paper", 1.0))
    c.add("x with 0 features", "either", lambda: ops.hash(torch.randn(N, 0), TAU, "paper", 1.0),
          lambda out: None if out[0].shape == (N, 0) and out[1].shape == (N, 0) else f"shapes {out[0].shape}")
    special = x.clone()
    special[0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    c.add("x with nan and inf values", "either", lambda: ops.hash(special, TAU, "paper", 1.0),
          lambda out: None if out[0].shape == (N, K) else f"shape {out[0].shape}")


def group_hash_backward(ops, c: Calls) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, K * TAU, generator=g)
    gs = torch.randn(N, K, generator=g)

    def check_grad(gs, x, tau, score, t):
        def check(out):
            xr = x.detach().double().requires_grad_()
            scores = memory_ops.hash_scores(xr, tau, score, t)
            (want,) = torch.autograd.grad(scores, xr, gs.double()) if xr.numel() else (torch.zeros_like(xr),)
            return _close(out, want.to(x.dtype), _tol(x.dtype) * 10)
        return check

    hb = ops.hash_backward
    c.add("valid", "ok", lambda: hb(gs, x, TAU, "paper", 1.0), check_grad(gs, x, TAU, "paper", 1.0))
    c.add("valid l1, t=0.5", "ok", lambda: hb(gs, x, TAU, "l1", 0.5), check_grad(gs, x, TAU, "l1", 0.5))
    c.add("0 tokens", "ok", lambda: hb(torch.ones(0, K), torch.randn(0, K * TAU), TAU, "paper", 1.0),
          lambda out: None if out.shape == (0, K * TAU) else f"shape {tuple(out.shape)}")
    xb = x.to(torch.bfloat16)
    c.add("x bfloat16, grad_scores float32", "ok", lambda: hb(gs, xb, TAU, "paper", 1.0),
          check_grad(gs, xb, TAU, "paper", 1.0))

    c.add("hash_bits 0 (once a SIGFPE)", "raise",
          lambda: hb(torch.ones(4, 4), torch.randn(4, 16), 0, "paper", 1.0))
    for tau in (-1, 17, 3, 5, 64):
        c.add(f"hash_bits {tau}", "raise", lambda tau=tau: hb(gs, x, tau, "paper", 1.0))
    c.add("grad_scores [1] for x [65536, 1024] (once a SIGSEGV)", "raise",
          lambda: hb(torch.ones(1), torch.randn(65536, 1024), 4, "paper", 1.0))
    for shape in ((N - 1, K), (N + 1, K), (N, K - 1), (N, K + 1), (N * K,), (N, K, 1), ()):
        c.add(f"grad_scores {list(shape)} for x [{N}, {K * TAU}]", "raise",
              lambda shape=shape: hb(torch.ones(shape), x, TAU, "paper", 1.0))
    c.add("grad_scores int64", "raise", lambda: hb(torch.ones(N, K, dtype=torch.long), x, TAU, "paper", 1.0))
    c.add("x int64", "raise", lambda: hb(gs, torch.ones(N, K * TAU, dtype=torch.long), TAU, "paper", 1.0))
    c.add("x 1-D", "raise", lambda: hb(gs[0], x[0], TAU, "paper", 1.0))
    c.add("x 3-D", "raise", lambda: hb(gs[None], x[None], TAU, "paper", 1.0))
    for t in (0.0, -1.0, math.nan, -math.inf):
        c.add(f"temperature {t}", "raise", lambda t=t: hb(gs, x, TAU, "paper", t))

    c.add("temperature inf", "either", lambda: hb(gs, x, TAU, "paper", math.inf),
          lambda out: None if out.shape == x.shape and bool(torch.isfinite(out).all()) else "non-finite or misshaped")
    xt = torch.randn(K * TAU, N, generator=g).t()
    c.add("x non-contiguous", "either", lambda: hb(gs, xt, TAU, "paper", 1.0), check_grad(gs, xt, TAU, "paper", 1.0))
    gst = torch.randn(K, N, generator=g).t()
    c.add("grad_scores non-contiguous", "either", lambda: hb(gst, x, TAU, "paper", 1.0),
          check_grad(gst, x, TAU, "paper", 1.0))
    c.add("grad_scores float64", "either", lambda: hb(gs.double(), x, TAU, "paper", 1.0),
          check_grad(gs, x, TAU, "paper", 1.0))
    for name in ("cosine", "", "L1", "paper "):
        c.add(f"score {name!r} (unknown: refused, never run as another)", "raise",
              lambda name=name: hb(gs, x, TAU, name, 1.0))



def _lookup_operands(seed: int, n: int = N, d: int = D):
    g = torch.Generator().manual_seed(seed)
    rows, scores = _rows_scores(torch.randn(n, K * TAU, generator=g))
    tables = torch.randn(K * P, d, generator=g)
    bias = torch.randn(d, generator=g)
    return rows, scores, tables, bias


def _malformed_lookup_args(c: Calls, call, rows, scores, tables, bias, prefix: str = "") -> None:
    """Malformed (rows, scores, tables, bias, rows_per_table) for any lookup-shaped op: call(rows, scores, tables,
    bias, rows_per_table)."""
    n, k = rows.shape
    r = rows

    def add(name, thunk):
        c.add(prefix + name, "raise", thunk)

    add("rows 1-D", lambda: call(r[0], scores[0], tables, bias, P))
    add("rows 3-D", lambda: call(r[None], scores[None], tables, bias, P))
    add("rows int32", lambda: call(r.int(), scores, tables, bias, P))
    add("rows float", lambda: call(r.float(), scores, tables, bias, P))
    add("rows beyond the tables", lambda: call(r + K * P, scores, tables, bias, P))
    add("rows negative", lambda: call(r - K * P, scores, tables, bias, P))
    add("rows -1 in table 0", lambda: call(torch.cat([torch.full((n, 1), -1), r[:, 1:]], 1), scores, tables, bias, P))
    add("rows in the wrong table's range (columns flipped)", lambda: call(r.flip(-1), scores, tables, bias, P))
    add("rows of table 1 in column 0", lambda: call(torch.cat([r[:, :1] + P, r[:, 1:]], 1), scores, tables, bias, P))
    add("scores 1-D", lambda: call(r, scores.reshape(-1), tables, bias, P))
    add("scores fewer tokens than rows", lambda: call(r, scores[:-1], tables, bias, P))
    add("scores more tokens than rows", lambda: call(r, torch.cat([scores, scores]), tables, bias, P))
    add("scores fewer columns than rows", lambda: call(r, scores[:, :-1], tables, bias, P))
    add("scores more columns than rows", lambda: call(r, torch.cat([scores, scores], 1), tables, bias, P))
    add("scores int64", lambda: call(r, torch.ones(n, k, dtype=torch.long), tables, bias, P))
    add("scores bool", lambda: call(r, torch.ones(n, k, dtype=torch.bool), tables, bias, P))
    add("tables 1-D", lambda: call(r, scores, tables.reshape(-1), bias, P))
    add("tables 3-D", lambda: call(r, scores, tables[None], bias, P))
    add("tables int64", lambda: call(r, scores, torch.ones(tables.shape, dtype=torch.long), bias, P))
    add("tables int32", lambda: call(r, scores, torch.ones(tables.shape, dtype=torch.int32), bias, P))
    add("tables one row short", lambda: call(r, scores, tables[:-1], bias, P))
    add("tables of twice as many tables", lambda: call(r, scores, torch.cat([tables, tables]), bias, P))
    add("rows_per_table 0", lambda: call(r, scores, tables, bias, 0))
    add("rows_per_table negative", lambda: call(r, scores, tables, bias, -P))
    add("rows_per_table not dividing the tables", lambda: call(r, scores, tables, bias, P - 1))
    add("rows_per_table twice the real one", lambda: call(r, scores, tables, bias, 2 * P))
    wrapped = r + torch.arange(k) * (HUGE_P - P)  # column j at j * HUGE_P + code, in wrapping int64 arithmetic
    add("rows_per_table 2**62 + 16 (K * P wraps to the table rows)",
        lambda: call(wrapped, scores, tables, bias, HUGE_P))


def _non_contiguous_lookup_args(c: Calls, call, rows, scores, tables, bias, check, tables_name: str) -> None:
    """Each operand of a lookup as a strided view of the same values: the op copies it or refuses it, and if it
    answers, `check` (the contiguous call's reference) holds."""
    tt = tables.t().contiguous().t()
    c.add(f"{tables_name} non-contiguous", "either", lambda: call(rows, scores, tt, bias, P), check)
    rt = rows.t().contiguous().t()
    c.add("rows non-contiguous", "either", lambda: call(rt, scores, tables, bias, P), check)
    st = scores.t().contiguous().t()
    c.add("scores non-contiguous", "either", lambda: call(rows, st, tables, bias, P), check)
    bt = torch.stack([bias, bias], 1)[:, 0]
    c.add("bias non-contiguous", "either", lambda: call(rows, scores, tables, bt, P), check)


def _malformed_bias(c: Calls, call, rows, scores, tables, prefix: str = "") -> None:
    d = tables.shape[1]
    for name, b in (
        ("bias of length 1", torch.zeros(1)),
        ("bias one short", torch.zeros(d - 1)),
        ("bias one long", torch.zeros(d + 1)),
        ("bias 2-D [1, D]", torch.zeros(1, d)),
        ("bias 0-D", torch.tensor(0.0)),
        ("bias int64", torch.zeros(d, dtype=torch.long)),
        ("bias bool", torch.zeros(d, dtype=torch.bool)),
    ):
        c.add(prefix + name, "raise", lambda b=b: call(rows, scores, tables, b, P))


def group_lookup(ops, c: Calls) -> None:
    rows, scores, tables, bias = _lookup_operands(2)
    lk = ops.lookup

    def ref(rows, scores, tables, bias, tol=1e-5):
        return lambda out: _close(out, _reference_lookup(rows, scores, tables, bias).to(tables.dtype), tol)

    c.add("valid", "ok", lambda: lk(rows, scores, tables, bias, P), ref(rows, scores, tables, bias))
    c.add("valid, no bias", "ok", lambda: lk(rows, scores, tables, None, P), ref(rows, scores, tables, None))
    r0, s0 = rows[:0], scores[:0]
    c.add("0 tokens", "ok", lambda: lk(r0, s0, tables, bias, P), ref(r0, s0, tables, bias))
    big = _lookup_operands(3, n=100)
    c.add("100 tokens", "ok", lambda: lk(*big, P), ref(*big))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        t, b = tables.to(dtype), bias.to(dtype)
        c.add(f"tables and bias {dtype}", "ok", lambda t=t, b=b: lk(rows, scores, t, b, P),
              ref(rows, scores, t, b, _tol(dtype)))
        c.add(f"tables {dtype}, 100 tokens", "ok", lambda t=t, b=b: lk(big[0], big[1], t, b, P),
              ref(big[0], big[1], t, b, _tol(dtype)))

    _malformed_lookup_args(c, lk, rows, scores, tables, bias)
    c.add("bias of length 1 (once read past it)", "raise",
          lambda: lk(*_rows_scores(torch.randn(8, 16)), torch.randn(64, 64), torch.zeros(1), 16))
    _malformed_bias(c, lk, rows, scores, tables)

    _non_contiguous_lookup_args(c, lk, rows, scores, tables, bias, ref(rows, scores, tables, bias), "tables")
    c.add("scores float64", "either", lambda: lk(rows, scores.double(), tables, bias, P),
          ref(rows, scores, tables, bias))
    c.add("bias float64", "either", lambda: lk(rows, scores, tables, bias.double(), P),
          ref(rows, scores, tables, bias))
    c.add("tables of 0 columns", "either", lambda: lk(rows, scores, tables[:, :0], bias[:0], P),
          lambda out: None if out.shape == (N, 0) else f"shape {tuple(out.shape)}")
    c.add("0 tables", "either", lambda: lk(rows[:, :0], scores[:, :0], tables[:0], bias, P),
          lambda out: _close(out, bias.expand(N, D), 0))
    c.add("0 tables, rows_per_table 0", "either", lambda: lk(rows[:, :0], scores[:, :0], tables[:0], bias, 0),
          lambda out: _close(out, bias.expand(N, D), 0))


def _int8_block(tables: torch.Tensor) -> torch.Tensor:
    """FBGEMM's row-wise layout of float tables [R, D]: uint8 [R, D + 8], the codes then float32 scale and offset."""
    return torch.ops.quantized.embedding_bag_byte_prepack(tables.contiguous())


def _reference_int8_lookup(rows, scores, packed, bias):
    """sum_k scores * (q * scale + offset)[rows] (+ bias) in float64, the formula read from the bytes."""
    d = packed.shape[1] - 8
    scale = packed[:, d : d + 4].contiguous().view(torch.float32).double()
    offset = packed[:, d + 4 :].contiguous().view(torch.float32).double()
    values = packed[:, :d].double() * scale + offset
    y = (scores.double()[..., None] * values[rows]).sum(-2)
    return y if bias is None else y + bias.double()


def group_int8_lookup(ops, c: Calls) -> None:
    rows, scores, tables, bias = _lookup_operands(8)
    packed = _int8_block(tables)
    lk = ops.int8_lookup

    def ref(rows, scores, packed, bias, tol=1e-5):
        return lambda out: _close(out, _reference_int8_lookup(rows, scores, packed, bias), tol)

    c.add("valid", "ok", lambda: lk(rows, scores, packed, bias, P), ref(rows, scores, packed, bias))
    c.add("valid, no bias", "ok", lambda: lk(rows, scores, packed, None, P), ref(rows, scores, packed, None))
    c.add("1 token", "ok", lambda: lk(rows[:1], scores[:1], packed, bias, P), ref(rows[:1], scores[:1], packed, bias))
    c.add("0 tokens", "ok", lambda: lk(rows[:0], scores[:0], packed, bias, P), ref(rows[:0], scores[:0], packed, bias))
    big = _lookup_operands(9, n=100, d=300)  # 300 columns: whole spans and a ragged one on every vector width
    big_packed = _int8_block(big[2])
    c.add("100 tokens, 300 columns", "ok", lambda: lk(big[0], big[1], big_packed, big[3], P),
          ref(big[0], big[1], big_packed, big[3]))
    for dtype in (torch.bfloat16, torch.float64):
        c.add(f"bias {dtype}", "ok", lambda dtype=dtype: lk(rows, scores, packed, bias.to(dtype), P),
              ref(rows, scores, packed, bias.to(dtype).float()))
        c.add(f"scores {dtype}", "ok", lambda dtype=dtype: lk(rows, scores.to(dtype), packed, bias, P),
              ref(rows, scores.to(dtype).float(), packed, bias))

    _malformed_lookup_args(c, lk, rows, scores, packed, bias)  # the float lookups' malformed tables, as the block
    _malformed_bias(c, lambda r, s, t, b, p: lk(r, s, packed, b, p), rows, scores, tables)
    c.add("packed float32 (the float tables)", "raise", lambda: lk(rows, scores, tables, bias, P))
    c.add("packed int8 (signed)", "raise", lambda: lk(rows, scores, packed.view(torch.int8), bias, P))
    c.add("packed narrower than 8 bytes", "raise", lambda: lk(rows, scores, packed[:, :7].contiguous(), None, P))
    c.add("packed of 8 bytes, bias of 1 (once read past it)", "raise",
          lambda: lk(rows, scores, packed[:, -8:].contiguous(), torch.zeros(1), P))
    c.add("packed one row short", "raise", lambda: lk(rows, scores, packed[:-1].contiguous(), bias, P))
    c.add("scores 0-D", "raise", lambda: lk(rows, torch.tensor(1.0), packed, bias, P))

    c.add("packed of 0 columns (8 bytes a row)", "either", lambda: lk(rows, scores, packed[:, -8:].contiguous(), None, P),
          lambda out: None if out.shape == (N, 0) else f"shape {tuple(out.shape)}")
    _non_contiguous_lookup_args(c, lk, rows, scores, packed, bias, ref(rows, scores, packed, bias), "packed")


def group_lookup_strategy(ops, c: Calls) -> None:
    rows, scores, tables, bias = _lookup_operands(4, n=100, d=32)  # width 32: a whole column block of the packed pass

    def ref(rows, scores, tables, bias, tol=1e-5):
        return lambda out: _close(out, _reference_lookup(rows, scores, tables, bias).to(tables.dtype), tol)

    for how in ("auto", *STRATEGIES):
        def call(r, s, t, b, p, how=how):
            return ops.lookup_strategy(r, s, t, b, p, how)

        valid = "ok"  # every strategy, packed included, is built for every instruction set
        c.add(f"{how}: valid", valid, lambda call=call: call(rows, scores, tables, bias, P),
              ref(rows, scores, tables, bias))
        c.add(f"{how}: valid, no bias", valid, lambda call=call: call(rows, scores, tables, None, P),
              ref(rows, scores, tables, None))
        c.add(f"{how}: 0 tokens", valid, lambda call=call: call(rows[:0], scores[:0], tables, bias, P),
              ref(rows[:0], scores[:0], tables, bias))
        for dtype in (torch.bfloat16, torch.float64):
            t, b = tables.to(dtype), bias.to(dtype)
            # packed may take float32 only, embedding_bag may refuse float64
            expect = "ok" if how in ("auto", "token", "bucketed") else "either"
            c.add(f"{how}: tables {dtype}", expect, lambda call=call, t=t, b=b: call(rows, scores, t, b, P),
                  ref(rows, scores, t, b, _tol(dtype)))
        _malformed_lookup_args(c, call, rows, scores, tables, bias, prefix=f"{how}: ")
        _malformed_bias(c, call, rows, scores, tables, prefix=f"{how}: ")
    for how in ("fast", "", "AUTO", "packed ", "token\0"):
        c.add(f"unknown strategy {how!r}", "raise",
              lambda how=how: ops.lookup_strategy(rows, scores, tables, bias, P, how))


def group_lookup_backward(ops, c: Calls) -> None:
    rows, scores, tables, bias = _lookup_operands(5)
    g = torch.Generator().manual_seed(6)
    grad = torch.randn(N, D, generator=g)
    lb = ops.lookup_backward

    def ref(grad, rows, scores, tables, need_tables, need_scores, tol=1e-5):
        def check(out):
            gscores, gtables = out
            acc = torch.float64 if tables.dtype == torch.float64 else torch.float32
            problems = []
            if need_scores:
                want = (tables.to(acc)[rows] * grad.to(acc)[:, None]).sum(-1)
                problems.append(_close(gscores, want, tol) if gscores is not None else "grad_scores is None")
            if need_tables:
                contributions = (scores.to(acc)[..., None] * grad.to(acc)[:, None]).reshape(-1, tables.shape[1])
                want = torch.zeros(tables.shape, dtype=acc).index_add_(0, rows.reshape(-1), contributions)
                problems.append(_close(gtables, want.to(tables.dtype), tol) if gtables is not None else
                                "grad_tables is None")
            return next((p for p in problems if p), None)
        return check

    for nt in (True, False):
        for ns in (True, False):
            c.add(f"valid, need_tables={nt}, need_scores={ns}", "ok",
                  lambda nt=nt, ns=ns: lb(grad, rows, scores, tables, P, nt, ns),
                  ref(grad, rows, scores, tables, nt, ns))
    c.add("0 tokens", "ok", lambda: lb(grad[:0], rows[:0], scores[:0], tables, P, True, True),
          ref(grad[:0], rows[:0], scores[:0], tables, True, True))
    rb, sb, tb, _ = _lookup_operands(7, n=100)
    gb = torch.randn(100, D, generator=g)
    c.add("100 tokens", "ok", lambda: lb(gb, rb, sb, tb, P, True, True), ref(gb, rb, sb, tb, True, True))
    t16 = tables.to(torch.bfloat16)
    c.add("tables bfloat16", "ok", lambda: lb(grad, rows, scores, t16, P, True, True),
          ref(grad, rows, scores, t16, True, True, 5e-2))

    for name, shape in (("one column too many", (N, D + 1)), ("one token short", (N - 1, D)),
                        ("1-D", (N * D,)), ("3-D", (N, D, 1)), ("0-D", ())):
        c.add(f"grad_out {name} {list(shape)}", "raise",
              lambda shape=shape: lb(torch.ones(shape), rows, scores, tables, P, True, True))
    c.add("grad_out int64", "raise",
          lambda: lb(torch.ones(N, D, dtype=torch.long), rows, scores, tables, P, True, True))

    def call(r, s, t, b, p):
        gout = torch.ones(r.shape[0] if r.dim() else 1, t.shape[-1] if t.dim() >= 2 else D)
        return lb(gout, r, s, t, p, True, True)

    _malformed_lookup_args(c, call, rows, scores, tables, None)
    for nt, ns in ((True, False), (False, True)):
        c.add(f"rows beyond the tables, need_tables={nt}, need_scores={ns}", "raise",
              lambda nt=nt, ns=ns: lb(grad, rows + K * P, scores, tables, P, nt, ns))

    gt = grad.t().contiguous().t()
    c.add("grad_out non-contiguous", "either", lambda: lb(gt, rows, scores, tables, P, True, True),
          ref(grad, rows, scores, tables, True, True))
    c.add("grad_out float64", "either", lambda: lb(grad.double(), rows, scores, tables, P, True, True),
          ref(grad, rows, scores, tables, True, True))
    rt = rows.t().contiguous().t()
    c.add("rows non-contiguous", "either", lambda: lb(grad, rt, scores, tables, P, True, True),
          ref(grad, rows, scores, tables, True, True))
    st = scores.t().contiguous().t()
    c.add("scores non-contiguous", "either", lambda: lb(grad, rows, st, tables, P, True, True),
          ref(grad, rows, scores, tables, True, True))
    tt = tables.t().contiguous().t()
    c.add("tables non-contiguous", "either", lambda: lb(grad, rows, scores, tt, P, True, True),
          ref(grad, rows, scores, tables, True, True))


def group_planning(ops, c: Calls) -> None:
    def one_of(values):
        return lambda out: None if out in values else f"returned {out!r}, expected one of {values}"

    def plan(tokens=2048, tables=64, rows=256, out=512, dtype=torch.float32, backward=False):
        return ops.plan(tokens, tables, rows, out, dtype, backward)

    c.add("isa()", "ok", lambda: ops.isa(), one_of(ISAS))

    def check_info(info):
        info = list(info)
        if len(info) != 5 or not all(isinstance(v, int) for v in info):
            return f"machine_info() = {info!r}, expected 5 ints"
        return None if all(v > 0 for v in info[1:]) and info[0] > 0 else f"non-positive entries in {info}"

    c.add("machine_info()", "ok", lambda: ops.machine_info(), check_info)
    c.add("release_gradient_pool()", "ok", lambda: ops.release_gradient_pool(),
          lambda out: None if isinstance(out, int) and out >= 0 else f"returned {out!r}")
    for backward in (False, True):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for tokens in (0, 1, 64, 65, 4096):
                c.add(f"plan {tokens} tokens, {dtype}, backward={backward}", "ok",
                      lambda t=tokens, d=dtype, b=backward: plan(t, dtype=d, backward=b), one_of(STRATEGIES))
    c.add("set_cache_sizes(48K, 1M, 32M)", "ok", lambda: ops.set_cache_sizes(48 << 10, 1 << 20, 32 << 20))
    c.add("machine_info() after set_cache_sizes", "ok", lambda: ops.machine_info(),
          lambda info: None if list(info)[:3] == [48 << 10, 1 << 20, 32 << 20] else f"machine_info() = {info}")
    c.add("set_cache_sizes(0, 0, 0)", "ok", lambda: ops.set_cache_sizes(0, 0, 0))

    c.add("plan tokens -1", "raise", lambda: plan(tokens=-1))
    c.add("plan num_tables -1", "raise", lambda: plan(tables=-1))
    c.add("plan rows_per_table 0", "raise", lambda: plan(rows=0))
    c.add("plan rows_per_table -256", "raise", lambda: plan(rows=-256))
    c.add("plan out_features -1", "raise", lambda: plan(out=-1))
    for dtype in (torch.int64, torch.int32, torch.bool, torch.complex64):
        c.add(f"plan dtype {dtype}", "raise", lambda d=dtype: plan(dtype=d))
    for name, sizes in (("l1 -1", (-1, 0, 0)), ("l2 -1", (0, -1, 0)), ("l3 -1", (0, 0, -1))):
        c.add(f"set_cache_sizes {name}", "raise", lambda s=sizes: ops.set_cache_sizes(*s))

    c.add("plan num_tables 0", "either", lambda: plan(tables=0), one_of(STRATEGIES))
    c.add("plan out_features 0", "either", lambda: plan(out=0), one_of(STRATEGIES))
    for name, kwargs in (("tokens 2**62", {"tokens": 1 << 62}), ("num_tables 2**40", {"tables": 1 << 40}),
                         ("rows_per_table 2**40", {"rows": 1 << 40}), ("out_features 2**40", {"out": 1 << 40}),
                         ("everything 2**31", {"tokens": 1 << 31, "tables": 1 << 31, "rows": 1 << 31, "out": 1 << 31})):
        for backward in (False, True):
            c.add(f"plan {name}, backward={backward}", "either", lambda k=kwargs, b=backward: plan(**k, backward=b),
                  one_of(STRATEGIES))
    c.add("set_cache_sizes(1, 1, 1)", "either", lambda: ops.set_cache_sizes(1, 1, 1))
    for backward in (False, True):
        c.add(f"plan with 1-byte caches, backward={backward}", "either", lambda b=backward: plan(backward=b),
              one_of(STRATEGIES))
    c.add("set_cache_sizes(2**62, 2**62, 2**62)", "either", lambda: ops.set_cache_sizes(1 << 62, 1 << 62, 1 << 62))
    for backward in (False, True):
        c.add(f"plan with 2**62-byte caches, backward={backward}", "either", lambda b=backward: plan(backward=b),
              one_of(STRATEGIES))
    c.add("set_cache_sizes(0, 0, 0) again", "ok", lambda: ops.set_cache_sizes(0, 0, 0))


def group_linear_rows(ops, c: Calls) -> None:
    g = torch.Generator().manual_seed(5)
    most = ops.linear_rows_max()
    w = torch.randn(37, 21, generator=g)  # 21 columns: a vector body and a scalar tail on every vector width
    b = torch.randn(37, generator=g)

    def check(x, bias):
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        return lambda out: _close(out, want, 1e-5)

    for m in range(1, most + 1):
        x = torch.randn(m, 21, generator=g)
        c.add(f"{m} rows", "ok", lambda x=x: ops.linear_rows(x, w, None), check(x, None))
        c.add(f"{m} rows with bias", "ok", lambda x=x: ops.linear_rows(x, w, b), check(x, b))
    x = torch.randn(1, 21, generator=g)
    c.add(f"{most + 1} rows", "raise", lambda: ops.linear_rows(torch.randn(most + 1, 21), w, None))
    c.add("0 rows", "raise", lambda: ops.linear_rows(torch.randn(0, 21), w, None))
    c.add("x 1-D", "raise", lambda: ops.linear_rows(x[0], w, None))
    c.add("x 3-D", "raise", lambda: ops.linear_rows(x[None], w, None))
    c.add("weight 1-D", "raise", lambda: ops.linear_rows(x, w[0], None))
    c.add("weight of another width", "raise", lambda: ops.linear_rows(x, torch.randn(37, 20), None))
    c.add("bias of another length", "raise", lambda: ops.linear_rows(x, w, torch.randn(36)))
    c.add("bias 2-D", "raise", lambda: ops.linear_rows(x, w, b[None]))
    for dtype in (torch.float64, torch.bfloat16, torch.int64):  # bfloat16 beside float32: mixed dtypes
        c.add(f"x {dtype}", "raise", lambda d=dtype: ops.linear_rows(x.to(d), w, None))
        c.add(f"weight {dtype}", "raise", lambda d=dtype: ops.linear_rows(x, w.to(d), None))
        c.add(f"bias {dtype}", "raise", lambda d=dtype: ops.linear_rows(x, w, b.to(d)))
    bf = torch.bfloat16
    c.add("all bfloat16", "ok", lambda: ops.linear_rows(x.to(bf), w.to(bf), b.to(bf)),
          lambda out: None if out.dtype == bf else f"dtype {out.dtype}")
    c.add("bfloat16 with a float32 bias", "raise", lambda: ops.linear_rows(x.to(bf), w.to(bf), b))
    c.add("weight non-contiguous", "raise", lambda: ops.linear_rows(x, torch.randn(21, 37).t(), None))
    c.add("x non-contiguous", "raise", lambda: ops.linear_rows(torch.randn(21, 2).t(), w, None))
    c.add("weight with 0 rows", "ok", lambda: ops.linear_rows(x, w[:0], None),
          lambda out: None if out.shape == (1, 0) else f"shape {tuple(out.shape)}")
    c.add("0 columns", "ok", lambda: ops.linear_rows(torch.randn(2, 0), torch.randn(5, 0), None),
          lambda out: _close(out, torch.zeros(2, 5), 0))


def group_table_steps(ops, c: Calls) -> None:
    g = torch.Generator().manual_seed(6)
    w0, grad = torch.randn(9, 21, generator=g), torch.randn(9, 21, generator=g)

    def adagrad(w=None, gr=None, s=None, lr=0.1, eps=1e-8, wd=0.1):
        w = w0.clone() if w is None else w
        return lambda: ops.rowwise_adagrad_step(w, grad if gr is None else gr, torch.zeros(9) if s is None else s,
                                                lr, eps, wd)

    def adam(w=None, gr=None, m=None, v=None, step=1, lr=0.1, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
        w = w0.clone() if w is None else w
        return lambda: ops.adam_rowwise_step(w, grad if gr is None else gr, torch.zeros(9, 21) if m is None else m,
                                             torch.zeros(9) if v is None else v, step, lr, b1, b2, eps, wd)

    def moved(out):
        return None if out is None else f"returned {type(out).__name__}"

    c.add("adagrad valid", "ok", adagrad(), moved)
    c.add("adam valid", "ok", adam(), moved)
    c.add("adagrad 0 rows", "ok", adagrad(w=w0[:0].clone(), gr=grad[:0], s=torch.zeros(0)), moved)
    for name, call in (("adagrad", adagrad), ("adam", adam)):
        c.add(f"{name} weight float64", "raise", call(w=w0.double()))
        c.add(f"{name} weight bf16", "raise", call(w=w0.to(torch.bfloat16)))
        c.add(f"{name} grad float64", "raise", call(gr=grad.double()))
        c.add(f"{name} grad of another shape", "raise", call(gr=grad[:8]))
        c.add(f"{name} weight 1-D", "raise", call(w=w0[0].clone(), gr=grad[0]))
        c.add(f"{name} weight non-contiguous", "raise", call(w=torch.randn(21, 9).t(), gr=torch.randn(21, 9).t()))
        for value in (float("nan"), float("inf"), -1.0):
            c.add(f"{name} lr {value}", "raise", call(lr=value))
            c.add(f"{name} weight_decay {value}", "raise", call(wd=value))
        for value in (0.0, -1.0, float("nan")):
            c.add(f"{name} eps {value}", "raise", call(eps=value))
    c.add("adagrad state of another length", "raise", adagrad(s=torch.zeros(8)))
    c.add("adagrad state float64", "raise", adagrad(s=torch.zeros(9, dtype=torch.float64)))
    c.add("adam exp_avg of another shape", "raise", adam(m=torch.zeros(9, 20)))
    c.add("adam exp_avg_sq of another length", "raise", adam(v=torch.zeros(10)))
    c.add("adam step 0", "raise", adam(step=0))
    for b1, b2 in ((1.0, 0.95), (0.9, 1.0), (-0.1, 0.95), (float("nan"), 0.95)):
        c.add(f"adam betas {b1}, {b2}", "raise", adam(b1=b1, b2=b2))


REQUIRED_OPS = {  # the ops a group calls; a kernel without one of them fails the group once, not per call
    "hash": ("hash",),
    "hash_backward": ("hash_backward",),
    "lookup": ("lookup",),
    "lookup_strategy": ("lookup_strategy",),
    "lookup_backward": ("lookup_backward",),
    "int8_lookup": ("int8_lookup",),
    "planning": ("isa", "machine_info", "set_cache_sizes", "plan", "release_gradient_pool"),
    "linear_rows": ("linear_rows", "linear_rows_max"),
    "table_steps": ("rowwise_adagrad_step", "adam_rowwise_step"),
}

GROUPS = {
    "hash": group_hash,
    "hash_backward": group_hash_backward,
    "lookup": group_lookup,
    "lookup_strategy": group_lookup_strategy,
    "lookup_backward": group_lookup_backward,
    "int8_lookup": group_int8_lookup,
    "planning": group_planning,
    "linear_rows": group_linear_rows,
    "table_steps": group_table_steps,
}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def main(group: str, skip: set[str]) -> int:
    if not memory_ops.load_fused_kernels():
        print("UNAVAILABLE the fused kernel does not load here", flush=True)
        return 0
    ops = torch.ops.memoryformer
    missing = [op for op in REQUIRED_OPS[group] if not hasattr(ops, op)]
    if missing:
        print(f"MISSING {' '.join(missing)}", flush=True)
        return 0
    calls = Calls()
    GROUPS[group](ops, calls)
    print(f"COUNT {len(calls.items)}", flush=True)
    for name, expect, thunk, check in calls.items:
        if name in skip:
            continue
        print(f"CALL {name}", flush=True)
        outcome, detail = "returned", ""
        try:
            result = thunk()
        except RAISES as exc:
            outcome, detail = "raised", _first_line(exc)
        except Exception as exc:  # an unexpected exception type is reported, not fatal
            outcome, detail = "raised-other", _first_line(exc)
        else:
            if check is not None:
                try:
                    problem = check(result)
                except Exception:
                    problem = "check failed: " + traceback.format_exc(limit=1).strip().splitlines()[-1]
                if problem:
                    outcome, detail = "wrong", problem
        print("DONE " + json.dumps({"name": name, "expect": expect, "outcome": outcome, "detail": detail}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], set(sys.argv[2:])))
