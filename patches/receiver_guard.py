"""Who may drive one worker's receiver: the verified call's scope and the trainer's claim.

The plugin verifies every ``delta_sync_call`` (signature, nonce, engine identity: see
:mod:`delta_sync.auth`) and then runs its handler inside :meth:`ReceiverGuard.authorized`; the
receiver's lifecycle methods refuse to run outside that scope, so vLLM's own unsigned routes that
reach them change nothing. One trainer session holds the engine at a time (:meth:`claim`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

from delta_sync.auth import AuthError, Verifier, load_secret
from delta_sync.errors import EngineClaimed

from .engine_options import CLAIM_ENV, DEFAULT_CLAIM_S, EngineOptions

__all__ = ["CLAIM_ENV", "DEFAULT_CLAIM_S", "ReceiverGuard"]


class ReceiverGuard:
    """The verified-call scope and the trainer's claim of one worker. ``kept`` says, for an error
    message, what the worker keeps (its version)."""

    def __init__(self, kept: Callable[[], str], verifier: Verifier | None = None):
        self.kept = kept
        #: checks signed calls (refuses every call without a secret); the plugin hands the worker's
        self.verifier = verifier if verifier is not None else Verifier(load_secret(required=False))
        #: the trainer session that syncs this engine and when it last called; another session is
        #: refused until this one releases it or stays silent for claim_s (0: no claims)
        self.claimed: tuple[str, float] | None = None
        #: (a crashed trainer's successor waits at most this long)
        self.claim_s = EngineOptions.from_env().claim_s
        self._authorized = False
        #: the version a signed ``finish`` names (checked against the staged update), inside its scope
        self.call_version: int | None = None

    @contextlib.contextmanager
    def authorized(self, version: int | None = None):
        """The scope of one verified ``delta_sync_call``: only inside it do lifecycle calls run."""
        self._authorized, self.call_version = True, version
        try:
            yield
        finally:
            self._authorized, self.call_version = False, None

    def require(self, what: str) -> None:
        """Refuse ``what`` outside a verified call's scope."""
        if not self._authorized:
            raise AuthError(f"{what}: unsigned weight-transfer call refused (delta-sync engines accept them "
                            f"only through the signed delta_sync_call)",
                            kept=self.kept() + "; the trainer's channel and staged update are unchanged")

    def claim(self, method: str, session: str) -> bool:
        """One trainer per engine: a verified call from ``session`` is refused with
        :class:`EngineClaimed` while another session holds the engine (it called within
        ``claim_s`` and did not release); otherwise ``session`` holds it from now on. Returns False
        for a ``release``, which ends the claim and needs nothing else."""
        now = time.monotonic()
        if self.claimed is not None and self.claimed[0] != session and self.claim_s > 0:
            idle = now - self.claimed[1]
            if idle < self.claim_s:
                raise EngineClaimed(
                    f"{method}: another trainer syncs this engine (session {self.claimed[0][:8]}, last call "
                    f"{idle:.0f} s ago); a second one is refused until it closes its WeightSync or stays "
                    f"silent for {self.claim_s:.0f} s ({CLAIM_ENV}), i.e. in {self.claim_s - idle:.0f} s",
                    kept=self.kept() + "; the other trainer's channel and staged update are unchanged")
        if method == "release":
            if self.claimed is not None and self.claimed[0] == session:
                self.claimed = None
            return False
        self.claimed = (session, now)
        return True
