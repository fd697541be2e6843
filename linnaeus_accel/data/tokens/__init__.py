"""Token files: their format on disk, a corpus of them, the vocabulary they were made with, fixed
windows over them, and packing documents into training sequences."""
