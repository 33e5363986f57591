"""Errors of hub access, downloads and local models. Each carries a message a user can act on, plus data."""
from __future__ import annotations

import errno

import httpx2
from huggingface_hub import errors as hf_errors


class HubError(Exception):
    """Base of every error this package raises; `str(exc)` is the message shown to the user."""


class HubOffline(HubError):
    """The Hub cannot be reached (no network, offline mode, DNS, TLS, timeouts)."""


class HubAccessError(HubError):
    """A gated or private repository without a token that has access."""


class HubNotFound(HubError):
    """No such repository, branch or file."""


class HubServerError(HubError):
    """The Hub answered with an error (5xx or an unexpected status)."""


class UnsafePathError(HubError):
    """A path from a repository listing would land outside the models folder."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


class NotEnoughDiskSpace(HubError):
    def __init__(self, message: str, needed: int, free: int):
        super().__init__(message)
        self.needed, self.free = needed, free


class DiskFullError(HubError):
    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


class IntegrityError(HubError):
    def __init__(self, message: str, path: str, expected: str, actual: str):
        super().__init__(message)
        self.path, self.expected, self.actual = path, expected, actual


class TooLargeError(IntegrityError):
    """The server sent more bytes than the Hub lists for the file."""


class LocalModelError(HubError):
    """A local model folder cannot be imported, listed or deleted; the message names the folder and the problem."""


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def translate(exc: BaseException, what: str) -> HubError:
    """Map a huggingface_hub / httpx2 exception met while doing `what` (e.g. "listing branches of x/y")."""
    if isinstance(exc, HubError):
        return exc
    if isinstance(exc, hf_errors.OfflineModeIsEnabled):
        return HubOffline("Offline mode is on (HF_HUB_OFFLINE): the Hugging Face Hub is not contacted. "
                          "Local models keep working.")
    if isinstance(exc, httpx2.TransportError):
        return HubOffline(f"The Hugging Face Hub cannot be reached while {what} "
                          f"({exc.__class__.__name__}). Local models keep working.")
    if isinstance(exc, hf_errors.GatedRepoError):
        return HubAccessError(f"Access denied while {what}: the repository is gated. Accept its terms on the "
                              "model page and sign in with a Hugging Face token (Models → Sign in).")
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return HubNotFound(f"Branch not found while {what}.")
    if isinstance(exc, hf_errors.RemoteEntryNotFoundError):
        return HubNotFound(f"File not found while {what}.")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return HubAccessError(f"Repository not found while {what}: it does not exist, or it is private and "
                              "needs a Hugging Face token with access (Models → Sign in).")
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return HubServerError(f"The Hub answered HTTP {status} while {what}. Try again later.")
    return HubError(f"Unexpected error while {what}: {exc.__class__.__name__}: {exc}")
