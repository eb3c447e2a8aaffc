"""A local stand-in for the Hugging Face Hub: the part of its HTTP API that huggingface_hub 2.4 and transformers 5.23
use to create a model repo, commit files to it and download them again.

The real client talks to it unchanged once `HF_ENDPOINT` points here (set it before huggingface_hub is imported,
i.e. in the environment of a subprocess). Endpoints, as the client calls them:

    POST /api/repos/create                               create a model repo (409 if it exists)
    POST /api/validate-yaml                              check a README.md's YAML metadata (before a commit)
    POST /api/models/{repo}/preupload/{rev}              upload mode of each file
    POST /api/models/{repo}/commit/{rev}                 NDJSON commit: header, then one line per file
    GET  /api/models/{repo}[/revision/{rev}]             model info (sha, siblings)
    GET  /api/models/{repo}/tree/{rev}[/{path}]          file listing (snapshot_download, chat templates)
    HEAD/GET /{repo}/resolve/{rev}/{path}                file content with X-Repo-Commit and ETag

Errors carry the `X-Error-Code` the client turns into typed exceptions (RepoNotFound, RevisionNotFound,
EntryNotFound). Writes need `Authorization: Bearer <token>` when the hub has a token; private repos are hidden from
anonymous readers, as on the Hub.

Uploads: the preupload answer tells the client to send every file as a "regular" git blob, base64 inline in the
commit. The real Hub answers "lfs" for large or binary files such as model.safetensors, and huggingface_hub 2.4 then
uploads them through the Xet storage protocol (a separate CAS service, `hf_xet`) before committing an `lfsFile`
line; the stand-in does not implement Xet, so it asks for the regular path, which the client supports for any size
and which leaves the commit itself (one NDJSON request, atomic) the same. An `lfsFile` line is rejected.

Blobs are stored on disk under `root/blobs/<git blob sha1>`; repos, commits and refs live in memory for the
lifetime of the server.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml


DEFAULT_NAMESPACE = "local-user"  # the account a bare repo name ("my-model") is created in
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_API_REPO = re.compile(rf"^/api/models/(?P<repo>{_NAME}/{_NAME})(?P<rest>/.*)?$")
_RESOLVE = re.compile(rf"^/(?P<repo>{_NAME}/{_NAME})/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file's content (what the Hub reports as `oid` and ETag for non-LFS files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    files: dict[str, str]  # path -> blob sha1


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> Commit | None:
        return self.commits[-1] if self.commits else None

    def find(self, revision: str) -> Commit | None:
        """The commit a revision names: "main" (the head) or a full commit sha. An empty repo's main is empty."""
        if revision == "main":
            return self.head or Commit(oid="0" * 40, parent=None, message="", files={})
        return next((commit for commit in self.commits if commit.oid == revision), None)


