"""MemoryFormer with other libraries: tools around the model unit (they import the model, never the other way).

    hub          the Hugging Face Hub: a generated model card and a one-commit upload (`memoryformer push`)
    peft         PEFT / LoRA configurations and adapters for Memory Layers
    distributed  FSDP2 sharding of a MemoryFormer
"""
