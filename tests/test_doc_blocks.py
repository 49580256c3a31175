"""Every ```python block of README.md and docs/**/*.md runs, page by page, against the docs' own archive.

A page's blocks run as a reader copies them: in order in one namespace that starts empty (like
a notebook: every name a block uses, an earlier block of the page defines), in a subprocess with
a hard timeout, in a fresh folder holding the docs' archive ``era5.zarr`` -- the one
``docs/getting-started.md`` writes (one year, 6-hourly, 32 x 64, time chunks of 24), which a page
that uses it without writing it says in its text, with a link to that page. Remote URLs go to
servers on 127.0.0.1 that serve the same archive: moto's S3 (``s3://bucket/era5.zarr``, through
the ``AWS_*`` environment) and the test HTTP server (the URLs in ``URLS``); only the pages in
``REMOTE_PAGES`` use them, and say in their text that the URLs stand for the reader's own.

A block that cannot run here is skipped only by a marker right before it in the markdown,
``<!-- skip: the reason -->``, and says what it needs in its first line (``# needs ...``), where
a reader sees it; the test prints every skip with its reason. A broken block fails with the
page, the block's line and first line, and the error; so does a block that warns (a warning a
reader would see), unless the page says why in ``WARNS``.

    python tests/test_doc_blocks.py PAGE [PAGE...]   # runs the pages' blocks in the current folder
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TIMEOUT_S = 240  # one page, all its blocks

#: URLs of the pages that stand for a server, and the local server that answers in its place
URLS = {"https://data.example.org": "{http}", "http://127.0.0.1:8000": "{http}", "http://127.0.0.1:9000": "{s3}"}
#: the pages whose running blocks read remote URLs (standing for the reader's own bucket or server)
REMOTE_PAGES = {"docs/how-to/remote.md"}
#: page -> why its blocks may warn (a warning they show on purpose); every other page runs without one
WARNS: dict[str, str] = {}
_REMOTE = re.compile(r"\b(?:s3|gs|az|https?)://")

_FENCE = re.compile(r"^(?P<skip><!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*\n)?```python\n(?P<code>.*?)^```", re.S | re.M)


@dataclass
class Block:
    page: str
    line: int
    code: str
    skip: str | None

    @property
    def where(self) -> str:
        first = next((s for s in self.code.splitlines() if s.strip()), "")
        return f"{self.page}:{self.line}: {first.strip()}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    rel = page.relative_to(ROOT).as_posix()
    out = []
    for mt in _FENCE.finditer(text):
        line = text.count("\n", 0, mt.start("code"))
        out.append(Block(rel, line, mt.group("code"), mt.group("reason")))
    return out


def run_page(page: str, urls: dict[str, str]) -> int:
    """Run ``page``'s blocks here, in order, in one namespace; 1 (with the error printed) on the first failure.
    Each warning a block shows (Python's default filters, as a reader's session has them, each shown
    once) is printed as ``WARNED``."""
    ns: dict = {"__name__": "__docs__"}  # nothing else: a page defines what its blocks use
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # every category, once per place (DeprecationWarnings too)
        for b in blocks(ROOT / page):
            if b.skip is not None:
                print(f"SKIPPED {b.where} ({b.skip})", flush=True)
                continue
            code = b.code
            for old, new in urls.items():
                code = code.replace(old, new)
            try:
                exec(compile(code, f"{b.page}:{b.line}", "exec"), ns)
            except BaseException:
                print(f"FAILED {b.where}\n{traceback.format_exc()}", flush=True)
                return 1
            for w in caught:
                first = str(w.message).splitlines()[0] if str(w.message) else ""
                print(f"WARNED {b.where}: {w.category.__name__}: {first} ({w.filename}:{w.lineno})", flush=True)
            caught.clear()
            print(f"RAN {b.where}", flush=True)
    return 0


if __name__ == "__main__":
    urls = {k: v.format(http=os.environ.get("DOCS_HTTP", ""), s3=os.environ.get("AWS_ENDPOINT", ""))
            for k, v in URLS.items()}
    sys.exit(max(run_page(p, urls) for p in sys.argv[1:]))


# ----------------------------------------------------------------------------- the test
import pytest  # noqa: E402

from tests.support.servers import FileServer, MotoS3  # noqa: E402


@pytest.fixture(scope="module")
def docs_home(tmp_path_factory: pytest.TempPathFactory):
    """(folder with the docs' archive, environment pointing the pages' remote URLs at 127.0.0.1)."""
    pytest.importorskip("moto", reason="the remote pages need moto's S3 server")
    from xinsitu.synthetic import write_era5_like

    home = tmp_path_factory.mktemp("docs-home")
    write_era5_like(home / "era5.zarr", nt=1460, ny=32, nx=64, chunk_time=24)  # as getting-started.md does
    with MotoS3(max_lifetime_s=1800) as s3, FileServer(home, max_lifetime_s=1800) as http:
        for bucket in ("bucket", "public-bucket"):
            s3.upload(home / "era5.zarr", bucket, "era5.zarr")
        s3.make_public("public-bucket")
        env = {**os.environ, "AWS_ENDPOINT": s3.endpoint, "AWS_ACCESS_KEY_ID": s3.access_key_id,
               "AWS_SECRET_ACCESS_KEY": s3.secret_access_key, "AWS_REGION": s3.region, "AWS_ALLOW_HTTP": "true",
               "DOCS_HTTP": http.url, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            env.pop(k, None)
        yield home, env


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
@pytest.mark.slow
def test_page_blocks_run(page: Path, docs_home, tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the docs' blocks train torch models (the leg with torch runs them)")
    bs = blocks(page)
    if not bs:
        pytest.skip("no python blocks")
    skipped = [b for b in bs if b.skip is not None]
    for b in skipped:
        print(f"skipped {b.where}: {b.skip}")
    if len(skipped) == len(bs):
        pytest.skip("; ".join(f"{b.where} ({b.skip})" for b in skipped))
    home, env = docs_home
    # a fresh folder per page, with the archive's files hard-linked (a page that rewrites it rewrites its own)
    shutil.copytree(home / "era5.zarr", tmp_path / "era5.zarr", copy_function=os.link)
    rel = page.relative_to(ROOT).as_posix()
    try:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), rel], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{rel}: its blocks took more than {TIMEOUT_S}s; ran so far:\n{e.stdout}")
    assert p.returncode == 0, f"{rel}: a block failed\n{p.stdout}\n{p.stderr[-3000:]}"
    ran = p.stdout.count("\nRAN ") + p.stdout.startswith("RAN ")
    assert ran == len(bs) - len(skipped), p.stdout
    warned = [ln for ln in p.stdout.splitlines() if ln.startswith("WARNED ")]
    if rel not in WARNS:
        assert not warned, f"{rel}: a block printed a warning a reader would see:\n" + "\n".join(warned)


def _writes_era5(code: str) -> bool:
    return bool(re.search(r"write_era5_like\(\s*[\"']era5\.zarr[\"']", code))


def test_pages_say_what_their_blocks_need() -> None:
    """What a block needs that no earlier block of its page makes is said where a reader sees it: the
    docs' archive (``era5.zarr``) by a link to Getting started, which writes it; a remote URL by a page
    about remote stores (``REMOTE_PAGES``) that says its URLs stand for the reader's own; a skipped
    block by its first line (``# needs ...``)."""
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        text = page.read_text()
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        bs = blocks(page)
        written = False
        for b in bs:
            if b.skip is not None:
                first = next((s for s in b.code.splitlines() if s.strip()), "")
                assert first.startswith("# needs "), f"{b.where}: a skipped block must say what it needs first"
                continue
            written = written or _writes_era5(b.code)
            if re.search(r"[\"']era5\.zarr[\"']", b.code) and not written:  # the local archive, not a URL's
                assert "getting-started.md" in prose, f"{b.where}: uses era5.zarr without saying where it comes from"
            if _REMOTE.search(re.sub(r"#.*", "", b.code)):
                assert rel in REMOTE_PAGES, f"{b.where}: a remote URL a reader cannot open"
                assert "stand for your" in prose, f"{rel}: say that its URLs stand for the reader's own"


def test_skip_markers_give_a_reason() -> None:
    for page in PAGES:
        text = page.read_text()
        for mt in re.finditer(r"<!--\s*skip\b(.*?)-->", text, re.S):
            assert re.match(r":\s*\S", mt.group(1)), f"{page}: a skip marker without a reason: {mt.group(0)}"
            after = text[mt.end():].lstrip(" \t")
            assert after.startswith("\n```python"), f"{page}: a skip marker not right before a python block"
