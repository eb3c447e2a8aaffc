"""Large CPU weights moved onto huge pages (huge_pages.py). The oracle is the model before the move: the same
Parameter objects must hold the same bits, give the same logits and tokens, train and save as before; the memory must
be the process's huge pages where the system gives them (Linux, transparent huge pages in `madvise` mode)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from modeling_memoryformer import MemoryFormerForCausalLM, huge_pages

from conftest import tiny_model

SMALL = 4096   # a tiny model's tensors are a few KB: tests lower the size from which tensors move


IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def anon_huge_kb(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping [start, end) in /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_copy_holds_the_same_bits_on_aligned_memory_freed_with_its_last_view(dtype):
    src = (torch.randn(3000, 700) * 50).to(dtype)
    copy = huge_pages.huge_page_copy(src)
    assert copy.dtype == src.dtype and copy.shape == src.shape and copy.is_contiguous()
    assert torch.equal(copy, src) and copy.data_ptr() != src.data_ptr()
    assert copy.data_ptr() % huge_pages.HUGE_PAGE == 0 and huge_pages.is_placed(copy)
    view = copy[10:20]
    ptr = copy.data_ptr()
    del copy
    gc.collect()
    assert huge_pages.is_placed(view)   # a view keeps the mapping
    del view
    gc.collect()
    assert not any(start <= ptr < end for start, end in huge_pages._placed.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_empty_gives_zeros_of_the_shape_on_aligned_placed_memory(dtype):
    out = huge_pages.huge_page_empty((5, 300_001), dtype)
    assert out.shape == (5, 300_001) and out.dtype == dtype and out.is_contiguous()
    assert out.data_ptr() % huge_pages.HUGE_PAGE == 0 and huge_pages.is_placed(out)
    assert not out.any()


def test_the_memory_probe_reads_a_buffer_placed_as_model_weights_are(monkeypatch):
    # decode_bench's read bound: on huge pages exactly where from_pretrained puts the weights there
    from modeling_memoryformer.evaluation import cpu_load

    monkeypatch.setattr(cpu_load, "STREAM_PROBE_MB", 4)
    cpu_load.stream_buffer.cache_clear()
    try:
        buffer = cpu_load.stream_buffer()
        assert buffer.shape == (1 << 20,) and buffer.dtype == torch.float32 and bool((buffer == 1).all())
        assert huge_pages.is_placed(buffer) == huge_pages.enabled()
        cpu_load.stream_buffer.cache_clear()
        monkeypatch.setenv("MEMORYFORMER_HUGE_PAGES", "0")
        plain = cpu_load.stream_buffer()
        assert not huge_pages.is_placed(plain) and bool((plain == 1).all())
    finally:
        cpu_load.stream_buffer.cache_clear()


@pytest.mark.skipif(not sys.platform.startswith("linux") or huge_pages.thp_mode() != "madvise",
                    reason="the kernel gives advised memory huge pages only in transparent huge page 'madvise' mode")
def test_copy_is_backed_by_huge_pages():
    copy = huge_pages.huge_page_copy(torch.ones(3 * huge_pages.HUGE_PAGE, dtype=torch.uint8))
    assert anon_huge_kb(copy.data_ptr(), copy.data_ptr() + copy.numel()) >= 2048


def test_enabled_follows_the_mode_and_the_switch(monkeypatch):
    monkeypatch.setenv("MEMORYFORMER_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    model = tiny_model()
    assert huge_pages.place_on_huge_pages(model, min_bytes=SMALL) == 0
    assert not huge_pages.is_placed(model.lm_head.weight)
    monkeypatch.delenv("MEMORYFORMER_HUGE_PAGES")
    assert huge_pages.enabled() == (sys.platform.startswith("linux") and huge_pages.thp_mode() == "madvise")


@pytest.mark.parametrize("tie", [False, True])
def test_placed_model_keeps_its_parameters_ties_and_outputs(tie):
    model = tiny_model(tie_word_embeddings=tie)
    params = dict(model.named_parameters(remove_duplicate=False))
    before = {name: p.detach().clone() for name, p in params.items()}
    expected = logits(model)
    large = {name for name, p in params.items() if p.numel() * p.element_size() >= SMALL}
    assert any("tables" in name for name in large) and "lm_head.weight" in large
    moved = huge_pages.place_on_huge_pages(model, min_bytes=SMALL, force=True)
    unique = {p.data_ptr(): p.numel() * p.element_size() for name, p in params.items() if name in large}
    assert moved == sum(unique.values())
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[name] is params[name] for name in params)   # the same Parameter objects
    for name, p in after.items():
        assert torch.equal(p, before[name])
        assert huge_pages.is_placed(p) == (name in large)
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits(model), expected)
    assert huge_pages.place_on_huge_pages(model, min_bytes=SMALL, force=True) == 0   # already placed


def test_placed_model_trains_like_the_original():
    torch.manual_seed(0)
    a, b = tiny_model(), tiny_model()
    huge_pages.place_on_huge_pages(b, min_bytes=SMALL, force=True)
    ids = torch.randint(0, a.config.vocab_size, (2, 12))
    for model in (a, b):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(ids, labels=ids).loss.backward()
        opt.step()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert huge_pages.is_placed(b.model.layers[0].attention.query_key_value.tables)   # updated in place, still placed


def test_a_view_of_a_larger_storage_stays_where_it_is():
    module = torch.nn.Module()
    whole = torch.zeros(4, 4096)
    module.register_buffer("part", whole[1:3])
    module.register_buffer("own", torch.zeros(4, 4096))
    huge_pages.place_on_huge_pages(module, min_bytes=SMALL, force=True)
    assert module.part.data_ptr() == whole[1:3].data_ptr() and huge_pages.is_placed(module.own)


def test_int8_blocks_are_placed_and_give_the_same_outputs(monkeypatch):
    plain = tiny_model().quantize_tables("int8")
    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", SMALL)
    model = tiny_model().quantize_tables("int8")
    layer = model.model.layers[0].attention.query_key_value
    block = layer._int8_tables()[3]
    assert block is not None and huge_pages.is_placed(block) and huge_pages.is_placed(layer.tables_codes)
    assert torch.equal(logits(model), logits(plain))


def test_from_pretrained_places_the_loaded_weights(monkeypatch, tmp_path):
    original = tiny_model()
    original.quantize_tables("int8")
    original.save_pretrained(tmp_path)
    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", SMALL)
    loaded = MemoryFormerForCausalLM.from_pretrained(tmp_path)
    assert huge_pages.is_placed(loaded.lm_head.weight)
    assert huge_pages.is_placed(loaded.model.layers[0].attention.query_key_value.tables_codes)   # assembled, then placed
    assert torch.equal(logits(loaded), logits(original))


def test_a_placed_model_saves_and_loads_its_bits(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    huge_pages.place_on_huge_pages(model, min_bytes=SMALL, force=True)
    model.save_pretrained(tmp_path)
    loaded = MemoryFormerForCausalLM.from_pretrained(tmp_path)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(logits(loaded), logits(model))
