"""Table optimizers applied in the backward pass (`--table-optimizer`): each rule against a float64 loop written from
its formula, the optimizer object against plain AdamW plus that loop, gradients freed inside the backward, the
state in the checkpoint (exact resume through the Trainer), and the setups that are refused."""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch

from _training_data import synthetic_lm_data
from conftest import checkpointing_enable, require_kernel, tiny_config, tiny_model
from modeling_memoryformer import MemoryFormerForCausalLM, memory_ops, memory_table_updates
from modeling_memoryformer.training.table_optimizer import (
    TableAdamW,
    adam_rowwise_update,
    check_table_optimizer_setup,
    optimizer_state_bytes,
    rowwise_adagrad_update,
    table_param_groups,
    table_parameters,
)
from modeling_memoryformer.training.trainer import TrainingSettings, build_trainer, no_decay_parameter_names, train


def naive_rowwise_adagrad(w, grads, lr, eps, wd):
    """float64, one row at a time, from the formula."""
    w = w.double().clone()
    state = torch.zeros(w.shape[0], dtype=torch.float64)
    for g in grads:
        g = g.double()
        for r in range(w.shape[0]):
            state[r] += (g[r] * g[r]).sum() / g.shape[1]
            w[r] = w[r] * (1 - lr * wd) - lr * g[r] / (state[r].sqrt() + eps)
    return w, state


def naive_adam_rowwise(w, grads, lr, betas, eps, wd):
    w = w.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros(w.shape[0], dtype=torch.float64)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        g = g.double()
        for r in range(w.shape[0]):
            v[r] = b2 * v[r] + (1 - b2) * (g[r] * g[r]).sum() / g.shape[1]
            m[r] = b1 * m[r] + (1 - b1) * g[r]
            step = (m[r] / (1 - b1**t)) / ((v[r] / (1 - b2**t)).sqrt() + eps)
            w[r] = w[r] * (1 - lr * wd) - lr * step
    return w, m, v


def random_grads(shape, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=generator) for _ in range(steps)]
    grads[1][2] = 0.0  # a row nobody hit this step: decay and momentum still apply
    return grads


