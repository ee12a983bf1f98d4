"""``tailguard advise RESULTS.json``: what to attack first, and with which technique, from a bench result.

The rule: attack the stages that hold more than 20% of the tail first. "The tail" here is the mean stage
composition of the requests at or above the P99 E2E (``stages.p99_band_mean_s`` of a bench result; the stages add up
to each request's E2E). Each such stage maps to the techniques that shorten it, ordered by the decision tree
for the chosen priority (budget available -> speculative decoding + continuous batching; memory-bound -> KV-cache
quantization + attention slicing; latency-critical -> all of them), and each technique quotes its expected effect from
the measured-effects table (``measured_effects.json``), or says that it has not been measured on this engine yet.

The advisor refuses to recommend when the data cannot carry it: too few requests for a P99, no per-stage breakdown,
or an SLO that is already met (it then shows the composition only).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

SCHEMA = "tailguard.advise/v1"
STAGE_SHARE_RULE = 0.20  # attack components holding > 20% of latency first
DEFAULT_MIN_REQUESTS = 100  # below it the P99 rests on no request beyond it
PRIORITIES = ("latency", "budget", "memory")
# The decision tree: which techniques each priority puts first.
TREE = {
    "budget": ("speculative_decoding", "continuous_batching"),
    "memory": ("kv_cache_quantization", "attention_slicing"),
    "latency": ("speculative_decoding", "continuous_batching", "kv_cache_quantization", "attention_slicing"),
}
LONG_CONTEXT_TOKENS = 8192  # the long-context watch's bound; attention slicing pays off beyond it


class AdviseError(ValueError):
    """The file cannot be read as a bench result."""


@dataclass(frozen=True)
class Technique:
    key: str
    why: str


# What shortens each stage, in the order to try when the tree has no preference.
STAGE_TECHNIQUES: dict[str, tuple[Technique, ...]] = {
    "queue": (
        Technique("continuous_batching", "requests wait for a slot: a wider running-sequence cap and token budget "
                                         "admit them sooner (queue wait is reported as the bottleneck in 90% of "
                                         "cases)"),
        Technique("forecast_driven_batching", "set the cap and budget ahead of the load the forecast expects, "
                                              "instead of reacting once the queue has built"),
        Technique("scale_out", "the engine is saturated when a wider cap no longer adds throughput: add replicas"),
        Technique("kv_cache_quantization", "if KV memory bounds the running sequences, a smaller KV entry lets more "
                                           "of them run"),
        Technique("prefix_caching", "prompts that share a prefix take less prefill, so slots free sooner"),
    ),
    "prefill": (
        Technique("prefix_caching", "repeated system prompts and multi-turn history are computed once"),
        Technique("continuous_batching", "the per-step token budget and prefill chunk set how fast a prompt is "
                                         "consumed and how much it stalls running streams"),
        Technique("attention_slicing", "long prompts: tiled prefill attention bounds memory per step"),
    ),
    "decode": (
        Technique("speculative_decoding", "a draft proposes several tokens per target step"),
        Technique("kv_cache_quantization", "decode reads the whole KV every step: fewer bytes per entry"),
        Technique("continuous_batching", "a lower running-sequence cap gives each stream a larger share of each step "
                                         "(at the cost of throughput)"),
        Technique("attention_slicing", "long contexts: split KV attention keeps each step bounded"),
    ),
    "tokenize": (
        Technique("tokenizer_pipeline", "tokenization is on the critical path: resident vocabulary, cache and "
                                        "parallel batch tokenization"),
    ),
    "stream": (
        Technique("output_shaping", "the server's output stage holds the tail: chunked flushing and shaping"),
    ),
}
OUTSIDE_ENGINE = {
    "network_client": "the network and the client (time outside the server): no engine technique shortens it; look at "
                      "the network path, the gateway and the bench's own health",
}


def load_effects() -> dict:
    text = resources.files("tailguard.plan").joinpath("measured_effects.json").read_text(encoding="utf-8")
    return json.loads(text)["techniques"]


def read_results(path: str | Path) -> dict:
    """A bench ``results.json``, or an AdviseError that says what is wrong with it."""
    p = Path(path)
    if not p.exists():
        raise AdviseError(f"{p}: no such file")
    if p.is_dir():
        if (p / "results.json").is_file():
            p = p / "results.json"
        else:
            raise AdviseError(f"{p}: a directory without results.json")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise AdviseError(f"{p}: cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise AdviseError(f"{p}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("tailguard.bench/"):
        raise AdviseError(f"{p}: not a tailguard bench result (no 'schema: tailguard.bench/...'); "
                          "pass the results.json that `tailguard bench` writes")
    return data


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _slo_state(results: dict) -> dict:
    """Which SLO profiles were judged, which failed, and whether every judged one passed beyond doubt."""
    slo = results.get("slo") or {}
    judged = {k: v for k, v in slo.items() if isinstance(v, dict) and v.get("evaluated")}
    failed = [k for k, v in judged.items() if not v.get("pass")]
    uncertain = [k for k, v in judged.items() if v.get("pass")
                 and any(c.get("status") == "pass" and c.get("certain") is False for c in v.get("checks", []))]
    return {"judged": sorted(judged), "failed": failed, "uncertain_passes": uncertain,
            "all_met": bool(judged) and not failed}


def tail_composition(stages: dict) -> list[dict]:
    """Each stage's mean time and share among the requests at or above the P99 E2E, largest first."""
    band = stages.get("p99_band_mean_s") or {}
    labels = stages.get("labels") or {}
    vals = {k: _num(v) for k, v in band.items()}
    vals = {k: v for k, v in vals.items() if v is not None and v >= 0}
    total = sum(vals.values())
    rows = [{"stage": k, "label": labels.get(k, k), "mean_s": v, "share": v / total if total > 0 else 0.0}
            for k, v in vals.items()]
    return sorted(rows, key=lambda r: r["share"], reverse=True)


