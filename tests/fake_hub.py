"""A Hugging Face hub on 127.0.0.1 serving local directories as repositories: the three calls
`huggingface_hub.snapshot_download` makes (the revision's info, the file tree, each file's HEAD and
GET), so hub-id resolution is tested online without the network. Records every request path."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos  # repo id -> the directory its `main` (and COMMIT) serves
        self.requests: list[str] = []
        self.url = ""

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:  # noqa: N802 -- http.server's name
            self._serve(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"]:
                return self._api(parts[2:], body)
            # /{org}/{name}/resolve/{revision}/{file...}
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            self._error(404, "RepoNotFound")

        def _api(self, parts: list[str], body: bool) -> None:
            repo, rest = "/".join(parts[:2]), parts[2:]
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            if rest[:1] == ["revision"]:
                if rest[1] not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound")
                siblings = [{"rfilename": name} for name in hub.files(repo)]
                return self._json({"id": repo, "sha": COMMIT, "siblings": siblings, "private": False}, body)
            if rest[:1] == ["tree"]:
                tree = [{"type": "file", "path": name, "size": file.stat().st_size, "oid": _oid(file)}
                        for name, file in hub.files(repo).items()]
                return self._json(tree, body)
            self._error(404, "EntryNotFound")

        def _file(self, repo: str, revision: str, name: str, body: bool) -> None:
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            if revision not in ("main", COMMIT):
                return self._error(404, "RevisionNotFound")
            file = hub.files(repo).get(name)
            if file is None:
                return self._error(404, "EntryNotFound")
            data = file.read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{_oid(file)}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _json(self, value: object, body: bool) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str) -> None:
            data = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _oid(file: Path) -> str:
    return hashlib.sha1(file.read_bytes()).hexdigest()


@contextmanager
def fake_hub(repos: dict[str, Path]) -> Iterator[FakeHub]:
    """Serve `repos` on 127.0.0.1 (`hub.url`) until the block ends; the server's thread is joined."""
    hub = FakeHub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fake-hub")
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
