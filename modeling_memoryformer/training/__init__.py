"""Training MemoryFormer: a tool around the model unit (it imports the model, never the other way).

    data         text -> tokens -> fixed-length blocks, with a held-out validation set; tokenizers
    trainer      `transformers.Trainer` with the paper's recipe (`memoryformer train`)
    checkpoints  nothing lost: complete checkpoints, strict loading, no run overwritten unasked
"""
