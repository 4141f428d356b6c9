"""Fetches the vLLM-Ascend source release that the tests check the plugin against.

``python -m launchers.fetch_vllm_ascend`` (run by ``launchers/setup.sh``) puts the pinned sdist at
``.cache/vllm-ascend/``, checked against its sha256. The sdist, not a wheel: this release
publishes no wheel, and building one needs CANN and torch_npu. Nothing is installed or built; the
test (``tests/test_vllm_ascend_worker.py``) loads ``vllm_ascend/worker/worker.py`` straight from
the archive with torch_npu and vLLM-Ascend's other modules stubbed.

The index is pip's own (``PIP_INDEX_URL``, ``pip config``, else pip's default), queried through
the JSON simple API (PEP 691); ``--print-path`` prints where the archive lies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

PROJECT = "vllm-ascend"
VERSION = "0.23.0.post1"
FILENAME = f"vllm_ascend-{VERSION}.tar.gz"
SHA256 = "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1"
#: the worker module inside the archive
WORKER = f"vllm_ascend-{VERSION}/vllm_ascend/worker/worker.py"

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".cache" / "vllm-ascend" / FILENAME


def _pip_config(key: str) -> str | None:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "get", key], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def index_urls() -> list[str]:
    main = os.environ.get("PIP_INDEX_URL") or _pip_config("global.index-url")
    if not main:
        from pip._internal.models.index import PyPI

        main = PyPI.simple_url
    extra = os.environ.get("PIP_EXTRA_INDEX_URL") or _pip_config("global.extra-index-url") or ""
    return [u for u in [main, *extra.split()] if u.startswith(("http://", "https://"))]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(dest: Path = DEST) -> Path:
    if dest.exists() and _sha256(dest) == SHA256:
        return dest
    tried = []
    for index in index_urls():
        url = index.rstrip("/") + f"/{PROJECT}/"
        try:
            req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                files = json.load(r)["files"]
            entry = next(f for f in files if f["filename"] == FILENAME)
        except (OSError, ValueError, KeyError, StopIteration) as e:
            tried.append(f"{url}: {type(e).__name__}: {e}")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_suffix(".part")
        urllib.request.urlretrieve(entry["url"], part)
        got = _sha256(part)
        if got != SHA256:
            part.unlink()
            raise SystemExit(f"{FILENAME} from {index} has sha256 {got}, pinned {SHA256}; nothing kept")
        part.replace(dest)
        return dest
    raise SystemExit(f"{FILENAME} not found on any configured index: " + "; ".join(tried))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print-path", action="store_true", help="print the archive's path when done")
    args = ap.parse_args(argv)
    path = fetch()
    if args.print_path:
        print(path)


if __name__ == "__main__":
    main()
