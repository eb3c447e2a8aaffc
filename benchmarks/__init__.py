"""MemoryFormer-HF benchmark suite (`python -m benchmarks.run`, `make bench`).

- `layer_bench`: one MemoryLayer (every available kernel) vs the nn.Linear it replaces, forward and
  forward + backward, float32 and bfloat16.
- `model_bench`: MF-tiny / MF-small vs their GPT-NeoX (Pythia) twins: prefill, decode and training-step
  throughput, and peak resident memory (measured in separate subprocesses).
- `report`: results.json, results.md and the PNG charts in benchmarks/results/.

All timings are medians over repeats taken round-robin across the contestants (each repeat runs every
contestant once), after warm-up runs that are not timed. See `common.round_robin`.
"""
