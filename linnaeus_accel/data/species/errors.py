"""The species data's own error, apart from the modules that decode photos: the training loop
recognises it (one sentence, no traceback) without importing Pillow, which only the ``species``
extra installs."""

from __future__ import annotations


class UnreadablePhoto(ValueError):
    """A photo of the split that cannot be decoded, met while reading its sample: the message names
    the file, the row of the labels (or table) and its identifier. The Trainer stops the run on it
    (``RunFailed``: this sentence, no traceback), keeping the last checkpoint."""

    def __init__(self, message: str) -> None:
        # Raised in a DataLoader worker, it reaches the training process rebuilt by torch as
        # UnreadablePhoto(text), the text being the worker's whole traceback ("Caught UnreadablePhoto
        # in DataLoader worker process 0. Original Traceback ... <module>.UnreadablePhoto: <message>"):
        # the message alone is kept. One argument: torch raises a RuntimeError of the text instead
        # when it cannot call the class with it (as ImageProblem's two arguments would make it).
        marker = f"{__name__}.UnreadablePhoto: "  # the class's module, as torch prints it
        if message.startswith("Caught ") and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)
