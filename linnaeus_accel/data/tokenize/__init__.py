"""The ``tokenize`` command: text in (files, globs, Hugging Face datasets), token files out."""
