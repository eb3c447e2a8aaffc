"""The fused kernel's build folder is keyed by everything that changes the binary, and by nothing else: the same
inputs give the same folder (a build is reused), and another source, flag, compiler, CPU or torch installation gives
another (two venvs never rebuild each other's build)."""

from __future__ import annotations

import torch

from modeling_memoryformer import memory_backend_cpu


def key(monkeypatch, *, source="int x;", flags=("-O3",), compiler="g++ (GCC) 12", cpu="CPU A",
        torch_file=None) -> str:
    monkeypatch.setattr(memory_backend_cpu, "_compiler_identity", lambda _: compiler)
    monkeypatch.setattr(memory_backend_cpu, "cpu_model", lambda: cpu)
    if torch_file is not None:
        monkeypatch.setattr(torch, "__file__", torch_file)
    return memory_backend_cpu._extension_name("memoryformer_cpu", source, list(flags))


def test_the_same_inputs_give_the_same_build_folder(monkeypatch):
    assert key(monkeypatch) == key(monkeypatch)
    assert key(monkeypatch).startswith("memoryformer_cpu_")


def test_what_changes_the_binary_changes_the_build_folder(monkeypatch):
    base = key(monkeypatch)
    others = [key(monkeypatch, source="int y;"), key(monkeypatch, flags=("-O2",)),
              key(monkeypatch, compiler="clang++ 18"), key(monkeypatch, cpu="CPU B"),
              key(monkeypatch, torch_file="/another/venv/lib/python3.11/site-packages/torch/__init__.py")]
    assert len({base, *others}) == 1 + len(others)
