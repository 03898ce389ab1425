"""The administrators' DeviceTaintRules (KEP-5055; `resource.k8s.io/v1` from Kubernetes 1.37) that taint devices of the
node's slice, as the API server has them: listed, then watched (`list_watch`, as the slices are). The scheduler
applies a rule to the devices it selects without changing their slice, so the agent writes nothing for one and
nothing it does depends on one: it shows them (`--status`, and a log line as a rule starts or stops tainting the
node's devices). An API server that serves none (Kubernetes 1.36, whose beta API is off by default) is asked again
every NOT_SERVED_RETRY_S. The claim server starts the watcher and reads `rules` and `unseen` for the status.
"""

from __future__ import annotations

import anyio
from lightkube.resources.resource_v1 import DeviceTaintRule

from mpsagent.base.backoff import Backoff
from mpsagent.base.episodes import FailureEpisodes
from mpsagent.base.errors import KubeApiError, shown
from mpsagent.base.logs import get_logger
from mpsagent.domain.claims import NodeSlice, TaintRule, TaintSelector, tainted_devices
from mpsagent.dra.api import KubeApi
from mpsagent.dra.list_watch import list_and_watch

log = get_logger("mpsagent.taint_rules")

NOT_SERVED_RETRY_S = 600.0
"""How often an API server that serves no DeviceTaintRules is asked again (it may be upgraded meanwhile)."""
NOT_LISTED = "not listed yet"
NOT_SERVED = "the API server serves none (resource.k8s.io/v1 DeviceTaintRule: Kubernetes 1.37 and later)"
MAX_NAME_CHARS = 253
MAX_KEY_CHARS = 316
"""A taint's key is a label name: a prefix of at most 253 characters, `/`, a name of at most 63."""
MAX_VALUE_CHARS = 63
MAX_EFFECT_CHARS = 32


def taint_rule(item: DeviceTaintRule) -> TaintRule:
    """A DeviceTaintRule as the API server returned it, as the domain's `TaintRule`; what it shows, bounded."""
    name = item.metadata.name if item.metadata is not None else None
    taint = item.spec.taint
    selector = item.spec.deviceSelector
    return TaintRule(
        name=shown(name or "", MAX_NAME_CHARS),
        selector=None
        if selector is None
        else TaintSelector(driver=selector.driver, pool=selector.pool, device=selector.device),
        key=shown(taint.key, MAX_KEY_CHARS),
        value=shown(taint.value or "", MAX_VALUE_CHARS),
        effect=shown(taint.effect, MAX_EFFECT_CHARS),
        added=None if taint.timeAdded is None else taint.timeAdded.timestamp(),
    )


def _taint(rule: TaintRule) -> str:
    return f"{rule.key}={rule.value}:{rule.effect}"


class TaintRuleWatcher:
    """Keeps the DeviceTaintRules that taint devices of `node_slice` (its driver, pool and device names) as the
    server has them, until cancelled."""

    def __init__(self, api: KubeApi, node_slice: NodeSlice, *, backoff: Backoff) -> None:
        """`backoff`: the wait after a list that failed or a watch that did not last WATCH_HEALTHY_S."""
        self._api = api
        self._slice = node_slice
        self._backoff = backoff
        self._rules: dict[str, tuple[TaintRule, tuple[str, ...]]] = {}
        self._state: str | None = NOT_LISTED
        hint = (
            "check that the agent's service account may list and watch devicetaintrules (resource.k8s.io); meanwhile "
            "--status may miss an administrator's taint on the node's devices (the scheduler still honours it)"
        )
        self.listing = FailureEpisodes(
            log,
            failed="device taint rules not listed",
            again="device taint rules listed again",
            level="warning",
            hint=hint,
        )
        self.watching = FailureEpisodes(
            log,
            failed="device taint rule watch failed",
            again="device taint rules watched again",
            level="warning",
            hint=hint,
        )

    @property
    def unseen(self) -> str | None:
        """Why the rules are not watched now (NOT_LISTED, NOT_SERVED, or why the list or the watch fails); None while
        they are."""
        for episodes in (self.listing, self.watching):
            if episodes.current is not None:
                return episodes.current[1]
        return self._state

    @property
    def rules(self) -> tuple[tuple[TaintRule, tuple[str, ...]], ...]:
        """Each rule that taints devices of the node's slice, by name, with the devices it taints."""
        return tuple(self._rules[name] for name in sorted(self._rules))

    async def run(self) -> None:
        """List and watch until cancelled."""
        await list_and_watch(
            listed=self._listed,
            events=lambda version: self._api.watch_taint_rules(resource_version=version),
            seen=self._seen,
            watching=self.watching,
            backoff=self._backoff,
        )

    async def _listed(self) -> str | None:
        try:
            items, version = await self._api.list_taint_rules()
        except KubeApiError as exc:
            if exc.status != 404:
                self.listing.failed(str(exc))
                await self._backoff.wait()
                return None
            self._not_served()
            await anyio.sleep(NOT_SERVED_RETRY_S)
            return None
        self.listing.works()
        self._take_list(items)
        return version

    def _seen(self, kind: str, item: DeviceTaintRule) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self._saw(taint_rule(item))
        elif kind == "DELETED":
            self._gone(taint_rule(item).name)

    def _take_list(self, items: list[DeviceTaintRule]) -> None:
        listed = {rule.name: rule for rule in map(taint_rule, items)}
        for name in self._rules.keys() - listed.keys():
            self._gone(name)
        for rule in listed.values():
            self._saw(rule)
        if self._state is not None:
            self._state = None
            log.info("device taint rules watched", rules=len(self._rules))

    def _saw(self, rule: TaintRule) -> None:
        devices = tainted_devices(rule, self._slice)
        if not devices:
            self._gone(rule.name)
            return
        if self._rules.get(rule.name) == (rule, devices):
            return
        self._rules[rule.name] = (rule, devices)
        log.info("device taint rule on the node's devices", rule=rule.name, devices=list(devices), taint=_taint(rule))

    def _gone(self, name: str) -> None:
        if self._rules.pop(name, None) is not None:
            log.info("device taint rule no longer on the node's devices", rule=name)

    def _not_served(self) -> None:
        for episodes in (self.listing, self.watching):
            episodes.forget()
        self._rules.clear()
        if self._state != NOT_SERVED:
            self._state = NOT_SERVED
            log.info("device taint rules not served by the API server", retry_in_s=NOT_SERVED_RETRY_S)
