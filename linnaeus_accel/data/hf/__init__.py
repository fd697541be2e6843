"""Hugging Face ``datasets``: map-style and streamed, tokenized and packed on the fly."""
