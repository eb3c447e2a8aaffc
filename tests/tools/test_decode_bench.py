"""benchmarks/decode_bench.py: the bytes a decode step must read, and the models it builds in their storage dtype.

Oracle for the bytes: the presets' shapes written out here (K rows of d_out values per Memory Layer, every weight
matrix of the twin, the LM head both read), and the per-token figures of docs/performance.md (MF-tiny
~54 MB against ~89 MB in bf16, a bound of ~1.67x)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import decode_bench

MB = 1e6


def meta_model(kind: str, preset: str, storage: str = "bf16"):
    from transformers import GPTNeoXForCausalLM

    from modeling_memoryformer import MemoryFormerForCausalLM

    config = decode_bench.model_config(kind, preset, storage)
    cls = MemoryFormerForCausalLM if kind == "mf" else GPTNeoXForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return cls(config)
    finally:
        torch.set_default_dtype(previous)


def test_mf_tiny_step_reads_its_rows_and_the_head():
    model = meta_model("mf", "tiny")
    parts = decode_bench.step_bytes(model, batch=1, context=32)
    d, layers, k, vocab = 512, 6, 64, 50304  # tau 8: K = 512 / 8 tables; the block is 512 -> 640 -> 512 (e = 2)
    widths = (3 * d, 10 * k, d)  # Q/K/V, block layer 1, block layer 2: each reads K rows of its width
    rows = layers * sum(k * w * 2 + w * 2 for w in widths)  # bf16 rows + the bias read once
    assert parts["rows"] == rows
    assert parts["head"] == vocab * d * 2
    assert parts["weights"] == 0
    assert parts["kv_cache"] == 2 * layers * 32 * d * 2
    assert parts["embedding"] == d * 2
    assert 53 * MB < parts["total"] < 55 * MB  # ~54 MB (docs/performance.md)


def test_twin_reads_every_weight_matrix_and_the_bound_matches_the_presets_shapes():
    twin = decode_bench.step_bytes(meta_model("twin", "tiny"), batch=1, context=32)
    d, layers, inner = 512, 6, 2048
    weights = layers * 2 * (d * 3 * d + 3 * d + d * d + d + d * inner + inner + inner * d + d)  # qkv, dense, MLP
    assert twin["weights"] == weights
    assert twin["head"] == 50304 * d * 2
    mf = decode_bench.step_bytes(meta_model("mf", "tiny"), batch=1, context=32)
    assert twin["total"] / mf["total"] == pytest.approx(1.66, abs=0.02)


def test_batch_multiplies_rows_and_cache_but_not_the_head():
    model = meta_model("mf", "small")
    one, four = (decode_bench.step_bytes(model, batch=b, context=20) for b in (1, 4))
    assert four["rows"] - 4 * one["rows"] == -3 * sum(
        m.bias.numel() * 2 for m in model.modules() if type(m).__name__ == "MemoryLayer")  # biases read once
    assert four["kv_cache"] == 4 * one["kv_cache"]
    assert four["head"] == one["head"]


@pytest.mark.slow
def test_models_are_built_in_their_storage_dtype_with_working_rotary_tables():
    """bf16: every floating tensor bfloat16 from the start; the rotary inv_freq (a buffer `to_empty` leaves
    uninitialised) equals a plain CPU build's; int8: MemoryFormer's tables and head int8, the twin's linears dynamic
    int8; greedy decoding runs."""
    from transformers import GPTNeoXForCausalLM

    model = decode_bench.build_in_dtype("mf", "tiny", "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference = GPTNeoXForCausalLM(decode_bench.model_config("twin", "tiny", "bf16"))
    twin = decode_bench.build_in_dtype("twin", "tiny", "bf16")
    torch.testing.assert_close(twin.gpt_neox.rotary_emb.inv_freq, reference.gpt_neox.rotary_emb.inv_freq)
    mf_inv = model.model.rotary_emb.inv_freq
    assert torch.isfinite(mf_inv).all() and mf_inv[0] == 1
    int8 = decode_bench.build_in_dtype("mf", "tiny", "int8")
    assert int8.config.table_dtype == "int8" and int8.config.lm_head_dtype == "int8"
    int8_twin = decode_bench.build_in_dtype("twin", "tiny", "int8")
    assert not any(type(m) is torch.nn.Linear for m in int8_twin.modules())
    # the gather probe reads the tables the lookups read: bf16 rows, int8 rows of codes + scale + offset (d + 8 bytes)
    for m, widths in ((model, {3072, 1280, 1024}), (int8, {1536 + 8, 640 + 8, 512 + 8})):
        groups = decode_bench.gather_groups(m)
        assert set(groups) == widths
        assert all(t.is_contiguous() for g in groups.values() for t in g["tensors"])
        rates = decode_bench.gather_rates(groups, 1, 2, seed=0)
        assert set(rates) == {str(w) for w in widths} and all(r > 0 for r in rates.values())
        assert decode_bench.table_latency_ns(groups, seed=0) > 0
    ids = torch.randint(0, 1000, (1, 4))
    with torch.inference_mode():
        for m in (model, twin, int8, int8_twin):
            m.generation_config.eos_token_id = None
            assert m.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (1, 7)


def test_the_bf16_twin_runs_its_linears_on_the_few_row_pass_with_f_linear_values():
    """The twin's linears (LM head included) take the few-row pass MemoryFormer's head takes, for a decode step's
    rows; the logits are F.linear's up to float32 summation order (oracle: the same model with plain nn.Linear)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from conftest import require_kernel

    require_kernel("fused")
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=64)
    plain = GPTNeoXForCausalLM(config).eval()
    twin = GPTNeoXForCausalLM(config).eval()
    twin.load_state_dict(plain.state_dict())
    decode_bench.use_few_row_linears(twin)
    ids = torch.randint(0, 300, (2, 1))
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = twin(ids).logits
    calls = sum(e.count for e in prof.key_averages() if e.key == "memoryformer::linear_rows")
    assert calls == 1 + 4 * config.num_hidden_layers  # the head, and each layer's QKV, dense, h_to_4h and 4h_to_h
    with torch.inference_mode():
        torch.testing.assert_close(logits, plain(ids).logits, rtol=1e-4, atol=1e-5)