@pytest.mark.parametrize("kernel", ["fused", "torch", "triton"])
def test_rowwise_adagrad_follows_its_formula(kernel):
    """The fused kernel's one-pass update and the PyTorch form, each against the formula."""
    require_kernel(kernel)
    w0 = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    grads = random_grads((6, 5), 3, seed=1)
    w, s = w0.clone(), torch.zeros(6)
    with memory_ops.use_kernel(kernel):
        for g in grads:
            rowwise_adagrad_update(w, g, s, lr=0.1, eps=1e-8, weight_decay=0.1)
    expected_w, expected_s = naive_rowwise_adagrad(w0, grads, 0.1, 1e-8, 0.1)
    torch.testing.assert_close(w.double(), expected_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s.double(), expected_s, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kernel", ["fused", "torch", "triton"])
def test_adam_rowwise_follows_its_formula(kernel):
    require_kernel(kernel)
    w0 = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    grads = random_grads((6, 5), 4, seed=2)
    w, m, v = w0.clone(), torch.zeros(6, 5), torch.zeros(6)
    with memory_ops.use_kernel(kernel):
        for t, g in enumerate(grads, start=1):
            adam_rowwise_update(w, g, m, v, t, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    expected_w, expected_m, expected_v = naive_adam_rowwise(w0, grads, 0.01, (0.9, 0.95), 1e-8, 0.1)
    torch.testing.assert_close(w.double(), expected_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.double(), expected_m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v.double(), expected_v, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_the_update_functions_refuse_a_state_that_is_not_one_value_per_row(kernel):
    """A [rows, 2] state (what the removed block-wise rules kept) or a state of another row count is refused by both
    rules, fused and PyTorch paths alike, before anything is written; TableAdamW keeps one value per row."""
    require_kernel(kernel)
    w0 = torch.randn(5, 70, generator=torch.Generator().manual_seed(4))
    g = torch.randn(5, 70, generator=torch.Generator().manual_seed(5))
    with memory_ops.use_kernel(kernel):
        for bad in (torch.zeros(5, 2), torch.zeros(4)):
            w = w0.clone()
            with pytest.raises(ValueError, match="state_sum must hold one value per row, shape \\(5,\\)"):
                rowwise_adagrad_update(w, g, bad.clone(), lr=0.1, eps=1e-8, weight_decay=0.1)
            with pytest.raises(ValueError, match="exp_avg_sq must hold one value per row"):
                adam_rowwise_update(w, g, torch.zeros(5, 70), bad.clone(), 1, lr=0.01, betas=(0.9, 0.95),
                                    eps=1e-8, weight_decay=0.1)
            with pytest.raises(ValueError, match="exp_avg must have the weight's shape"):
                adam_rowwise_update(w, g, torch.zeros(5, 7), torch.zeros(5), 1, lr=0.01, betas=(0.9, 0.95),
                                    eps=1e-8, weight_decay=0.1)
            assert torch.equal(w, w0)
    assert state_after_one_step("rowwise_adagrad")["sum"].shape == (160,)
    assert state_after_one_step("adam_rowwise")["exp_avg_sq"].shape == (160,)


def state_after_one_step(rule: str) -> dict:
    """The optimizer state of a one-layer net's tables after one step of `rule`."""
    net = memory_layer_net(3)
    optimizer = TableAdamW(table_param_groups(net, rule, 0.1), lr=0.01)
    net(layer_input(0)).sum().backward()
    optimizer.step()
    return optimizer.state[net[0].tables]


def test_fused_and_torch_updates_agree_on_a_large_table():
    """512-wide rows split over the threads: the one-pass kernel against the PyTorch form, a few float32 roundings
    apart; and the kernel rejects what it cannot take, naming it."""
    require_kernel("fused")
    generator = torch.Generator().manual_seed(3)
    w0, g = torch.randn(4096, 512, generator=generator), torch.randn(4096, 512, generator=generator) * 1e-2
    results = {}
    for kernel in ("fused", "torch"):
        w, m, v = w0.clone(), torch.zeros(4096, 512), torch.zeros(4096)
        s = torch.zeros(4096)
        with memory_ops.use_kernel(kernel):
            for t in (1, 2):
                adam_rowwise_update(w, g, m, v, t, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
                rowwise_adagrad_update(w, g, s, lr=3e-3, eps=1e-8, weight_decay=0.1)
        results[kernel] = (w, m, v, s)
    for a, b in zip(results["fused"], results["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ops = torch.ops.memoryformer
    with pytest.raises(RuntimeError, match="weight and grad must be float32"):
        ops.rowwise_adagrad_step(w0.double(), g.double(), torch.zeros(4096), 0.1, 1e-8, 0.0)
    with pytest.raises(RuntimeError, match="state_sum must be float32 of shape"):
        ops.rowwise_adagrad_step(w0, g, torch.zeros(4095), 0.1, 1e-8, 0.0)
    with pytest.raises(RuntimeError, match="eps must be finite and > 0"):
        ops.rowwise_adagrad_step(w0, g, torch.zeros(4096), 0.1, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="step must be >= 1"):
        ops.adam_rowwise_step(w0, g, torch.zeros_like(w0), torch.zeros(4096), 0, 0.1, 0.9, 0.95, 1e-8, 0.0)
    with pytest.raises(RuntimeError, match="betas must be in"):
        ops.adam_rowwise_step(w0, g, torch.zeros_like(w0), torch.zeros(4096), 1, 0.1, 1.0, 0.95, 1e-8, 0.0)
    with pytest.raises(RuntimeError, match="grad of the same shape"):
        ops.adam_rowwise_step(w0, g[:10], torch.zeros_like(w0), torch.zeros(4096), 1, 0.1, 0.9, 0.95, 1e-8, 0.0)


def batch(seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (2, 12), generator=generator)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["rowwise_adagrad", "adam_rowwise"])
def test_optimizer_equals_adamw_on_dense_parameters_and_the_rule_on_tables(rule):
    """Three steps of a tiny MemoryFormer: TableAdamW against a copy trained by torch.optim.AdamW on the dense
    parameters and the rule's update function (checked against its formula above) on the tables."""
    model = tiny_model(seed=0, table_init_std=0.02).train()
    reference = copy.deepcopy(model)
    lr, betas, eps, wd = 3e-3, (0.9, 0.95), 1e-8, 0.1
    optimizer = TableAdamW(table_param_groups(model, rule, wd, no_decay_parameter_names(model)), lr=lr, betas=betas,
                           eps=eps, weight_decay=wd)
    tables = table_parameters(reference)
    assert len(tables) == len(table_parameters(model)) > 0
    table_ids = {id(p) for p in tables}
    no_decay = no_decay_parameter_names(reference)
    named = dict(reference.named_parameters())
    adamw = torch.optim.AdamW([{"params": [p for n, p in named.items() if id(p) not in table_ids and n not in no_decay]},
                               {"params": [named[n] for n in sorted(no_decay)], "weight_decay": 0.0}],
                              lr=lr, betas=betas, eps=eps, weight_decay=wd)
    assert sum(len(g["params"]) for g in adamw.param_groups) + len(tables) == len(named)
    # The Q/K/V tables hold three of the paper's rows per row: the rule runs on their rows of a third of the width.
    segments = [3 if n.endswith("query_key_value.tables") else 1 for n, p in named.items() if id(p) in table_ids]
    assert segments.count(3) == model.config.num_hidden_layers
    states = [(torch.zeros(p.shape[0] * k), torch.zeros(p.shape), torch.zeros(p.shape[0] * k))
              for p, k in zip(tables, segments)]
    for step in range(1, 4):
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is None for p in table_parameters(model))  # consumed and freed in the backward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            for p, k, (s, m, v) in zip(tables, segments, states):
                w, g = p.view(-1, p.shape[1] // k), p.grad.view(-1, p.shape[1] // k)
                if rule == "rowwise_adagrad":
                    rowwise_adagrad_update(w, g, s, lr, eps, wd)
                else:
                    adam_rowwise_update(w, g, m.view(-1, p.shape[1] // k), v, step, lr, betas, eps, wd)
                p.grad = None
        adamw.step()
        adamw.zero_grad(set_to_none=True)
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_no_table_gradient_outlives_its_own_update():
    """When each table's update has run, no table holds a gradient: at most one exists at any time."""
    model = tiny_model(seed=0).train()
    optimizer = TableAdamW(table_param_groups(model, "rowwise_adagrad", 0.1), lr=1e-3)
    tables = table_parameters(model)
    alive = []

    def count(_):
        alive.append(sum(p.grad is not None for p in tables))

    for p in tables:  # registered after the optimizer's hooks, so they run after each update
        p.register_post_accumulate_grad_hook(count)
    ids = batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    assert alive == [0] * len(tables)
    optimizer.remove_hooks()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in tables)  # hooks removed: plain gradients again


@pytest.mark.parametrize("kernel", ["fused", "torch"])
@pytest.mark.parametrize("rule", ["rowwise_adagrad", "adam_rowwise"])
def test_row_wise_rules_keep_a_state_per_row_of_each_of_q_k_and_v(kernel, rule):
    """A Memory Layer whose rows hold 3 of the paper's rows (the fused Q/K/V layer): its row-wise state is [rows, 3],
    and the update equals the rule's float64 formula applied to Q, K and V as three separate tables."""
    from modeling_memoryformer.modeling_memoryformer import MemoryLayer

    require_kernel(kernel)
    torch.manual_seed(0)
    layer = MemoryLayer(8, 3 * 5, hash_bits=4, bias=False)  # 2 tables of 16 rows; Q, K, V 5 columns each
    layer.row_segments = 3
    w0 = layer.tables.detach().clone()
    optimizer = TableAdamW(table_param_groups(torch.nn.Sequential(layer), rule, 0.1), lr=0.01, betas=(0.9, 0.95),
                           eps=1e-8, weight_decay=0.1)
    grads = random_grads(w0.shape, 3, seed=4)
    for g in grads:
        g[5, 5:10] *= 100.0  # one K row far larger than its Q and V neighbours: a shared state would damp them
    with memory_ops.use_kernel(kernel):
        for g in grads:
            optimizer.update_table(layer.tables, g.clone(), optimizer.param_groups[0])
            optimizer.step()
    state = optimizer.state[layer.tables]
    second = state["sum"] if rule == "rowwise_adagrad" else state["exp_avg_sq"]
    assert second.shape == (32, 3)
    for part in range(3):
        columns = slice(5 * part, 5 * part + 5)
        if rule == "rowwise_adagrad":
            expected_w, expected_s = naive_rowwise_adagrad(w0[:, columns], [g[:, columns] for g in grads], 0.01,
                                                           1e-8, 0.1)
        else:
            expected_w, _, expected_s = naive_adam_rowwise(w0[:, columns], [g[:, columns] for g in grads], 0.01,
                                                           (0.9, 0.95), 1e-8, 0.1)
        torch.testing.assert_close(layer.tables.detach()[:, columns].double(), expected_w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(second[:, part].double(), expected_s, rtol=1e-6, atol=1e-8)


def memory_layer_net(seed: int, table_dtype: str | None = None) -> torch.nn.Sequential:
    """One Memory Layer with 10 tables of 16 rows (in 40, tau 4), 24 columns, with a bias."""
    from modeling_memoryformer.modeling_memoryformer import MemoryLayer

    torch.manual_seed(seed)
    layer = MemoryLayer(40, 24, hash_bits=4, bias=True, table_dtype=table_dtype)
    with torch.no_grad():
        layer.tables.normal_(0, 0.5)
        layer.bias.normal_(0, 0.5)
    return torch.nn.Sequential(layer)


def layer_input(seed: int, tokens: int = 37) -> torch.Tensor:
    return torch.randn(tokens, 40, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "tokens, table_dtype, tables_per_group",
    [(64, None, 1), (256, None, 2), (2048, None, 5), (2048, "bfloat16", 1)],
)
def test_update_groups_follow_the_output_gradient_and_never_hold_a_whole_layer(tokens, table_dtype, tables_per_group,
                                                                               monkeypatch):
    """Without an override, a group of tables is at least a quarter of the LLC (1 MB with the 4 MB L3 pinned here), at
    least twice the output gradient (each group re-reads it all), and at most half of the layer's tables. A layer of
    10 tables of 2 MB (256 rows x 2048 float32 columns, 20 MB): 64 tokens (0.5 MB of gradient) give one table per
    group, 256 tokens (2 MB) two, 2048 tokens (16 MB) the cap of five, never the whole layer. bfloat16 tables, which
    each group converts to float32, keep groups of the cache share whatever the gradient: one table here."""
    require_kernel("fused")
    from modeling_memoryformer.modeling_memoryformer import MemoryLayer

    monkeypatch.setattr(memory_table_updates, "UPDATE_GROUP_BYTES", None)
    torch.ops.memoryformer.set_cache_sizes(32 << 10, 256 << 10, 4 << 20)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(MemoryLayer(80, 2048, hash_bits=8, bias=False, table_dtype=table_dtype))
        optimizer = TableAdamW(table_param_groups(net, "rowwise_adagrad", 0.0), lr=0.01)
        update = getattr(net[0].tables, memory_ops.TABLE_UPDATE_ATTR)
        seen = []
        original = update.optimizer.update_rows

        def recording(param, grad, start, stop, group):
            seen.append((start, stop))
            original(param, grad, start, stop, group)

        monkeypatch.setattr(update.optimizer, "update_rows", recording)
        with memory_ops.use_kernel("fused"):
            net(torch.randn(tokens, 80)).square().mean().backward()
        optimizer.zero_grad(set_to_none=True)
    finally:
        torch.ops.memoryformer.set_cache_sizes(0, 0, 0)
    rows = tables_per_group * 256
    expected = [(start, min(start + rows, 2560)) for start in range(0, 2560, rows)]
    assert seen == expected


@pytest.mark.parametrize("kernel", ["fused", "torch", pytest.param("triton", marks=pytest.mark.slow)])  # interpreted
@pytest.mark.parametrize("rule", ["rowwise_adagrad", "adam_rowwise"])
def test_update_in_the_backward_equals_the_rule_on_the_whole_gradient(kernel, rule, monkeypatch):
    """The Memory Layer's backward updates its tables group by group (here groups of 3 of its 10 tables: 3, 3, 3, 1)
    and never holds their whole gradient; the result equals the rule applied to the whole gradient of the reference
    lookup in float64, the input and bias gradients are those of the tables before the update, and `.grad` stays
    None."""
    require_kernel(kernel)
    monkeypatch.setattr(memory_table_updates, "UPDATE_GROUP_BYTES", 3 * 16 * 24 * 4)  # 3 tables of 16 rows x 24 float32
    net = memory_layer_net(0)
    layer = net[0]
    w0 = layer.tables.detach().clone()
    optimizer = TableAdamW(table_param_groups(net, rule, 0.1), lr=0.05, betas=(0.9, 0.95))
    seen = []
    update = getattr(layer.tables, memory_ops.TABLE_UPDATE_ATTR)
    original = update.optimizer.update_rows

    def recording(param, grad, start, stop, group):
        seen.append((start, stop, tuple(grad.shape)))
        original(param, grad, start, stop, group)

    monkeypatch.setattr(update.optimizer, "update_rows", recording)
    reference_w, reference_m, reference_v = w0.double(), None, None
    state = torch.zeros(w0.shape[0], dtype=torch.float64)
    for step in (1, 2):
        x = layer_input(step).requires_grad_()
        # the oracle: the equations in float64 on the tables as they are before this step
        xr = x.detach().double().requires_grad_()
        tr = reference_w.clone().requires_grad_()
        br = layer.bias.detach().double().requires_grad_()
        yr = memory_ops.memory_lookup_reference(xr, tr, br, 4)
        (yr.square().sum() / 7).backward()
        with memory_ops.use_kernel(kernel):
            (net(x).square().sum() / 7).backward()
        assert layer.tables.grad is None
        torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer.bias.grad.double(), br.grad, rtol=1e-5, atol=1e-5)
        g = tr.grad
        if rule == "rowwise_adagrad":
            state += g.square().mean(1)
            reference_w = reference_w * (1 - 0.05 * 0.1) - 0.05 * g / (state.sqrt() + 1e-8).unsqueeze(1)
        else:
            reference_m = 0.1 * g if reference_m is None else 0.9 * reference_m + 0.1 * g
            reference_v = 0.05 * g.square().mean(1) if reference_v is None else (
                0.95 * reference_v + 0.05 * g.square().mean(1))
            step_size = (reference_m / (1 - 0.9**step)) / ((reference_v / (1 - 0.95**step)).sqrt() + 1e-8).unsqueeze(1)
            reference_w = reference_w * (1 - 0.05 * 0.1) - 0.05 * step_size
        torch.testing.assert_close(layer.tables.detach().double(), reference_w, rtol=1e-4, atol=1e-5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert seen[:4] == [(0, 48, (48, 24)), (48, 96, (48, 24)), (96, 144, (48, 24)), (144, 160, (16, 24))]
    assert len(seen) == 8  # 4 groups per step, none the whole 160-row table


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_update_in_the_backward():
    """Decoder layers recomputed in the backward (non-reentrant checkpointing) run the lookup again; the tables are
    still updated once per step, to the same values as without checkpointing."""
    results = []
    for checkpointing in (False, True):
        model = tiny_model(seed=0).train()
        if checkpointing:
            checkpointing_enable(model, use_reentrant=False)
        optimizer = TableAdamW(table_param_groups(model, "adam_rowwise", 0.1), lr=1e-2)
        for step in range(2):
            ids = batch(step)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results.append([p.detach().clone() for p in table_parameters(model)])
    assert any(not torch.equal(a, b) for a, b in zip(results[0], table_parameters(tiny_model(seed=0))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_second_backward_before_step_is_refused_and_copies_are_not_updated():
    net = memory_layer_net(1)
    optimizer = TableAdamW(table_param_groups(net, "rowwise_adagrad", 0.0), lr=0.1)
    net(layer_input(0)).sum().backward()
    with pytest.raises(RuntimeError, match="updated twice before optimizer.step"):
        net(layer_input(1)).sum().backward()
    optimizer.step()
    copied = copy.deepcopy(net)  # copies the attached update, which still names the original's tables
    before = net[0].tables.detach().clone()
    copied(layer_input(2)).sum().backward()
    assert copied[0].tables.grad is not None  # a plain gradient, nobody updated the copy's tables
    assert torch.equal(net[0].tables.detach(), before)
    optimizer.remove_hooks()
    net(layer_input(3)).sum().backward()
    assert net[0].tables.grad is not None


def test_bf16_tables_are_updated_in_the_backward_from_float32_gradients(monkeypatch):
    """bfloat16 tables: the group gradients are float32 (the lookup sums in float32) and each update lands within
    one bfloat16 step of the float32 rule's result (stochastic rounding)."""
    monkeypatch.setattr(memory_table_updates, "UPDATE_GROUP_BYTES", 4 * 16 * 24 * 4)
    net = memory_layer_net(2, table_dtype="bfloat16")
    tables = net[0].tables
    assert tables.dtype == torch.bfloat16
    grads = []
    update = getattr(tables, memory_ops.TABLE_UPDATE_ATTR) if hasattr(tables, memory_ops.TABLE_UPDATE_ATTR) else None
    assert update is None
    optimizer = TableAdamW(table_param_groups(net, "rowwise_adagrad", 0.0), lr=0.05)
    original = optimizer.update_rows

    def recording(param, grad, start, stop, group):
        grads.append(grad.dtype)
        original(param, grad, start, stop, group)

    monkeypatch.setattr(optimizer, "update_rows", recording)
    w0 = tables.detach().float().clone()
    x = layer_input(5)
    reference = w0.clone().requires_grad_()
    memory_ops.memory_lookup_reference(x, reference, net[0].bias.detach(), 4).sum().backward()
    g = reference.grad
    expected = w0 - 0.05 * g / (g.square().mean(1).sqrt() + 1e-8).unsqueeze(1)
    net(x).sum().backward()
    assert set(grads) == {torch.float32} and len(grads) == 3
    ulp = expected.abs().clamp_min(1e-30) * 2.0**-7
    assert bool(((tables.detach().float() - expected).abs() <= ulp + 1e-6).all())


def saved_and_loaded(state_dict: dict) -> dict:
    """Through a file, as a checkpoint's optimizer.pt (loaded in place, AdamW would share its step tensors)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_is_row_wise_and_round_trips_through_state_dict():
    model = tiny_model(seed=0).train()
    # one state per table row, three for a row of the fused Q/K/V table (a row of each of the paper's Q, K and V)
    rows = sum(p.shape[0] * (3 if n.endswith("query_key_value.tables") else 1) for n, p in model.named_parameters()
               if any(p is q for q in table_parameters(model)))
    values = sum(p.numel() for p in table_parameters(model))
    optimizer = TableAdamW(table_param_groups(model, "rowwise_adagrad", 0.1), lr=1e-3)
    ids = batch(0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    table_state = sum(optimizer.state[p]["sum"].numel() for p in table_parameters(model))
    assert table_state == rows < values / 8
    dense_bytes = 2 * 4 * sum(p.numel() for p in model.parameters()) - 2 * 4 * values
    assert optimizer_state_bytes(optimizer) < dense_bytes + 8 * rows + 64 * len(optimizer.state)

    clone = copy.deepcopy(model)
    restored = TableAdamW(table_param_groups(clone, "rowwise_adagrad", 0.1), lr=1e-3)
    restored.load_state_dict(saved_and_loaded(optimizer.state_dict()))
    for p, q in zip(table_parameters(model), table_parameters(clone)):
        assert torch.equal(optimizer.state[p]["sum"], restored.state[q]["sum"])
        assert restored.state[q]["sum"].dtype == torch.float32
    for m, opt in ((model, optimizer), (clone, restored)):
        ids = batch(1)
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    for (name, a), (_, b) in zip(model.named_parameters(), clone.named_parameters()):
        assert torch.equal(a, b), name


def test_bf16_tables_keep_float32_state_through_a_checkpoint():
    model = tiny_model(seed=0).train()
    for p in table_parameters(model):
        p.data = p.data.to(torch.bfloat16)
    optimizer = TableAdamW(table_param_groups(model, "adam_rowwise", 0.1), lr=1e-3)
    p = table_parameters(model)[0]
    optimizer.update_table(p, torch.randn(p.shape) * 1e-3, optimizer.param_groups[0])
    restored = TableAdamW(table_param_groups(model, "adam_rowwise", 0.1), lr=1e-3)
    restored.load_state_dict(saved_and_loaded(optimizer.state_dict()))
    for key in ("exp_avg", "exp_avg_sq"):
        assert restored.state[p][key].dtype == torch.float32
        assert torch.equal(restored.state[p][key], optimizer.state[p][key])  # not rounded through bf16


def settings(out, **overrides) -> TrainingSettings:
    fields = dict(output_dir=str(out), max_steps=8, per_device_batch_size=4, logging_steps=1, eval_steps=8,
                  report_to="none", learning_rate=3e-3, progress=False, save_final_model=False, save_steps=4,
                  warmup_ratio=0.25, table_optimizer="adam_rowwise")
    return TrainingSettings(**{**fields, **overrides})


@pytest.mark.slow
def test_trainer_resume_with_a_table_optimizer_equals_the_uninterrupted_run(tmp_path):
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                control.should_training_stop = True

    data = synthetic_lm_data()
    whole_model = tiny_model(seed=0, table_init_std=0.02).train()
    whole = train(whole_model, data, settings(tmp_path / "whole"))
    trainer = build_trainer(tiny_model(seed=0).train(), data, settings(tmp_path / "probe"))
    assert isinstance(trainer.create_optimizer(), TableAdamW)

    interrupted = tiny_model(seed=0, table_init_std=0.02).train()
    train(interrupted, data, settings(tmp_path / "resumed"), callbacks=[StopAt()])
    assert os.path.isdir(tmp_path / "resumed" / "checkpoint-4")
    resumed_model = tiny_model(seed=123).train()  # other weights: all of it must come from checkpoint-4
    resumed = train(resumed_model, data, settings(tmp_path / "resumed", resume_from_checkpoint=True))

    def curve(result):
        return [(e["step"], e["loss"]) for e in result.log_history if "loss" in e]

    assert curve(resumed) == curve(whole)
    for (name, a), (_, b) in zip(whole_model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_each_rule_learns_the_bigram_as_well_as_adamw(tmp_path):
    """30 steps on the synthetic bigram (ln 128 = 4.85 at the start): measured 1.08 for AdamW, 0.90 rowwise_adagrad,
    0.12 adam_rowwise."""
    data = synthetic_lm_data()
    losses = {}
    for rule in ("adamw", "rowwise_adagrad", "adam_rowwise"):
        result = train(tiny_model(seed=0, table_init_std=0.02).train(), data,
                       settings(tmp_path / rule, table_optimizer=rule, max_steps=30, eval_steps=30, save_steps=None))
        losses[rule] = result.eval_loss
    assert losses["adamw"] < 2.0, losses
    assert losses["rowwise_adagrad"] < losses["adamw"] + 0.2, losses
    assert losses["adam_rowwise"] < losses["adamw"] + 0.2, losses


@pytest.mark.parametrize("rule", ["rowwise_adagrad", "adam_rowwise"])
def test_setups_the_rules_cannot_run_are_refused_with_the_fix(tmp_path, rule):
    with pytest.raises(ValueError, match="--grad-accum 1 with a larger --batch-size"):
        settings(tmp_path, table_optimizer=rule, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="must be one of adamw, rowwise_adagrad, adam_rowwise"):
        settings(tmp_path, table_optimizer="sgd")
    check_table_optimizer_setup("adamw", 4)  # AdamW on every parameter: anything goes


def test_stochastic_rounding_to_bf16_is_unbiased_and_stays_between_neighbours():
    from modeling_memoryformer.training.table_optimizer import stochastic_round_to_bf16

    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    for value, fraction in ((1.0 + ulp / 8, 1 / 8), (-(1.0 + 3 * ulp / 4), 3 / 4)):
        x = torch.full((100_000,), value)
        y = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float()
        magnitudes = y.abs().unique().tolist()
        assert magnitudes == [1.0, 1.0 + ulp], magnitudes  # only the two neighbours
        share_up = (y.abs() > 1.0).double().mean().item()
        assert abs(share_up - fraction) < 4 * (fraction * (1 - fraction) / x.numel()) ** 0.5, (value, share_up)
        assert abs(y.double().mean().item() - value) < 4 * ulp * (fraction * (1 - fraction) / x.numel()) ** 0.5
    exact = torch.tensor([1.5, -2.0, 0.0, -0.0, 3.0e-3], dtype=torch.bfloat16).float()
    assert torch.equal(stochastic_round_to_bf16(exact).float(), exact)
    special = stochastic_round_to_bf16(torch.tensor([float("inf"), float("-inf"), float("nan")])).float()
    assert special[0] == float("inf") and special[1] == float("-inf") and torch.isnan(special[2])
    x = torch.randn(1000)
    a = stochastic_round_to_bf16(x, torch.Generator().manual_seed(5))
    b = stochastic_round_to_bf16(x, torch.Generator().manual_seed(5))
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)  # reproducible from the generator's state
    with pytest.raises(ValueError, match="float32"):
        stochastic_round_to_bf16(torch.ones(2, dtype=torch.float64))


def test_bf16_tables_take_updates_smaller_than_their_step_on_average():
    """Steps of at most lr = 1e-4 on weights at 1 (bf16 step there: 2**-7 = 0.0078): round to nearest would never move
    them; with stochastic rounding 100 AdaGrad steps move the mean weight by lr * sum_t 1/sqrt(t) = 0.0019, as in
    float32."""
    torch.manual_seed(0)
    weight = torch.ones(512, 64, dtype=torch.bfloat16)
    reference = torch.ones(512, 64)
    grad = torch.ones(512, 64)
    state, state_ref = torch.zeros(512), torch.zeros(512)
    for _ in range(100):
        rowwise_adagrad_update(weight, grad, state, lr=1e-4, eps=1e-8, weight_decay=0.0)
        rowwise_adagrad_update(reference, grad, state_ref, lr=1e-4, eps=1e-8, weight_decay=0.0)
    moved = 1.0 - weight.float().mean().item()
    expected = 1.0 - reference.mean().item()
    assert 0.0015 < expected < 0.0025  # 1e-4 * sum_t 1/sqrt(t)
    assert abs(moved - expected) < 0.1 * expected, (moved, expected)
    nearest = torch.ones(512, 64).add_(-1e-4).to(torch.bfloat16)
    assert torch.equal(nearest.float(), torch.ones(512, 64))  # what round to nearest would keep


def test_table_lr_multiplier_scales_the_rule_and_the_schedule_keeps_the_ratio(tmp_path):
    model = tiny_model(seed=0).train()
    trainer = build_trainer(model, synthetic_lm_data(), settings(
        tmp_path, table_optimizer="rowwise_adagrad", table_lr_multiplier=4.0, learning_rate=1e-3, warmup_ratio=0.1,
        max_steps=20))
    trainer.create_optimizer_and_scheduler(num_training_steps=20)
    optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
    table_ids = {id(p) for p in table_parameters(model)}
    for _ in range(7):  # into the cosine part of the schedule
        optimizer.step()
        scheduler.step()
        rates = {("tables" if any(id(p) in table_ids for p in g["params"]) else "dense"): g["lr"]
                 for g in optimizer.param_groups}
        assert rates["tables"] == pytest.approx(4.0 * rates["dense"], rel=1e-12) and rates["dense"] > 0
    with pytest.raises(ValueError, match="table_lr_multiplier must be > 0"):
        settings(tmp_path, table_optimizer="rowwise_adagrad", table_lr_multiplier=0.0)


@pytest.mark.slow
def test_bf16_tables_train_with_a_rule_and_adamw_on_them_is_refused(tmp_path):
    """table_dtype='bfloat16': tables in bfloat16, everything else float32; a table rule trains them (stochastic
    rounding) as well as float32 tables on the bigram, and AdamW on them is refused with the fix."""
    data = synthetic_lm_data()
    losses = {}
    for dtype in (None, "bfloat16"):
        torch.manual_seed(0)  # no tiny_model(): its .to(float32) would widen the tables
        model = MemoryFormerForCausalLM(tiny_config(table_init_std=0.02, table_dtype=dtype)).train()
        assert {t.dtype for t in table_parameters(model)} == {torch.bfloat16 if dtype else torch.float32}
        result = train(model, data, settings(tmp_path / str(dtype), table_optimizer="rowwise_adagrad", max_steps=30,
                                             eval_steps=30, save_steps=None))
        assert {t.dtype for t in table_parameters(model)} == {torch.bfloat16 if dtype else torch.float32}
        losses[dtype] = result.eval_loss
    assert losses["bfloat16"] < 2.0 and abs(losses["bfloat16"] - losses[None]) < 0.1, losses
    model = MemoryFormerForCausalLM(tiny_config(table_dtype="bfloat16")).train()
    with pytest.raises(ValueError, match="--table-optimizer rowwise_adagrad or adam_rowwise"):
        train(model, data, settings(tmp_path / "adamw", table_optimizer="adamw", save_steps=None))
