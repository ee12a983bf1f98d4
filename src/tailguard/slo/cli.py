"""``tailguard slo ...``: profiles, Prometheus rules, the Grafana dashboard, the weekly report and hotspots.

Wired into the main CLI with ``add_slo_parser(sub)`` and ``run_slo(args)``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from tailguard.output_path import unwritable

__all__ = ["add_slo_parser", "run_slo"]

# Prometheus's duration syntax (5m, 1h30m, 500ms): the window goes into PromQL as is, so nothing else may pass.
_DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")


class _UsageError(Exception):
    """A bad flag value, or an output that cannot be written: one line on stderr, exit 2."""


def _write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (its folder made first), or a _UsageError that names the path."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise _UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _check_writable(path: str | None) -> None:
    """Fail before the work, not after it, when ``path`` cannot be written."""
    if path is None or path == "-":
        return
    why = unwritable(path, make_parent=True)
    if why is not None:
        raise _UsageError(f"cannot write {path}: {why}")


def _duration(flag: str, value: str) -> str:
    if not _DURATION.fullmatch(value) or not any(c in "123456789" for c in value):
        raise _UsageError(f"{flag} takes a Prometheus duration such as 5m, 1h or 30s, got {value!r}")
    return value


def _finite_positive(flag: str, value: float | None) -> None:
    # NaN passes every bound check downstream (a NaN --hours reads nothing, a NaN --sigma flags nothing)
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise _UsageError(f"{flag} must be a finite number above 0, got {value:g}")


def add_slo_parser(subparsers: Any) -> argparse.ArgumentParser:
    slo = subparsers.add_parser("slo", help="SLO profiles, Prometheus rules, a Grafana dashboard and the weekly SLO report")
    sub = slo.add_subparsers(dest="slo_command", required=True)

    pr = sub.add_parser("profiles", help="list the SLO profiles (built in, and from a YAML file), validating them")
    pr.add_argument("--file", help="a YAML file of custom profiles (default: the built-in ones only)")
    pr.add_argument("--config", help="a monitor config YAML (its 'slo:' section) to validate as well (default: none)")
    pr.add_argument("--json", action="store_true", help="print JSON instead of text")

    ru = sub.add_parser("rules", help="write Prometheus recording and alerting rules (tiers, burn rates)")
    ru.add_argument("--profile", action="append", dest="profiles",
                    help="profile to export (repeatable; default: every built-in profile)")
    ru.add_argument("--file", help="a YAML file of custom profiles (default: the built-in ones only)")
    ru.add_argument("--config", help="monitor config YAML: its tiers and golden-rule ratios are used (default: the "
                                     "built-in tiers and ratios)")
    ru.add_argument("--output", "-o", default="-", help="rules file (default: stdout)")
    ru.add_argument("--tests-output", help="also write a promtool rules unit-test file here (default: none)")
    ru.add_argument("--tier-window", default="5m", help="rate window of the tier alerts: a Prometheus duration (default 5m)")

    gf = sub.add_parser("grafana", help="write a Grafana dashboard (JSON) of tailguard's metrics and the SLO profiles")
    gf.add_argument("--profile", action="append", dest="profiles",
                    help="profile whose objectives are drawn (repeatable; default: baseline)")
    gf.add_argument("--file", help="a YAML file of custom profiles (default: the built-in ones only)")
    gf.add_argument("--output", "-o", default="-", help="dashboard JSON file (default: stdout)")
    gf.add_argument("--title", default="tailguard", help="dashboard title")
    gf.add_argument("--gateway", action="store_true",
                    help="a gateway over upstream replicas: add the lanes, tenants, streams and replicas panels")
    gf.add_argument("--uid", default="tailguard", help="dashboard uid (Grafana's stable id, for links and updates)")

    rp = sub.add_parser("report", help="weekly P99/P95 trend and SLO attainment from the request store")
    rp.add_argument("--db", required=True, help="the SQLite request store (tailguard serve --store)")
    rp.add_argument("--weeks", type=int, default=4, help="weeks of history to report, 1 to 520 (default 4)")
    rp.add_argument("--profile", action="append", dest="profiles", help="profile (repeatable; default: all built in)")
    rp.add_argument("--file", help="a YAML file of custom profiles (default: the built-in ones only)")
    rp.add_argument("--min-samples", type=int, default=20, help="fewest requests for an hour or week to be judged, at least 1 (default 20)")
    rp.add_argument("--json", action="store_true", help="print JSON instead of tables")
    rp.add_argument("--html", default=None, metavar="FILE",
                    help="also write the report as one HTML file with the region heatmap (region x hour: P99 E2E, "
                         "median RTT, retransmit rate; opens offline) (default: none)")

    hs = sub.add_parser("hotspots", help="layers (sampled internals) and stages slower than mean + 2 sigma, from the "
                                         "request store")
    hs.add_argument("--store", required=True, help="the request store: a SQLite file or a postgresql:// URL")
    hs.add_argument("--hours", type=float, default=None, help="only records of the last HOURS hours (default: all)")
    hs.add_argument("--limit", type=int, default=10_000, help="most recent records read (default 10000)")
    hs.add_argument("--sigma", type=float, default=2.0, help="how many standard deviations above the mean is hot")
    hs.add_argument("--top", type=int, default=20, help="slow stages listed (default 20)")
    hs.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return slo


def _profiles(names: list[str] | None, file: str | None) -> list:
    from tailguard.slo.profiles import builtin_profiles, get_profile, load_profiles

    extra = load_profiles(file) if file else {}
    if names:
        return [get_profile(n, extra) for n in names]
    return [*builtin_profiles().values(), *extra.values()]


def run_slo(args: argparse.Namespace) -> int:
    from tailguard.slo.profiles import ProfileError

    try:
        if args.slo_command == "profiles":
            return _cmd_profiles(args)
        if args.slo_command == "rules":
            return _cmd_rules(args)
        if args.slo_command == "report":
            return _cmd_report(args)
        if args.slo_command == "grafana":
            return _cmd_grafana(args)
        if args.slo_command == "hotspots":
            return _cmd_hotspots(args)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    except _UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"unknown slo command {args.slo_command!r}", file=sys.stderr)
    return 2


def _cmd_profiles(args: argparse.Namespace) -> int:
    from tailguard.slo.config import load_monitor_config

    profs = _profiles(None, args.file)
    cfg = load_monitor_config(args.config) if args.config else None
    if args.json:
        out: dict[str, Any] = {"profiles": [p.model_dump(mode="json") for p in profs]}
        if cfg is not None:
            out["config"] = cfg.model_dump(mode="json")
        print(json.dumps(out, indent=2))
        return 0
    for p in profs:
        print(p.describe())
        if not p.applies_to.is_empty:
            print(f"  applies to: {p.applies_to.model_dump(exclude_defaults=True)}")
    if cfg is not None:
        print(f"config {args.config}: valid (profiles {', '.join(cfg.profiles)}; tiers yellow / orange / red: "
              f"{cfg.tiers.describe()}; red action: {cfg.actions.degrade.mode})")
    return 0


def _cmd_rules(args: argparse.Namespace) -> int:
    from tailguard.slo.config import MonitorConfig, load_monitor_config
    from tailguard.slo.rules import build_rules, build_rules_tests, dump_yaml

    _duration("--tier-window", args.tier_window)
    # checked before anything is written: the test file names the rules file
    if args.tests_output and args.output == "-":
        raise _UsageError("--tests-output needs --output (the test file names the rules file)")
    _check_writable(args.output)
    _check_writable(args.tests_output)
    cfg = load_monitor_config(args.config) if args.config else MonitorConfig()
    profs = _profiles(args.profiles, args.file)
    doc, notes = build_rules(profs, cfg.tiers, tier_window=args.tier_window,
                             p99_over_p50=cfg.golden_rules.p99_over_p50, p99_over_p95=cfg.golden_rules.p99_over_p95)
    header = (
        "# Generated by `tailguard slo rules`: do not edit by hand.\n"
        f"# Profiles: {', '.join(p.name for p in profs)}.\n"
        "# Tier alerts nest (red implies orange implies yellow); in Alertmanager, inhibit lower tiers:\n"
        "#   inhibit_rules:\n"
        "#     - source_matchers: [alertname=\"TailguardLatencyRed\"]\n"
        "#       target_matchers: ['alertname=~\"TailguardLatency(Orange|Yellow)\"']\n"
        "#     - source_matchers: [alertname=\"TailguardLatencyOrange\"]\n"
        "#       target_matchers: [alertname=\"TailguardLatencyYellow\"]\n"
        + "".join(f"# note: {n}\n" for n in notes)
    )
    text = dump_yaml(doc, header)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        _write(args.output, text)
        print(f"wrote {args.output} ({sum(len(g['rules']) for g in doc['groups'])} rules)", file=sys.stderr)
    if args.tests_output:
        tests_path = Path(args.tests_output)
        rel = Path(args.output).resolve()
        try:
            ref = str(rel.relative_to(tests_path.resolve().parent))
        except ValueError:
            ref = str(rel)
        tests = build_rules_tests(ref, profs, cfg.tiers, tier_window=args.tier_window)
        _write(args.tests_output, dump_yaml(tests, "# Generated by `tailguard slo rules --tests-output`: "
                                                   "run `promtool test rules` on this file.\n"))
        print(f"wrote {tests_path} ({len(tests['tests'])} tests)", file=sys.stderr)
    return 0


def _cmd_grafana(args: argparse.Namespace) -> int:
    from tailguard.slo.grafana import available_metrics, build_dashboard

    dashboard, notes = build_dashboard(_profiles(args.profiles or ["baseline"], args.file),
                                       available_metrics(gateway=args.gateway), title=args.title, uid=args.uid)
    text = json.dumps(dashboard, indent=2) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        _write(args.output, text)
        panels = sum(1 for p in dashboard["panels"] if p["type"] != "row")
        print(f"wrote {args.output} ({panels} panels)", file=sys.stderr)
    for note in notes:
        print(f"note: panel left out: {note}", file=sys.stderr)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from tailguard.slo.report import ReportError, build_report, check_report_args, render_report

    try:
        check_report_args(args.weeks, args.min_samples)
        _check_writable(args.html)
        rep = build_report(args.db, _profiles(args.profiles, args.file), weeks=args.weeks,
                           min_samples=args.min_samples)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        render_report(rep)
    if args.html:
        from tailguard.slo.report import render_report_html

        _write(args.html, render_report_html(rep))
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _cmd_hotspots(args: argparse.Namespace) -> int:
    import time

    from tailguard.slo.hotspots import HotspotError, find_hotspots, load_records, render_hotspots

    _finite_positive("--hours", args.hours)
    _finite_positive("--sigma", args.sigma)
    for flag, v in (("--top", args.top), ("--limit", args.limit)):
        if v < 1:  # --top -1 would slice off the last entry; --limit -1 is no limit to SQLite
            raise _UsageError(f"{flag} must be at least 1, got {v}")
    since = time.time() - args.hours * 3600.0 if args.hours is not None else None
    try:
        rep = find_hotspots(load_records(args.store, since, args.limit), sigma=args.sigma)
    except HotspotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        render_hotspots(rep, args.top)
    return 0
