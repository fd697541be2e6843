"""Write a small text corpus to practise pretraining on: the help topics that ship with Python
(``pydoc_data.topics``, what ``help("if")`` prints; about 465 KB), as JSON Lines files with one
document per line (``{"text": ...}``), the layout ``linnaeus-accel tokenize`` reads.

    python examples/help_corpus.py corpus/

writes two sources a mixture can weigh against each other: ``corpus/reference-{0,1,2}.jsonl``
(the longer topics, prose of the language reference, in three shards) and
``corpus/keywords.jsonl`` (the short ones). Your own corpus takes their place: any ``.txt``,
``.jsonl`` or ``.parquet`` files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from linnaeus_accel.data.text import load_topics

SHORT = 2_000  # bytes: a topic shorter than this is a "keyword" topic


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    topics = load_topics()
    reference = [text for _, text in topics if len(text) >= SHORT]
    keywords = [text for _, text in topics if len(text) < SHORT]
    shards = {f"reference-{i}.jsonl": reference[i::3] for i in range(3)}
    shards["keywords.jsonl"] = keywords
    for name, texts in shards.items():
        lines = (json.dumps({"text": text.decode("utf-8")}) + "\n" for text in texts)
        (out / name).write_text("".join(lines), encoding="utf-8")
        print(f"{out / name}: {len(texts)} documents, {sum(map(len, texts)):,} bytes")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
