"""MemoryFormer against its Pythia twin: a tool on top of training, evaluation and conversion (it imports them and
the model unit, never the other way).

    twin  the Pythia-shaped dense twin (GPT-NeoX of the same width, depth, heads, vocabulary and rotary)
    demo  the main job: a MemoryFormer and its twin trained side by side on the same tokens (`memoryformer demo`)
"""
