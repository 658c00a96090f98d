"""A Hugging Face Hub endpoint on 127.0.0.1 for huggingface_hub's real client, in the test process.

It answers the requests huggingface_hub 2.4 makes for HfApi.create_repo, repo_info at a
revision (revision_exists), create_branch and upload_folder (README.md's validate-yaml,
preupload, commit), as read from its source (hf_api.py, _commit_api.py,
_upload_pipeline.py), and the registry it fetches once per process to name the agent
running it in its user agent (utils/_detect_agent.py), and records what arrives. Preupload answers "regular" for every
file, so the commit carries every file inline (base64 in the ndjson payload) and no LFS or
Xet transfer is needed. Requests without the expected `Authorization: Bearer` token get
the Hub's 401; a route it does not know gets a 404 and is recorded in `unknown`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

REPO = r"(?P<repo>[^/]+/[^/]+)"
REF = r"(?P<ref>[^/]+)"  # a revision, URL-quoted with safe="" by the client


@dataclass
class Commit:
    repo: str
    branch: str
    summary: str
    description: str
    files: dict[str, bytes]
    oid: str


@dataclass
class Repo:
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    heads: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})


class LocalHub:
    """The endpoint's state: repos, and what arrived (`requests`, `created`, `commits`)."""

    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) in arrival order
        self.created: list[dict] = []  # create_repo payloads
        self.branches_created: list[tuple[str, str, str | None]] = []  # (repo, branch, starting point)
        self.validated: list[str] = []  # README.md texts sent to validate-yaml
        self.commits: list[Commit] = []
        self.unknown: list[tuple[str, str]] = []
        self.errors: list[str] = []  # exceptions in the handler (a test bug or an unexpected payload)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo: str, branch: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo].branches[branch])

    # routes: (method, pattern, handler); a handler returns (status, json body, extra headers)
    def routes(self):
        return [
            ("POST", r"/api/repos/create", self.create_repo),
            ("GET", rf"/api/models/{REPO}(/revision/{REF})?", self.repo_info),
            ("POST", rf"/api/models/{REPO}/branch/{REF}", self.create_branch),
            ("POST", r"/api/validate-yaml", self.validate_yaml),
            ("POST", rf"/api/models/{REPO}/preupload/{REF}", self.preupload),
            ("POST", rf"/api/models/{REPO}/commit/{REF}", self.commit),
        ]

    def create_repo(self, body: bytes, **_):
        payload = json.loads(body)
        self.created.append(payload)
        repo = f"{payload['organization']}/{payload['name']}"
        url = f"{self.url}/{repo}"
        if repo in self.repos:
            return 409, {"error": "You already created this model repo", "url": url}, {}
        self.repos[repo] = Repo(private=payload.get("visibility") == "private")
        return 200, {"url": url, "name": repo, "id": repo}, {}

    def repo_info(self, repo: str, ref: str | None = None, **_):
        found = self._find(repo, ref or "main")
        if not isinstance(found, Repo):
            return found
        branch = unquote(ref or "main")
        return 200, {"id": repo, "sha": found.heads[branch], "private": found.private}, {}

    def create_branch(self, repo: str, ref: str, body: bytes, **_):
        found = self._find(repo)
        if not isinstance(found, Repo):
            return found
        branch, start = unquote(ref), json.loads(body or b"{}").get("startingPoint")
        if branch in found.branches:
            return 409, {"error": f"Reference refs/heads/{branch} already exists"}, {}
        self.branches_created.append((repo, branch, start))
        found.branches[branch] = dict(found.branches[start or "main"])
        found.heads[branch] = found.heads[start or "main"]
        return 200, {}, {}

    def validate_yaml(self, body: bytes, **_):
        self.validated.append(json.loads(body)["content"])
        return 200, {"errors": [], "warnings": []}, {}

    def preupload(self, repo: str, ref: str, body: bytes, **_):
        found = self._find(repo, ref)
        if not isinstance(found, Repo):
            return found
        files = json.loads(body)["files"]
        return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                               for f in files]}, {}

    def commit(self, repo: str, ref: str, body: bytes, **_):
        found = self._find(repo, ref)
        if not isinstance(found, Repo):
            return found
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = lines[0]["value"]
        files = {}
        for line in lines[1:]:
            if line["key"] != "file" or line["value"]["encoding"] != "base64":
                return 400, {"error": f"the local hub takes inline files only, not {line['key']}"}, {}
            files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        branch = unquote(ref)
        oid = hashlib.sha1(body).hexdigest()
        found.branches[branch].update(files)
        found.heads[branch] = oid
        self.commits.append(Commit(repo, branch, header["summary"], header.get("description", ""), files, oid))
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}, {}

    def _find(self, repo: str, ref: str | None = None):
        """The repo, or the Hub's 404 answer for a missing repo or revision."""
        found = self.repos.get(repo)
        if found is None:
            return 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
        if ref is not None and unquote(ref) not in found.branches:
            return 404, {"error": f"Invalid rev id: {unquote(ref)}"}, {"X-Error-Code": "RevisionNotFound"}
        return found

    def answer(self, method: str, path: str, headers, body: bytes):
        with self._lock:
            self.requests.append((method, path))
            if (method, path) == ("GET", "/api/agent-harnesses"):  # public: huggingface_hub's agent detection
                return 200, {"standardEnvVars": [], "harnesses": {}}, {}
            if headers.get("authorization") != f"Bearer {self.token}":
                message = "Invalid credentials in Authorization header"
                return 401, {"error": message}, {"X-Error-Message": message}
            for verb, pattern, route in self.routes():
                match = re.fullmatch(pattern, path)
                if verb == method and match:
                    args = {k: v for k, v in match.groupdict().items() if v is not None}
                    return route(body=body, **args)
            self.unknown.append((method, path))
            return 404, {"error": f"the local hub has no route {method} {path}"}, {}


def _handler(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                status, data, headers = hub.answer(method, urlsplit(self.path).path, self.headers, body)
            except Exception as error:  # a 400, never a 5xx: the client would retry those for seconds
                hub.errors.append(f"{method} {self.path}: {error!r}")
                status, data, headers = 400, {"error": repr(error)}, {}
            payload = json.dumps(data).encode()
            self.send_response(status)
            for key, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def log_message(self, *args):  # quiet: the test asserts on what was recorded
            pass

    return Handler
