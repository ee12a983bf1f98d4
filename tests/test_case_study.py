"""The case study's configurations are what the server, the bench and the SLO monitor accept: every arm's gateway,
the replicas' engine, the classes (each with its key in the key file) and their SLO profiles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tailguard.bench.classes import classes_from_file
from tailguard.policy.tenants import Tenants
from tailguard.serving.config import ServerConfig
from tailguard.slo.profiles import load_profiles

ROOT = Path(__file__).resolve().parents[1]


def test_the_case_study_prepares_configs_every_part_accepts(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples/case-study/case_study.py"), "--prepare-only",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    work = tmp_path / "work"
    ServerConfig(**yaml.safe_load((work / "replica.yaml").read_text()))
    for arm in ("before", "after", "after-peak"):
        text = (work / f"{arm}.yaml").read_text()
        cfg = ServerConfig(**yaml.safe_load(text.replace("{replica1}", "http://127.0.0.1:1")
                                            .replace("{replica2}", "http://127.0.0.1:2")))
        assert len(cfg.upstreams) == 2
        provider = cfg.slo.actions.scale_out.provider
        if arm == "after":  # its third replica follows the gateway's backlog, at the defaults
            assert provider is not None and provider.autoscale is not None and provider.autoscale.wait_s == 1.0
    after = ServerConfig(**yaml.safe_load((work / "after-peak.yaml").read_text()
                                          .replace("{replica1}", "http://127.0.0.1:1")
                                          .replace("{replica2}", "http://127.0.0.1:2")))
    assert after.slo.actions.scale_out.provider is not None and after.slo.actions.scale_out.provider.min_replicas == 1
    profiles = load_profiles(work / "profiles.yaml")
    assert set(profiles) == {"vip", "standard", "batch"}
    tenants = Tenants.load(work / "keys.yaml")
    classes = yaml.safe_load((work / "classes.yaml").read_text())["classes"]
    for c in classes:  # each class's key belongs to the tenant of its lane
        assert tenants.lookup(c["key"]).lane == c["name"]
    assert abs(sum(c["share"] for c in classes) - 1.0) < 1e-9
    assert [c.name for c in classes_from_file(work / "classes.yaml")[0]] == ["vip", "standard", "batch"]
