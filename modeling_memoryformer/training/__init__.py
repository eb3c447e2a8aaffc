"""Training MemoryFormer: a tool around the model unit (it imports the model, never the other way).

    data         text -> tokens -> fixed-length blocks, with a held-out validation set; tokenizers
    trainer      `transformers.Trainer` with the paper's recipe (`memoryformer train`)
    checkpoints  nothing lost: complete checkpoints, strict loading, no run overwritten unasked
    table_optimizer  row-wise table optimizers applied in the backward pass (`--table-optimizer`)
"""

# The choices of `--table-optimizer`, here so that the command line reads them without importing torch.
# adamw: the tables in AdamW like every parameter.
TABLE_OPTIMIZERS = ("adamw", "rowwise_adagrad", "adam_rowwise")