def test_the_read_bound_is_the_best_probe_and_the_dot_probe_reads_the_whole_buffer(monkeypatch):
    from modeling_memoryformer.evaluation import cpu_load

    assert decode_bench.read_bound([15.0, 16.5], [18.6, 21.0]) == 21.0
    assert decode_bench.read_bound([22.0], [18.0]) == 22.0
    # The dot probe times one torch.dot of the buffer's two halves and counts every byte of the buffer once.
    calls = []
    real_dot = torch.dot

    def dot(a, b):
        calls.append((a.numel(), b.numel(), a.data_ptr(), b.data_ptr()))
        return real_dot(a, b)

    monkeypatch.setattr(torch, "dot", dot)
    monkeypatch.setattr(cpu_load, "stream_buffer", lambda: torch.ones(1 << 20))
    ticks = iter([0.0, 0.004, 1.0, 1.001])  # the best of 2 repeats: 4 MB in 1 ms
    monkeypatch.setattr(cpu_load.time, "perf_counter", lambda: next(ticks))
    assert cpu_load.memory_read_gbps(repeats=2) == 4.19  # 4 MiB / 1 ms
    (n1, n2, p1, p2), _ = calls
    assert n1 == n2 == 1 << 19 and p2 - p1 == 4 << 19  # the halves, end to end


def test_the_probes_run_their_flush_before_each_timed_read_and_outside_the_timing(monkeypatch):
    from modeling_memoryformer.evaluation import cpu_load

    events = []
    clock = iter([0.0, 0.004, 1.0, 1.001, 2.0, 2.008, 3.0, 3.002])

    def tick():
        events.append("clock")
        return next(clock)

    monkeypatch.setattr(cpu_load, "stream_buffer", lambda: torch.ones(1 << 20))
    monkeypatch.setattr(cpu_load.time, "perf_counter", tick)
    flush = lambda: events.append("flush")  # noqa: E731
    assert cpu_load.memory_read_gbps(repeats=2, before=flush) == 4.19   # the better of 4 MB in 4 ms and in 1 ms
    assert cpu_load.memory_stream_gbps(repeats=2, before=flush) == 2.1   # 4 MiB in 2 ms
    assert events == ["flush", "clock", "clock"] * 4


