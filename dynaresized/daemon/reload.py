"""SIGHUP: re-read [policy] and [guards] from the configuration file, or keep both as they are.
Holds the configuration and policy in force; other sections take effect at the next start."""

from __future__ import annotations

from pathlib import Path

import msgspec
import structlog

from dynaresized.core import Command
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.policy import Policy
from dynaresized.daemon.cluster import Cluster
from dynaresized.daemon.config import Config, ConfigError, load_config
from dynaresized.daemon.notify import Notifier
from dynaresized.daemon.preflight import StartupError, configured_policy

log = structlog.get_logger("dynaresized")


class PolicyReload:
    def __init__(self, config: Config, policy: Policy, config_path: str | Path | None, cluster: Cluster,
                 notifier: Notifier) -> None:
        self.config = config  # in force: [policy] and [guards] as last reloaded
        self.policy = policy
        self.config_path = config_path  # what SIGHUP re-reads; None: reload is refused
        self.cluster = cluster
        self.notifier = notifier

    def apply(self, now: float, facts: list[f.Fact], commands: list[Command]) -> None:
        """Take [policy] and [guards] from the configuration file, or keep both as they are.

        They are read by the core only when it decides on a new resize, so a resize in flight
        runs on as planned. A file that does not load, or a policy that does not build, changes
        nothing: the daemon never stops over a reload. Other sections take effect at restart.
        Either way the log records it (`config_reloaded` or `reload_refused`)."""
        self.notifier.reloading()
        try:
            if self.config_path is None:
                raise ConfigError("the daemon was started without a configuration file")
            new = load_config(self.config_path)
            policy = configured_policy(new)
        except (ConfigError, StartupError) as exc:
            log.error("reload refused: the running policy and guards are kept", error=str(exc))
            self.cluster.step_quiet(ev.ReloadRefused(at=now, reason=str(exc)[:4000]), facts, commands)
            self.notifier.ready(f"reload refused: {str(exc).splitlines()[0]}")
            return
        restart_only = [name for name in Config.__struct_fields__ if name not in ("policy", "guards")
                        and getattr(new, name) != getattr(self.config, name)]
        if restart_only:
            log.warning("reload: changes to these sections take effect at the next start", sections=restart_only)
        changed = {key: [old, value] for key, old, value in (
            (k, getattr(self.config.guards, k), getattr(new.guards, k)) for k in new.guards.__struct_fields__)
            if old != value}
        self.config = msgspec.structs.replace(self.config, policy=new.policy, guards=new.guards)
        self.policy = policy
        core = self.cluster.core
        core.policy = policy
        core.config = self.config.core_config()
        self.cluster.step_quiet(ev.ConfigReloaded(
            at=now, policy=policy.name, options=dict(new.policy.options),
            guards_changed={k: (old, value) for k, (old, value) in changed.items()},
            restart_only=tuple(restart_only)), facts, commands)
        state = self.cluster.state
        log.info("reloaded", policy=policy.name, options=dict(new.policy.options), guards_changed=changed,
                 resize_in_flight=state.inflight.plan.resize_id if state.inflight else None)
        self.notifier.ready(f"reloaded; policy {policy.name}")
