"""transformers' own common model tests run on MemoryFormer (a package, so that its conftest.py is not `conftest`)."""
