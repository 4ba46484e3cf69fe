"""`specserve serve`'s settings tree: sections handed down whole, each default
written once, and names checked without loading torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.config import ServeConfig, load_config
from router.adaptive import PassCostModel, SpeculationControl
from router.servicer import RouterConfig
from router.settings import RouterSettings

CONFIGS = sorted((Path(__file__).parent.parent / "bench" / "configs").glob("*.toml"))


def fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_the_configuration_and_the_router_names_load_no_torch():
    assert fresh("import cluster.config, sys; print('torch' in sys.modules)") == "False"
    assert fresh("import router.settings, router.domains, sys; print('torch' in sys.modules)") == "False"


@pytest.mark.parametrize("module", ["drafter_service.training", "router.domains"])
def test_drafter_training_and_the_router_domains_import_alone(module):
    fresh(f"import {module}")


def test_the_router_runtime_config_has_the_served_defaults():
    served = ServeConfig().router
    config = RouterConfig(context_length=100, eos_token_ids=[2], vocab_size=10, routed_drafters=("pld",))
    assert RouterSettings.model_validate(config.model_dump(include=set(RouterSettings.model_fields))) == served
    assert config.adaptive and config.default_drafter == "auto"


def test_the_verify_cost_defaults_are_the_settings():
    settings = RouterSettings()
    control = SpeculationControl(max_length=5)
    assert (control.verify_row_cost, control.verify_token_cost, control.verify_pad_cost) == (
        settings.verify_row_cost, settings.verify_token_cost, settings.verify_pad_cost)
    assert PassCostModel().priors == (settings.verify_row_cost, settings.verify_token_cost, settings.verify_pad_cost)


def test_a_router_config_keeps_its_settings_as_they_are():
    settings = RouterSettings(default_drafter="pld", draft_length=3, adaptive=False, verify_token_cost=0.5)
    config = RouterConfig.of(settings, context_length=100, eos_token_ids=[], vocab_size=10)
    assert (config.default_drafter, config.draft_length, config.adaptive, config.verify_token_cost) == (
        "pld", 3, False, 0.5)
    assert config.context_length == 100


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_bench_configs_load(path):
    cfg = load_config(path)
    drafter = cfg.router.default_drafter  # the router's choice, or a drafter the pools host
    assert cfg.drafter_pools.kinds and (drafter == "auto" or set(drafter.split("+")) <= set(cfg.drafter_pools.kinds))


def test_sections_from_toml(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('port = 0\n[router]\ndraft_length = 3\n[verifiers]\ncount = 2\nthreads = 1\n'
                    '[drafter_pools]\nkinds = ["pld"]\n[registry]\nheartbeat_s = 0.5\n')
    cfg = load_config(path)
    assert (cfg.port, cfg.router.draft_length, cfg.verifiers.count, cfg.verifiers.threads) == (0, 3, 2, 1)
    assert cfg.drafter_pools.kinds == ["pld"] and cfg.registry.heartbeat_s == 0.5
    assert ServeConfig.model_validate(cfg.model_dump()) == cfg  # how the actors get it


@pytest.mark.parametrize("data, message", [
    ({"draft_length": 3}, "belongs in the [router] section"),
    ({"router": {"draft_lenght": 3}}, "Extra inputs"),
    ({"drafter_pools": {"kinds": ["nope"]}}, "unknown drafter kinds"),
    ({"router": {"default_drafter": "nope"}}, "unknown drafter"),
    ({"router": {"tree_budget": 64}, "verifiers": {"max_batch_tokens": 32}}, "max_batch_tokens must be more"),
])
def test_bad_settings_are_named(data, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        ServeConfig.model_validate(data)


def test_a_network_host_without_api_keys_must_be_asked_for():
    from cluster.config import open_access_warning

    assert open_access_warning(ServeConfig()) is None  # loopback
    with pytest.raises(ValueError, match="require_api_keys"):
        open_access_warning(ServeConfig(host="0.0.0.0"))
    assert "without API keys" in open_access_warning(
        ServeConfig(host="0.0.0.0", security={"allow_open_access": True}))
    keys = ServeConfig(host="0.0.0.0", security={"require_api_keys": True})
    assert "without TLS" in open_access_warning(keys)  # keys would cross the network in the clear


def test_tls_files_go_together_and_must_exist(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    with pytest.raises(ValidationError, match="go together"):
        ServeConfig(security={"tls_cert_file": str(cert)})
    with pytest.raises(ValidationError, match="no file"):
        ServeConfig(security={"tls_cert_file": str(cert), "tls_key_file": str(tmp_path / "missing.pem")})
    tls = ServeConfig(host="0.0.0.0", security={"require_api_keys": True, "tls_cert_file": str(cert),
                                                 "tls_key_file": str(key)})
    assert tls.security.tls() == (b"x", b"y")
    from cluster.config import open_access_warning

    assert open_access_warning(tls) is None


def test_serve_refuses_open_access_in_one_line(capsys):
    from commands.cli import main

    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--allow-open-access" in err