def test_the_flushed_probe_flushes_the_probe_buffer_or_says_why_it_cannot(monkeypatch):
    buffer = torch.ones(1 << 10)
    monkeypatch.setattr(decode_bench, "stream_buffer", lambda: buffer)
    flushed = []
    monkeypatch.setattr(decode_bench.scatter_probe, "flush_caches", lambda t: flushed.append(t.data_ptr()) or 0.0)
    probe = decode_bench.flushed_probe()
    probe()
    assert flushed == [buffer.data_ptr()] * 2   # once to check it runs, once per call

    def no_flush(t):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(decode_bench.scatter_probe, "flush_caches", no_flush)
    said = []
    assert decode_bench.flushed_probe(said.append) is None
    assert "unflushed" in said[0] and "no C compiler" in said[0]


def test_the_share_per_call_divides_each_call_by_the_probes_around_it():
    """Each timed call's bytes/s over the better of the probes taken right before and after it, the median over calls:
    a call in a slow minute is measured against that minute's probe, not the cell's best."""
    calls = [(0.005, 25.0), (0.010, 12.5), (0.004, 40.0)]   # 20 GB/s of 25, 10 of 12.5, 25 of 40
    assert decode_bench.paired_efficiency(100e6, calls) == 0.8
    assert decode_bench.paired_efficiency(100e6, [(0.004, 20.0)]) == 1.25
    assert decode_bench.paired_efficiency(100e6, []) is None
    # Against the cell's best probe (40 GB/s) the median call (0.005 s) would read 0.5.
    assert round(100e6 / 0.005 / 1e9 / decode_bench.read_bound([], [25.0, 12.5, 40.0]), 3) == 0.5


def test_the_step_clock_times_every_step_and_leaves_the_loop_as_a_plain_call_runs_it(monkeypatch):
    from conftest import require_kernel, tiny_model
    from modeling_memoryformer import decode_loop, memory_ops

    require_kernel("fused")
    model = tiny_model(attn_implementation="sdpa")
    prompt = torch.tensor([[5, 17, 99, 42]])
    from modeling_memoryformer.modeling_memoryformer import MemoryFormerLMHead

    sessions, step = [], decode_loop._StackSession.step
    monkeypatch.setattr(decode_loop._StackSession, "step", lambda *args: sessions.append(1) or step(*args))
    fused_heads, both = [], MemoryFormerLMHead.logits_and_argmax
    monkeypatch.setattr(MemoryFormerLMHead, "logits_and_argmax", lambda *args: fused_heads.append(1) or both(*args))
    methods = dict(vars(MemoryFormerLMHead))
    clock = decode_bench.StepClock()
    extra, handle = clock.attach(model, "eager")
    with memory_ops.use_kernel("fused"), torch.inference_mode():
        timed = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, **extra)
        handle.remove()
        plain = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert extra == {} and torch.equal(timed, plain) and dict(vars(MemoryFormerLMHead)) == methods
    assert len(clock.times) == 6 and len(clock.step_seconds()) == 4  # the prefill's head call, then each step's
    assert len(sessions) == 2 * 4  # both calls: every step after the first on the loop's session
    # the first decode step's logits and tokens from logits_and_argmax; the session's steps run that pass in their
    # kernel call (decode_session_step), timed as they start
    assert len(fused_heads) == 2 * 1
    extra, handle = decode_bench.StepClock().attach(model, "compiled")
    assert handle is None and list(extra) == ["logits_processor"]


