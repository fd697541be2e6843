"""Species photos with linnaeus' labels: its ``labels.h5`` read lazily (``labels``), the taxonomy
behind the per-rank class indices (``taxonomy``), and the metadata components (where, when, how
high) encoded as linnaeus encodes them (``metadata``)."""