def _band_leader(stages: dict, band_name: str) -> str | None:
    for b in stages.get("bands") or []:
        if b.get("band") == band_name and b.get("requests"):
            means = {k: _num(v) or 0.0 for k, v in (b.get("mean_s") or {}).items()}
            return max(means, key=means.get) if means else None
    return None


def _effect(effects: dict, key: str) -> dict:
    e = effects.get(key, {})
    measured = e.get("p99_effect")
    return {"technique": e.get("name", key),
            "measured_p99_effect": measured,
            "expected": measured if measured else "not measured on this engine yet",
            "other_measurements": e.get("other"),
            "seed_claim": e.get("seed_claim"), "settings": e.get("settings", []), "doc": e.get("doc")}


def _queue_settings(results: dict, engine_profile: Any | None, max_seqs: int) -> dict | None:
    """Cap, token budget and replicas from the capacity planner at the offered rate and token mix of the run."""
    if engine_profile is None:
        return None
    from tailguard.plan.capacity import ServiceProfile, plan_capacity

    summ = results.get("summary") or {}
    thr = summ.get("throughput") or {}
    rate = _num(thr.get("offered_requests_per_s")) or _num(thr.get("requests_per_s"))
    done = (summ.get("requests") or {}).get("completed") or 0
    tok = results.get("tokens") or {}
    prompt_total = _num((tok.get("prompt_tokens") or {}).get("server_total")) or _num(
        (tok.get("prompt_tokens") or {}).get("local_total"))
    out_total = _num(tok.get("output_tokens_total"))
    if not rate or not done or not prompt_total or not out_total:
        return None
    prof = ServiceProfile(prompt_total / done, out_total / done, engine_profile.prefill_tokens_per_s,
                          dict(engine_profile.decode_tokens_per_s))
    plan = plan_capacity(rate, prof, max_seqs=max_seqs)
    return {"at_requests_per_s": rate, **{k: v for k, v in plan.as_dict().items() if k != "arrivals_per_s"}}


