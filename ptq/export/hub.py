"""Publish a ptq checkpoint on the Hugging Face Hub, through huggingface_hub's own client.

    url = ptq.push_to_hub("tiny-llama-w4a16-gptq", "me/tiny-llama-w4a16-gptq", private=True)

The repository is created when missing (an existing one keeps its visibility), a
`revision` branch is created from main when missing, and the checkpoint's files go up in
one upload_folder call: exactly the files its manifest (ptq.json) lists, and ptq.json.
The token is `token`, else what huggingface_hub finds (HF_TOKEN, then `hf auth login`);
the endpoint is huggingface_hub's (HF_ENDPOINT), and HF_HUB_OFFLINE is honoured.

Everything that can be checked locally is checked before the first request: the folder
is a complete ptq checkpoint with no other file, the repo id is OWNER/NAME, the Hub is not
switched off, a token exists. Failures are one-line PtqErrors saying what to do.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from httpx2 import TransportError  # huggingface_hub 2's HTTP client: connection failures, timeouts
from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

from ptq.checkpoint.output import MANIFEST, foreign_files
from ptq.errors import PtqError
from ptq.safetensors_check import shorten

LOGIN = "set HF_TOKEN to a token with write access, or run `hf auth login`"
OFFLINE = "HF_HUB_OFFLINE is set, so huggingface_hub makes no request: unset it to push to the Hub"


def push_to_hub(
    path: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
) -> str:
    """Upload the ptq checkpoint in `path` to the Hub model repo `repo_id` (OWNER/NAME) and
    return the URL of the commit. private=True creates a new repo private; False leaves a new
    repo's visibility to the Hub (public unless the organisation's default is private).
    revision: the branch to commit to (created from main when missing); None: main."""
    folder = Path(path)
    files = checkpoint_files(folder)
    token = check_push(repo_id, revision=revision, token=token)
    message = commit_message or f"Upload {folder.resolve().name} (quantized with ptq)"
    api = HfApi(token=token)
    with _hub_errors(api.endpoint, repo_id):
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        if revision is not None and not api.revision_exists(repo_id, revision):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=folder, revision=revision, commit_message=message,
            allow_patterns=[_literal(name) for name in files],
        )
    return str(commit.commit_url)


def check_push(repo_id: str, *, revision: str | None = None, token: str | None = None) -> str:
    """Raise PtqError unless a push to repo_id can start: a valid OWNER/NAME, a usable
    revision, the Hub not switched off (HF_HUB_OFFLINE), a token. Returns the token.
    No network: `ptq quantize --push-to-hub` calls it before the work starts."""
    _check_repo_id(repo_id)
    if revision is not None and (not revision.strip() or any(c.isspace() for c in revision) or len(revision) > 200):
        raise PtqError(f"revision {revision[:60]!r} is not a branch name; give a name such as 'w4a16', or none "
                       "for main")
    if constants.is_offline_mode():
        raise PtqError(OFFLINE)
    token = token or get_token()
    if not token:
        raise PtqError(f"no Hugging Face token found to push to '{repo_id}': {LOGIN}")
    return token


def _check_repo_id(repo_id: str) -> None:
    shown = repr(repo_id[:80]) if isinstance(repo_id, str) else type(repo_id).__name__
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise PtqError(f"repo id {shown} is not OWNER/NAME; give your user or organisation and a name, "
                       "e.g. me/tiny-w4a16")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PtqError(f"repo id {shown} is not valid on the Hub: {shorten(error, 300)}") from None


def checkpoint_files(folder: Path) -> list[str]:
    """The files to upload: those the folder's manifest lists, and the manifest. PtqError
    unless the folder is a complete ptq checkpoint that holds nothing else."""
    shown = str(folder)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise PtqError(f"checkpoint '{shown}' {what}; give the folder ptq quantize or ptq.save wrote")
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise PtqError(f"'{shown}' is not a ptq checkpoint (it has no {MANIFEST}); give the folder ptq quantize "
                       "or ptq.save wrote") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise PtqError(f"'{shown}/{MANIFEST}' is not a ptq manifest; write the checkpoint again with ptq") from None
    if not isinstance(listed, dict) or not all(isinstance(name, str) for name in listed):
        raise PtqError(f"'{shown}/{MANIFEST}' is not a ptq manifest; write the checkpoint again with ptq")
    missing = [name for name in listed if not (folder / name).is_file()]
    if missing:
        raise PtqError(f"checkpoint '{shown}' is incomplete: {missing[0]} (listed in {MANIFEST}) is missing; "
                       "write it again with ptq")
    foreign = foreign_files(folder)
    if foreign:
        raise PtqError(f"checkpoint '{shown}' holds files ptq did not write (e.g. {foreign[0]}); ptq pushes a "
                       "checkpoint as ptq wrote it: move them out, or upload them yourself with `hf upload`")
    return sorted([*listed, MANIFEST])


def _literal(name: str) -> str:
    """An fnmatch pattern (upload_folder's allow_patterns) that matches exactly `name`."""
    return re.sub(r"([*?\[])", r"[\1]", name)


@contextmanager
def _hub_errors(endpoint: str, repo_id: str) -> Iterator[None]:
    """huggingface_hub's failures as one-line PtqErrors that say what to do."""
    try:
        yield
    except OfflineModeIsEnabled:
        raise PtqError(OFFLINE) from None
    except HfHubHTTPError as error:
        raise PtqError(_refusal(error, endpoint, repo_id)) from None
    except TransportError as error:
        reason = shorten(error, 300) or type(error).__name__
        raise PtqError(f"cannot reach the Hugging Face Hub at {endpoint}: {reason}; check the network, HF_ENDPOINT "
                       "or HF_HUB_OFFLINE") from None
    except ValueError as error:  # the Hub's check of README.md's front matter (validate-yaml)
        raise PtqError(f"the Hub refused the upload to '{repo_id}': {shorten(error, 300)}") from None
    except OSError as error:  # reading the checkpoint's files
        raise PtqError(f"cannot read the checkpoint to upload it: {error.strerror or error}") from None


def _refusal(error: HfHubHTTPError, endpoint: str, repo_id: str) -> str:
    """What an HTTP error of the Hub means for the user, in one line."""
    status = error.response.status_code if error.response is not None else None
    said = shorten(error.server_message or "", 300) or f"HTTP {status}"
    owner = repo_id.split("/")[0]
    if status == 401:
        return f"the Hub at {endpoint} did not accept the token ({said}): {LOGIN}"
    if isinstance(error, RepositoryNotFoundError):
        return f"the Hub at {endpoint} does not let this token write to '{repo_id}' ({said}): {LOGIN} for '{owner}'"
    if status == 403:
        return f"the token may not write to '{repo_id}' ({said}): {LOGIN} for '{owner}'"
    request = error.response.request if error.response is not None else None
    where = f" to {request.method} {request.url.path}" if request is not None else ""
    return f"the Hub at {endpoint} answered {status}{where}: {said}"
