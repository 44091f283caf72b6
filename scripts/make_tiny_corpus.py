"""Write data/tiny/python_docs.jsonl: the Python language reference topics that CPython ships in
`pydoc_data.topics` (PSF licence), one document per topic. Shipped so tiny.yaml trains offline on
every machine with identical data; re-run to regenerate."""

import json
from pathlib import Path
from pydoc_data.topics import topics

out = Path(__file__).resolve().parent.parent / "data" / "tiny" / "python_docs.jsonl"
out.parent.mkdir(parents=True, exist_ok=True)
with out.open("w") as f:
    for name in sorted(topics):
        f.write(json.dumps({"topic": name, "text": topics[name].strip() + "\n"}) + "\n")
print(f"wrote {out} ({out.stat().st_size} bytes, {len(topics)} documents)")