def test_a_paired_cell_alternates_the_models_and_divides_each_pair_of_calls(monkeypatch):
    """run_pair builds both models in one process and alternates their timed calls (MemoryFormer first in pairs 0, 2,
    ..., the twin in 1, 3, ...); each pair's ratio is the twin's median step over MemoryFormer's in the call beside it.
    Oracle: the order the calls ran in and their step times, recorded here."""
    from conftest import tiny_config
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from modeling_memoryformer import MemoryFormerForCausalLM

    def build(kind, preset, storage, seed=0):
        torch.manual_seed(seed)
        if kind == "mf":
            return MemoryFormerForCausalLM(tiny_config(vocab_size=128)).eval()
        return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=64)).eval()

    ran, fake = [], iter([0.004, 0.010, 0.012, 0.005, 0.002, 0.009, 0.011, 0.003])
    real = decode_bench.timed_call

    def recorded(model, prompt, path, kwargs):
        out, _, busy = real(model, prompt, path, kwargs)
        ran.append("mf" if isinstance(model, MemoryFormerForCausalLM) else "twin")
        return out, [next(fake)] if len(ran) > 2 else [1.0], busy   # the two warm-up calls first

    monkeypatch.setattr(decode_bench, "build_in_dtype", build)
    monkeypatch.setattr(decode_bench, "timed_call", recorded)
    job = dict(kind="pair", preset="tiny", storage="bf16", path="eager", batches=[1], prompt_tokens=3, new_tokens=4,
               warmup=1, repeats=3, seed=0, threads=1)
    cell = decode_bench.run_pair(job)["batches"]["1"]
    assert ran == ["mf", "twin", "mf", "twin", "twin", "mf", "mf", "twin"]
    # pair 0: mf 4 ms, twin 10; pair 1: twin 12, mf 5; pair 2: mf 2, twin 9
    assert cell["mf_step_ms"] == [4.0, 5.0, 2.0] and cell["twin_step_ms"] == [10.0, 12.0, 9.0]
    assert cell["ratios"] == [2.5, 2.4, 4.5] and cell["ratio"] == 2.5
    assert cell["mf_warmup_step_ms"] == [1000.0] and cell["twin_warmup_step_ms"] == [1000.0]
    assert "paired" in decode_bench.label(job) and "| **2.50x** | 2.40-4.50x |" in "\n".join(
        decode_bench.paired_markdown([{**job, "batches": {"1": cell}}]))


def test_the_warm_up_runs_its_calls_and_more_until_its_seconds_have_passed(monkeypatch):
    """warm_up: job["warmup"] untimed calls, and more until job["warmup_s"] seconds have passed; each call's median
    step in ms. Oracle: a clock that moves 4 s per call, and the calls counted here."""
    clock, calls = [0.0], []

    def fake_call(model, prompt, path, kwargs):
        clock[0] += 4.0
        calls.append(path)
        return None, [0.003, 0.001, 0.002] if len(calls) % 2 else [], 0.0

    monkeypatch.setattr(decode_bench, "timed_call", fake_call)
    monkeypatch.setattr(decode_bench.time, "perf_counter", lambda: clock[0])
    assert decode_bench.warm_up(None, None, "eager", {}, dict(warmup=1, warmup_s=10.0)) == [2.0, None, 2.0]
    assert len(calls) == 3   # 4, 8 and 12 s: the third passes 10 s
    calls.clear()
    assert decode_bench.warm_up(None, None, "eager", {}, dict(warmup=4, warmup_s=0.0)) == [2.0, None, 2.0, None]
    assert decode_bench.parse_args(["--presets", "tiny"]).warmup_s == 10.0
    assert decode_bench.jobs(decode_bench.parse_args(["--presets", "tiny", "--warmup-s", "0"]))[0]["warmup_s"] == 0


def test_paired_cells_follow_each_pair_of_cells_on_the_paired_paths():
    args = decode_bench.parse_args(["--presets", "tiny", "--storage", "bf16", "--paths", "eager", "compiled"])
    kinds = [(j["path"], j["kind"], j["repeats"]) for j in decode_bench.jobs(args)]
    assert kinds == [("eager", "mf", 3), ("eager", "twin", 3), ("eager", "pair", 6), ("compiled", "mf", 3),
                     ("compiled", "twin", 3)]
    args = decode_bench.parse_args(["--presets", "tiny", "--storage", "bf16", "--paths", "eager", "--paired-paths"])
    assert [j["kind"] for j in decode_bench.jobs(args)] == ["mf", "twin"]


def test_the_ratio_against_a_twin_at_the_bound_is_the_share_per_call_times_the_bytes_bound():
    """A twin that read every byte at the bound takes twin_bytes / bound per step; MemoryFormer at share s of the bound
    takes mf_bytes / (s x bound): the ratio is s x twin_bytes / mf_bytes (here 0.5 x 500 / 100 = 2.5x)."""
    def cell(kind, total, share):
        return dict(kind=kind, preset="base", storage="bf16", path="eager",
                    batches={"1": {"bytes": {"total": total}, "efficiency_per_call": share}})

    results = {"cells": [cell("mf", 100e6, 0.5), cell("twin", 500e6, 0.3)]}
    lines = decode_bench.bound_twin_markdown(results)
    assert lines[-1] == "- MF-base bf16 [eager], batch 1: 50% x 5.00x = **2.50x** (the twin here: 30% per call)"
    results["cells"][0]["batches"]["1"]["efficiency_per_call"] = None   # a result without probes per call: no line
    assert decode_bench.bound_twin_markdown(results) == []
    args = decode_bench.parse_args(["--presets", "tiny", "--storage", "bf16", "int8", "--paths", "--pair-mixed"])
    mixed = decode_bench.jobs(args)   # only for the storages the compiled path runs (bf16 by default)
    assert [(j["kind"], j["path"], j["twin_path"], j["storage"]) for j in mixed] == [("pair", "eager", "compiled",
                                                                                     "bf16")]
    assert decode_bench.label(mixed[0]) == "MF-tiny and its twin, paired, bf16 [MF eager, twin compiled]"
    with pytest.raises(SystemExit):
        decode_bench.parse_args(["--paths"])   # no cell to run