class HubError(Exception):
    """An HTTP error answer: status, the Hub's X-Error-Code (if any) and a message."""

    def __init__(self, status: int, message: str, error_code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_code = status, message, error_code


class LocalHub:
    """The stand-in Hub: `with LocalHub(tmp_dir, token="...") as hub:` serves on `hub.url` (127.0.0.1, a free port)
    from a background thread. `hub.repos` and `hub.requests` (method, path) let a test inspect what happened."""

    def __init__(self, root: str | Path, token: str | None = None):
        self.root = Path(root)
        self.blob_dir = self.root / "blobs"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-hub", daemon=True)

    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    # ------------------------------------------------------------------------------------------------------------
    # Storage
    def read_file(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        """A committed file's bytes (KeyError if absent): what a test compares against what it pushed."""
        commit = self.repos[repo_id].find(revision)
        return (self.blob_dir / commit.files[path]).read_bytes()

    def _store_blob(self, data: bytes) -> str:
        oid = git_blob_sha1(data)
        path = self.blob_dir / oid
        if not path.exists():
            tmp = path.with_suffix(f".tmp{threading.get_ident()}")
            tmp.write_bytes(data)
            tmp.replace(path)
        return oid

    # ------------------------------------------------------------------------------------------------------------
    # Access checks
    def _is_authorized(self, headers) -> bool:
        return self.token is None or headers.get("Authorization") == f"Bearer {self.token}"

    def _check_write(self, headers) -> None:
        if not self._is_authorized(headers):
            raise HubError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str, headers) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not self._is_authorized(headers)):
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def _commit(self, repo: Repo, revision: str) -> Commit:
        commit = repo.find(unquote(revision))
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    # ------------------------------------------------------------------------------------------------------------
    # Endpoints: each returns (status, headers, body) or raises HubError
    def create_repo(self, headers, payload: dict) -> tuple[int, dict, bytes]:
        self._check_write(headers)
        if payload.get("type", "model") != "model":
            raise HubError(400, f"The stand-in Hub only hosts model repos, got type={payload.get('type')!r}")
        name, namespace = payload.get("name"), payload.get("organization") or DEFAULT_NAMESPACE
        repo_id = f"{namespace}/{name}"
        if not isinstance(name, str) or not re.fullmatch(f"{_NAME}/{_NAME}", repo_id):
            raise HubError(400, f"Invalid repo name {repo_id!r}")
        url = f"{self.url}/{repo_id}"
        with self._lock:
            if repo_id in self.repos:
                return _json(409, {"error": "You already created this model repo", "url": url})
            private = payload.get("visibility") == "private" or payload.get("private") is True
            self.repos[repo_id] = Repo(repo_id=repo_id, private=private)
        return _json(200, {"url": url, "name": repo_id})

    def validate_yaml(self, payload: dict) -> tuple[int, dict, bytes]:
        """The Hub's metadata check: the front matter must be a YAML mapping; list fields must be lists."""
        match = re.match(r"^---\n(.*?)\n---\n", payload.get("content", ""), re.S)
        if match is None:
            return _json(200, {"errors": [], "warnings": [{"message": "empty or missing yaml metadata"}]})
        try:
            metadata = yaml.safe_load(match[1])
        except yaml.YAMLError as error:
            return _json(400, {"errors": [{"message": f"invalid YAML: {error}"}], "warnings": []})
        errors = [] if isinstance(metadata, dict) else [{"message": "metadata must be a YAML mapping"}]
        for key in ("tags", "datasets", "metrics"):
            if isinstance(metadata, dict) and key in metadata and not isinstance(metadata[key], list):
                errors.append({"message": f'"{key}" must be a list'})
        return _json(400 if errors else 200, {"errors": errors, "warnings": []})

    def preupload(self, headers, repo_id: str, revision: str, payload: dict) -> tuple[int, dict, bytes]:
        self._check_write(headers)
        commit = self._commit(self._repo(repo_id, headers), revision)
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": commit.files.get(f["path"])}
            for f in payload["files"]
        ]
        return _json(200, {"files": files, "commitOid": commit.oid})

    def commit(self, headers, repo_id: str, revision: str, body: bytes) -> tuple[int, dict, bytes]:
        self._check_write(headers)
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "A commit starts with a header line")
        header = lines[0]["value"]
        added: dict[str, bytes] = {}
        deleted: list[tuple[str, bool]] = []
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"Unsupported encoding {value.get('encoding')!r} for {value['path']}")
                added[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append((value["path"], key == "deletedFolder"))
            else:
                raise HubError(400, f"The stand-in Hub accepts only regular files, got a {key!r} line")
        with self._lock:
            repo = self._repo(repo_id, headers)
            if unquote(revision) != "main":
                raise HubError(400, "The stand-in Hub commits to main only")
            parent = repo.head
            if header.get("parentCommit") and header["parentCommit"] != (parent.oid if parent else None):
                raise HubError(412, "A commit has happened since the parent commit: pull and retry")
            files = dict(parent.files) if parent else {}
            for path, is_folder in deleted:
                for existing in [p for p in files if p == path or (is_folder and p.startswith(path.rstrip("/") + "/"))]:
                    del files[existing]
            files.update({path: self._store_blob(data) for path, data in added.items()})
            state = json.dumps([parent.oid if parent else None, header.get("summary"), sorted(files.items()),
                                time.time_ns()])
            commit = Commit(hashlib.sha1(state.encode()).hexdigest(), parent.oid if parent else None,
                            header.get("summary", ""), files)
            repo.commits.append(commit)
        body = {"success": True, "commitOid": commit.oid, "commitUrl": f"{self.url}/{repo_id}/commit/{commit.oid}",
                "pullRequestUrl": None}
        return _json(200, body)

    def model_info(self, headers, repo_id: str, revision: str) -> tuple[int, dict, bytes]:
        repo = self._repo(repo_id, headers)
        commit = self._commit(repo, revision)
        return _json(200, {
            "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0], "sha": commit.oid,
            "private": repo.private, "gated": False, "disabled": False, "tags": [],
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        })

    def tree(self, headers, repo_id: str, revision: str, folder: str, recursive: bool) -> tuple[int, dict, bytes]:
        commit = self._commit(self._repo(repo_id, headers), revision)
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        entries: dict[str, dict] = {}
        for path, oid in sorted(commit.files.items()):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            if len(parts) == 1 or recursive:
                entries[path] = {"type": "file", "oid": oid, "size": (self.blob_dir / oid).stat().st_size,
                                 "path": path}
            for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
                directory = prefix + "/".join(parts[:depth])
                entries.setdefault(directory, {"type": "directory", "oid": "0" * 40, "path": directory})
        if prefix and not entries:
            raise HubError(404, f"Entry not found: {folder}", "EntryNotFound")
        return _json(200, list(entries.values()))

    def resolve(self, headers, repo_id: str, revision: str, path: str) -> tuple[int, dict, bytes]:
        commit = self._commit(self._repo(repo_id, headers), revision)
        oid = commit.files.get(path)
        if oid is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        data = (self.blob_dir / oid).read_bytes()
        return 200, {"X-Repo-Commit": commit.oid, "ETag": f'"{oid}"', "Content-Type": "application/octet-stream"}, data


def _json(status: int, value) -> tuple[int, dict, bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(value).encode()


def _make_handler(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

        def log_message(self, format: str, *args) -> None:  # quiet: tests read hub.requests instead
            pass

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _answer(self, send_body: bool) -> None:
            url = urlsplit(self.path)
            with hub._lock:
                hub.requests.append((self.command, url.path))
            try:
                status, headers, body = self._route(url.path, parse_qs(url.query))
            except HubError as error:
                status, headers, body = _json(error.status, {"error": error.message})
                headers["X-Error-Message"] = error.message
                if error.error_code:
                    headers["X-Error-Code"] = error.error_code
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(name, value)
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def _route(self, path: str, query: dict) -> tuple[int, dict, bytes]:
            method = self.command
            if method == "POST" and path == "/api/repos/create":
                return hub.create_repo(self.headers, json.loads(self._body()))
            if method == "POST" and path == "/api/validate-yaml":
                return hub.validate_yaml(json.loads(self._body()))
            if match := _API_REPO.match(path):
                repo_id, rest = match["repo"], match["rest"] or ""
                if method == "POST" and (m := re.fullmatch(r"/preupload/([^/]+)", rest)):
                    return hub.preupload(self.headers, repo_id, m[1], json.loads(self._body()))
                if method == "POST" and (m := re.fullmatch(r"/commit/([^/]+)", rest)):
                    return hub.commit(self.headers, repo_id, m[1], self._body())
                if method == "GET" and (m := re.fullmatch(r"(?:/revision/([^/]+))?", rest)):
                    return hub.model_info(self.headers, repo_id, m[1] or "main")
                if method == "GET" and (m := re.fullmatch(r"/tree/([^/]+)(?:/(.+))?", rest)):
                    recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                    return hub.tree(self.headers, repo_id, m[1], unquote(m[2] or ""), recursive)
            if method in ("GET", "HEAD") and (match := _RESOLVE.match(path)):
                return hub.resolve(self.headers, match["repo"], match["rev"], unquote(match["path"]))
            raise HubError(501, f"The stand-in Hub does not implement {method} {path}")

        def do_GET(self) -> None:  # BaseHTTPRequestHandler's naming
            self._answer(send_body=True)

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def do_POST(self) -> None:
            self._answer(send_body=True)

    return Handler
