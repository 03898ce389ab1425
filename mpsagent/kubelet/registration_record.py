"""What the kubelet answered a plugin's registration, kept the same way for both plugins: the device plugin calls
the kubelet's Register, the kubelet's plugin watcher calls the DRA driver's registration service. Plain data, so
that the status document reads it without the gRPC runtime."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True, slots=True)
class Registration:
    """A plugin's registration as the status document shows it: whether it is registered now, how often registering
    worked and failed, and why it last failed ("" when it never did, or worked since)."""

    registered: bool = False
    registrations: int = 0
    registration_failures: int = 0
    last_error: str = ""


class RegistrationRecord:
    """The running count behind `Registration`, kept by the plugin's endpoint or service."""

    def __init__(self) -> None:
        self._now = Registration()

    def snapshot(self) -> Registration:
        return self._now

    def accepted(self) -> None:
        now = self._now
        self._now = replace(now, registered=True, registrations=now.registrations + 1, last_error="")

    def refused(self, reason: str) -> None:
        now = self._now
        self._now = replace(
            now, registered=False, registration_failures=now.registration_failures + 1, last_error=reason
        )

    def forget(self) -> None:
        """The kubelet no longer has the plugin (it restarted, or the socket went): not registered, counts kept."""
        self._now = replace(self._now, registered=False)