def test_a_mixed_paired_cell_runs_memoryformer_eager_and_the_twin_compiled(monkeypatch):
    """--pair-mixed: the twin's calls get the compiled path's generate keywords (a static cache, a compile config),
    MemoryFormer's none; the pairs alternate as in any paired cell."""
    from modeling_memoryformer import compiled_decode_kwargs

    built, seen = {}, []

    def build(kind, preset, storage, seed=0):
        built[kind] = type("Model", (), {"config": type("C", (), {"vocab_size": 64})(),
                                          "generation_config": type("G", (), {})()})()
        return built[kind]

    def fake_call(model, prompt, path, kwargs):
        kind = "mf" if model is built["mf"] else "twin"
        seen.append((kind, path, sorted(set(kwargs) - {"attention_mask", "max_new_tokens", "do_sample",
                                                       "pad_token_id"})))
        return None, [0.002 if kind == "mf" else 0.008], 0.0

    monkeypatch.setattr(decode_bench, "build_in_dtype", build)
    monkeypatch.setattr(decode_bench, "timed_call", fake_call)
    monkeypatch.setattr(decode_bench, "step_bytes", lambda model, batch, context: {"total": 1.0})
    job = dict(kind="pair", preset="tiny", storage="bf16", path="eager", twin_path="compiled", batches=[1],
               prompt_tokens=3, new_tokens=4, warmup=1, repeats=2, seed=0, threads=1)
    cell = decode_bench.run_pair(job)["batches"]["1"]
    compiled = sorted(compiled_decode_kwargs())
    assert seen == [("mf", "eager", []), ("twin", "compiled", compiled), ("mf", "eager", []),
                    ("twin", "compiled", compiled), ("twin", "compiled", compiled), ("mf", "eager", [])]
    assert cell["ratio"] == 4.0


def test_gather_groups_hold_every_memory_layer_by_row_width_and_the_bound_adds_rows_and_the_rest():
    """MF-tiny (6 layers, d = 512, tau = 8): Q/K/V rows of 1536 values, the Memory Block's 640 and 512 (its second
    layer's 64 tables of 1024 rows), 64 tables each per layer; in bf16, rows of 3072, 1280 and 1024 bytes. The bound:
    each width's rows at its rate plus the other bytes at the read rate, written out here."""
    model = meta_model("mf", "tiny")
    groups = decode_bench.gather_groups(model)
    assert {w: (len(g["tensors"]), g["rows"]) for w, g in groups.items()} == {3072: (6, 384), 1280: (6, 384),
                                                                             1024: (6, 384)}
    assert all(t.shape[1] * 2 == w for w, g in groups.items() for t in g["tensors"])
    assert all(g["tables"] == [64] * 6 for g in groups.values())
    rates = {"3072": 10.0, "1280": 8.0, "1024": 5.0}
    total = 60e6
    rows = {3072: 2 * 384 * 3072, 1280: 2 * 384 * 1280, 1024: 2 * 384 * 1024}
    expected = (rows[3072] / 10e9 + rows[1280] / 8e9 + rows[1024] / 5e9) + (total - sum(rows.values())) / 25e9
    assert decode_bench.gather_bound_s(groups, 2, total, rates, 25.0) == pytest.approx(expected)
    # the rows counted here are step_bytes' rows less the biases
    parts = decode_bench.step_bytes(model, 2, 8)
    biases = sum(m.bias.numel() * 2 for m in model.modules() if type(m).__name__ == "MemoryLayer" and m.bias is not None)
    assert parts["rows"] - biases == sum(rows.values())
    assert decode_bench.gather_groups(meta_model("twin", "tiny")) == {}
