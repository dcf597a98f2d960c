"""Data: the tokenizers, the memory-mapped token datasets and their writer, chat templates, and each dataset's prepare.py (<dataset>/prepare.py -> train.bin, val.bin)."""
