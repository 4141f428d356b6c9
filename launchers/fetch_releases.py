"""Fetches the third-party releases the tests read but do not install, each pinned by sha256.

``python -m launchers.fetch_releases`` (run by ``launchers/setup.sh``) puts them under
``.cache/releases/``:

* vLLM-Ascend 0.23.0.post1's sdist (this release publishes no wheel, and building one needs CANN
  and torch_npu): ``tests/test_vllm_ascend_worker.py`` loads its real ``NPUWorker`` from the archive
  with torch_npu and vLLM-Ascend's device modules stubbed, and reads its pinned requirements;
* vLLM 0.33.0 and 0.34.0 (CUDA wheels, which do not install here): ``tests/test_vllm_static.py``
  parses the modules the plugin touches with ``ast``, never importing them.

Nothing is installed or built. The index is pip's own (``PIP_INDEX_URL``, ``pip config``, else pip's
default), queried through the JSON simple API (PEP 691); ``--print-path NAME`` prints where a
release lies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "releases"


@dataclass(frozen=True)
class Release:
    project: str
    version: str
    filename: str
    sha256: str


ASCEND = Release("vllm-ascend", "0.23.0.post1", "vllm_ascend-0.23.0.post1.tar.gz",
                 "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1")
#: vLLM releases newer than the suite's environments, checked statically
VLLM_WHEELS = {
    "0.33.0": Release("vllm", "0.33.0", "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                      "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"),
    "0.34.0": Release("vllm", "0.34.0", "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                      "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"),
}
RELEASES = {"vllm-ascend": ASCEND, **{f"vllm-{v}": r for v, r in VLLM_WHEELS.items()}}
#: vLLM-Ascend's worker module inside its archive
WORKER = f"vllm_ascend-{ASCEND.version}/vllm_ascend/worker/worker.py"


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


def fetch(release: Release = ASCEND, cache: Path = CACHE) -> Path:
    """The release's file, checked against its sha256; downloaded once."""
    dest = cache / release.filename
    if dest.exists() and _sha256(dest) == release.sha256:
        return dest
    tried = []
    for index in index_urls():
        url = index.rstrip("/") + f"/{release.project}/"
        try:
            req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                files = json.load(r)["files"]
            entry = next(f for f in files if f["filename"] == release.filename)
        except (OSError, ValueError, KeyError, StopIteration) as e:
            tried.append(f"{url}: {type(e).__name__}: {e}")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_suffix(".part")
        try:
            urllib.request.urlretrieve(urllib.parse.urljoin(url, entry["url"]), part)
        except OSError as e:
            tried.append(f"{entry['url']}: {type(e).__name__}: {e}")
            continue
        got = _sha256(part)
        if got != release.sha256:
            part.unlink()
            raise SystemExit(f"{release.filename} from {index} has sha256 {got}, pinned {release.sha256}; "
                             "nothing kept")
        part.replace(dest)
        return dest
    raise SystemExit(f"{release.filename} not found on any configured index: " + "; ".join(tried))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print-path", metavar="NAME", choices=sorted(RELEASES),
                    help="print where this release lies when done")
    args = ap.parse_args(argv)
    for release in RELEASES.values():
        path = fetch(release)
        if args.print_path and RELEASES[args.print_path] is release:
            print(path)


if __name__ == "__main__":
    main()