def advise(results: dict, *, priority: str = "latency", min_requests: int = DEFAULT_MIN_REQUESTS,
           engine_profile: Any | None = None, max_seqs: int = 16, source: str | None = None) -> dict:
    """The advice for one bench result, as a JSON-ready dict (see the module docstring)."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
    effects = load_effects()
    summ = results.get("summary") or {}
    completed = int((summ.get("requests") or {}).get("completed") or 0)
    e2e = ((results.get("metrics") or {}).get("e2e") or {}).get("percentiles") or {}
    p99 = _num((e2e.get("p99") or {}).get("value"))
    p50 = _num((e2e.get("p50") or {}).get("value"))
    stages = results.get("stages") or {}
    health = results.get("bench_health") or {}
    out: dict[str, Any] = {
        "schema": SCHEMA, "source": source, "priority": priority, "requests": completed,
        "e2e_p50_s": p50, "e2e_p99_s": p99, "slo": _slo_state(results), "stage_mode": stages.get("mode"),
        "hardware": {"bench_cpus": health.get("cpus"), "bench_is_bottleneck": health.get("bench_is_bottleneck")},
        "rule": f"attack the stages holding > {STAGE_SHARE_RULE:.0%} of the P99 E2E first",
        "tail_composition": [], "attack_first": [], "recommendations": [], "reasons": [], "notes": [],
    }
    fired = [a for a in results.get("advisories") or [] if isinstance(a, dict) and a.get("fired")]
    out["golden_rules_fired"] = [{"metric": a.get("metric"), "rule": a.get("rule"), "ratio": _num(a.get("ratio")),
                                  "action": a.get("action")} for a in fired]
    for a in fired:  # the golden rules say when to act, whatever the SLO says
        ratio = _num(a.get("ratio")) or 0.0
        out["notes"].append(f"golden rule fired: {a.get('metric')} {a.get('rule')} (ratio {ratio:.2f})"
                            + (f": {a['action']}" if a.get("action") else ""))
    if health.get("bench_is_bottleneck"):
        out["notes"].append("the bench itself was a bottleneck in this run: its tail may be the bench's")
    if completed < min_requests:
        out["status"] = "insufficient_data"
        out["reasons"].append(f"too few requests: {completed} completed, {min_requests} needed for a P99 that rests on "
                              "at least one request beyond it (1000 or more for a stable one); rerun the bench longer")
        return out
    if stages.get("mode") != "server" or not stages.get("p99_band_mean_s"):
        out["status"] = "no_stage_breakdown"
        split = "; ".join(stages.get("cannot_split") or []) or "no per-request stage times"
        out["reasons"].append(f"no per-stage breakdown of the tail ({split}): queue wait cannot be told from prefill. "
                              "Bench a tailguard server (its per-request timelines give tokenize, queue, prefill, "
                              "decode and stream) to get a recommendation")
        return out
    comp = tail_composition(stages)
    out["tail_composition"] = comp
    attack = [r["stage"] for r in comp if r["share"] > STAGE_SHARE_RULE]
    out["attack_first"] = attack
    top = next((b for b in stages.get("bands") or [] if b.get("band") == "> P99"), None)
    if top is not None and 0 < (top.get("requests") or 0) < 5:
        out["notes"].append(f"only {top['requests']} request(s) lie beyond the P99: the composition above is their "
                            "story; a longer run (1000+ requests) makes it the tail's")
    leader_p90 = _band_leader(stages, "P90-P99")
    if comp and leader_p90 and leader_p90 != comp[0]["stage"]:
        out["notes"].append(f"the P90-P99 band is led by {leader_p90}, the > P99 band by {comp[0]['stage']}: "
                            "the tail has more than one cause")
    slo = out["slo"]
    if slo["all_met"]:
        out["status"] = "slo_met"
        out["reasons"].append(f"every judged SLO profile passes ({', '.join(slo['judged'])}): no change is needed; "
                              "the tail composition is shown for information")
        if slo["uncertain_passes"]:
            out["notes"].append(f"{', '.join(slo['uncertain_passes'])}: a threshold lies inside the confidence "
                                "interval; more requests would settle whether it holds")
        return out
    if not slo["judged"]:
        out["notes"].append("no SLO profile was judged in this run: recommending on the tail composition alone")
    if not attack:
        out["status"] = "no_dominant_stage"
        out["reasons"].append(f"no stage holds more than {STAGE_SHARE_RULE:.0%} of the P99 E2E: the tail is spread "
                              "out, and no single technique is indicated")
        return out
    tree = TREE[priority]
    prompt_mean = None
    done = completed or 1
    pt = ((results.get("tokens") or {}).get("prompt_tokens") or {}).get("server_total")
    if _num(pt):
        prompt_mean = _num(pt) / done
    recs = []
    for stage in attack:
        share = next(r["share"] for r in comp if r["stage"] == stage)
        if stage in OUTSIDE_ENGINE:
            out["notes"].append(f"{stage} holds {share:.0%} of the P99 E2E: {OUTSIDE_ENGINE[stage]}")
            continue
        options = [t for t in STAGE_TECHNIQUES.get(stage, ())
                   if not (t.key == "attention_slicing" and (prompt_mean or 0) < LONG_CONTEXT_TOKENS)]
        if priority != "latency":  # budget or memory: the tree's picks first; latency-critical takes them all,
            # so the stage's own order (most direct first) stands
            options.sort(key=lambda t: (0 if t.key in tree else 1, tree.index(t.key) if t.key in tree else 0))
        for rank, t in enumerate(options, start=1):
            rec = {"stage": stage, "stage_share_of_p99": share, "rank": rank, "key": t.key, "why": t.why,
                   "tree_pick": t.key in tree, **_effect(effects, t.key)}
            if stage == "queue" and t.key in ("continuous_batching", "forecast_driven_batching", "scale_out"):
                rec["suggested"] = _queue_settings(results, engine_profile, max_seqs)
            recs.append(rec)
    out["recommendations"] = recs
    out["status"] = "recommend"
    if prompt_mean is not None and prompt_mean < LONG_CONTEXT_TOKENS:
        out["notes"].append(f"attention slicing left out: prompts average {prompt_mean:.0f} tokens, below the "
                            f"{LONG_CONTEXT_TOKENS}-token long-context range where it pays")
    return out


def render(advice: dict, console=None) -> None:
    """Human-readable advice on a rich console."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    p99, p50 = advice.get("e2e_p99_s"), advice.get("e2e_p50_s")
    head = f"[bold]tailguard advise[/bold] {advice.get('source') or ''}: {advice['requests']} requests"
    if p99 is not None:
        head += f", E2E P50 {p50 * 1e3:.0f} ms, P99 {p99 * 1e3:.0f} ms"
    con.print(head)
    slo = advice["slo"]
    if slo["judged"]:
        con.print("SLO: " + ", ".join(f"{k} {'[red]fail[/red]' if k in slo['failed'] else '[green]pass[/green]'}"
                                      for k in slo["judged"]))
    if advice["tail_composition"]:
        t = Table(title=f"Where the P99 E2E goes (requests at or above P99); {advice['rule']}")
        t.add_column("stage")
        t.add_column("mean s", justify="right")
        t.add_column("share", justify="right")
        for r in advice["tail_composition"]:
            mark = " [bold red]<- attack[/bold red]" if r["stage"] in advice["attack_first"] else ""
            t.add_row(r["label"], f"{r['mean_s']:.3f}", f"{r['share']:.0%}{mark}")
        con.print(t)
    status = advice["status"]
    if status != "recommend":
        con.print(f"[bold yellow]No recommendation[/bold yellow] ({status}):")
        for r in advice["reasons"]:
            con.print(f"  - {r}")
    else:
        con.print(f"[bold]What to try[/bold] (priority: {advice['priority']}; "
                  "* = a pick of the advisor's decision tree)")
        for r in advice["recommendations"]:
            con.print(f"[bold]{r['stage']}[/bold] ({r['stage_share_of_p99']:.0%} of P99) #{r['rank']} "
                      f"{'* ' if r['tree_pick'] else ''}[cyan]{r['technique']}[/cyan]")
            con.print(f"    why: {r['why']}", highlight=False)
            expected = r["expected"] if isinstance(r["expected"], str) else json.dumps(r["expected"])
            con.print(f"    expected P99 effect on this engine: {expected}", highlight=False)
            if r.get("other_measurements"):
                con.print(f"    measured here: {r['other_measurements']}", highlight=False)
            if r.get("seed_claim"):
                con.print(f"    published claim: {r['seed_claim']}", highlight=False)
            settings = ", ".join(r["settings"])
            if r.get("suggested"):
                sg = r["suggested"]
                settings += (f"; planner at {sg['at_requests_per_s']:.2f} req/s: --max-num-seqs {sg['max_num_seqs']}"
                             f", --max-num-batched-tokens {sg['max_num_batched_tokens']}, replicas {sg['replicas']}")
            con.print(f"    settings: {settings}", highlight=False)
    for n in advice["notes"]:
        con.print(f"[dim]note: {n}[/dim]")


