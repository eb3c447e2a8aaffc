"""Synthetic causal-LM data for the training tests: every next token is a fixed function of the previous one, so a
model that learns the bigram drives the loss far below ln(vocab)."""

from __future__ import annotations

import torch

from modeling_memoryformer.training.data import LMData, TokenBlocks


def bigram_blocks(count: int, block_size: int, vocab_size: int, seed: int) -> torch.Tensor:
    """[count, block_size] sequences t_{j+1} = (3 t_j + 1) mod vocab_size from random starts."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.empty(count, block_size, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab_size, (count,), generator=generator)
    for j in range(1, block_size):
        ids[:, j] = (3 * ids[:, j - 1] + 1) % vocab_size
    return ids


def synthetic_lm_data(vocab_size: int = 128, block_size: int = 16, train_blocks: int = 64,
                      validation_blocks: int = 8) -> LMData:
    train = TokenBlocks(bigram_blocks(train_blocks, block_size, vocab_size, seed=0))
    validation = TokenBlocks(bigram_blocks(validation_blocks, block_size, vocab_size, seed=1))
    return LMData(
        train=train, validation=validation, tokenizer=None, description="synthetic bigram", block_size=block_size,
        num_train_tokens=train_blocks * block_size, num_validation_tokens=validation_blocks * block_size,
        dropped_tokens=0,
    )
