"""Measuring MemoryFormer: a tool around the model unit (it imports the model, never the other way).

    harness        lm-evaluation-harness on the paper's zero-shot tasks, sliding-window perplexity (`memoryformer eval`)
    buckets        bucket-hit statistics of the hash tables, paper Fig. 4 (`memoryformer buckets`)
    flops          FLOPs per block and table memory against the Pythia twin, paper Table 1 (`memoryformer flops`)
    kernel_report  CPU, caches and the fused kernel's plan per Memory Layer (`memoryformer kernels`); run facts
"""