def add_advise_parser(sub) -> None:
    p = sub.add_parser("advise", help="recommend techniques and settings from a bench result (which stage holds the "
                                      "P99, what shortens it, what it measured)")
    p.add_argument("results", help="results.json written by `tailguard bench` (or its output directory)")
    p.add_argument("--json", action="store_true", help="print the advice as JSON")
    p.add_argument("--priority", choices=PRIORITIES, default="latency",
                   help="branch of the advisor's decision tree: budget available, memory-bound, or latency-critical "
                        "(all techniques)")
    p.add_argument("--min-requests", type=int, default=DEFAULT_MIN_REQUESTS,
                   help="refuse to recommend below this many completed requests")
    p.add_argument("--engine-throughput", default=None,
                   help="benchmarks/results/engine_throughput.json of the serving machine: adds the planner's cap, "
                        "token budget and replicas for the run's offered rate")
    p.add_argument("--max-seqs", type=int, default=16, help="upper bound of the planned cap (default 16)")


def run_advise(args) -> int:
    import sys

    try:
        results = read_results(args.results)
        profile = None
        if args.engine_throughput:
            from tailguard.plan.capacity import ServiceProfile

            try:
                # token means are placeholders here: the advisor replaces them with the run's own
                profile = ServiceProfile.from_engine_throughput(Path(args.engine_throughput), 1.0, 1.0)
            except (OSError, json.JSONDecodeError) as exc:
                raise AdviseError(f"{args.engine_throughput}: cannot read: {exc}") from exc
        advice = advise(results, priority=args.priority, min_requests=args.min_requests, engine_profile=profile,
                        max_seqs=args.max_seqs, source=str(args.results))
    except ValueError as exc:  # AdviseError included
        print(f"tailguard advise: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(advice, indent=2))
    else:
        render(advice)
    return 0
