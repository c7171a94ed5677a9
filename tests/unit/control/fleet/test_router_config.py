"""The config a router process gets (control/fleet/router_processes.py); the routers themselves,
as processes: tests/integration/control/test_routers.py."""

from __future__ import annotations


def test_routers_follow_a_dns_name_themselves() -> None:
    """A router of a model found through DNS gets the name, not the addresses the
    supervisor happened to see at the start, so workers that join later reach it too."""
    from control.config import ModelSpec, ServeConfig, parse_model
    from control.config_yaml import config_to_yaml
    from control.fleet.router_processes import router_config

    spec = ModelSpec(
        name="dns", engine="sim", model="builtin:tiny", dns="workers.local:7001", dns_interval_s=2
    )
    static = ModelSpec(name="static", engine="sim", model="builtin:tiny", workers=("10.0.0.1:1",))
    models = [(spec, ["10.0.0.5:7001"]), (static, ["10.0.0.1:1"])]
    config = config_to_yaml(router_config(ServeConfig(listen="127.0.0.1:1"), models))
    dns, fixed = (parse_model(m, f"models[{i}]") for i, m in enumerate(config["models"]))
    assert (dns.dns, dns.dns_interval_s, dns.workers) == ("workers.local:7001", 2.0, ())
    assert (fixed.dns, fixed.workers) == (None, ("10.0.0.1:1",))
