"""The client's network, per request: the kernel's view of the connection (``TCP_INFO``) and the write backpressure,
sampled while the answer is written; and the request's region, from a header or the client's network.

**What is sampled.** ``getsockopt(IPPROTO_TCP, TCP_INFO)`` on the client connection's socket (Linux): the smoothed
round-trip time and its variation, the path's minimum RTT, the retransmissions so far, the segments in flight
(unacked) and those the kernel thinks lost, the congestion window and the bytes written but not yet sent
(``notsent_bytes``); plus what waits above the kernel: the transport's write buffer and whether uvicorn's flow
control had paused writing (the client reads slower than the answer is written). A response is sampled at its first
body write (the first token, for a stream), then at most every ``every_s`` (100 ms) on later writes, and once at
its end: a stream costs at most ten samples a second, a one-piece answer one. ``NetworkSampler.summary`` folds the samples into the
record's ``network`` section; nothing is kept per sample.

**Cost** (measured with a micro-benchmark on the 2-vCPU build machine, shared with other work: Linux 6.18, Python
3.11, uvloop 0.23; best of 5 runs of 50,000 samples on an established loopback connection;
``tests/serving/test_network.py::test_a_sample_costs_microseconds`` measures it again): one sample costs 1.7 to 2.4 us
under uvloop, most of it ``getsockopt`` through uvloop's pseudo-socket (which builds a socket object per call), and
about 1 us on asyncio's own loop; the unpack reads only the 9 fields used (about 0.4 us, where the whole struct's 54
fields take about 1 us). A write that takes no sample pays a clock read and a comparison (about 0.1 us). A response
pays about 10 us in all besides (finding the socket, the first and the end samples, the summary), and a long stream
one sample per 100 ms of it: a 30 s stream about 0.6 ms, against the tens of microseconds each of its hundreds of token
writes costs the server anyway. Hence on by default (``network_sampling: false`` or ``--no-network-sampling`` turns
it off).

Off Linux, under another server than uvicorn's httptools protocol, or on a connection that is not TCP,
``NetworkSampler.for_send`` gives None and nothing is sampled. No established Python library reads ``TCP_INFO``
(psutil lists connections, not their TCP state), so the small parser below reads ``struct tcp_info`` at the offsets
of ``include/uapi/linux/tcp.h``.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
import sys
import time
from collections.abc import Mapping
from typing import Any

from tailguard.observe.metrics import clean_label

perf_counter = time.perf_counter

_UVICORN_CYCLE = ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle")
TCP_INFO: int | None = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None
TCP_INFO_LEN = 232  # struct tcp_info up to tcpi_snd_wnd (Linux 5.4+); an older kernel gives fewer bytes

# struct tcp_info (include/uapi/linux/tcp.h), native byte order, every field at its natural alignment (no padding):
# eight u8 (the two bitfield bytes read whole), 24 u32 (tcpi_rto .. tcpi_total_retrans), then the later additions.
_FIELDS = (
    "state", "ca_state", "retransmits", "probes", "backoff", "options", "wscale", "app_limited",  # u8, 0-7
    "rto", "ato", "snd_mss", "rcv_mss", "unacked", "sacked", "lost", "retrans", "fackets",  # u32, 8-43
    "last_data_sent", "last_ack_sent", "last_data_recv", "last_ack_recv",  # ms ago, 44-59
    "pmtu", "rcv_ssthresh", "rtt", "rttvar", "snd_ssthresh", "snd_cwnd", "advmss", "reordering",  # 60-91; rtt in us
    "rcv_rtt", "rcv_space", "total_retrans",  # 92-103
    "pacing_rate", "max_pacing_rate", "bytes_acked", "bytes_received",  # u64, 104-135
    "segs_out", "segs_in", "notsent_bytes", "min_rtt", "data_segs_in", "data_segs_out",  # u32, 136-159
    "delivery_rate", "busy_time", "rwnd_limited", "sndbuf_limited",  # u64, 160-191
    "delivered", "delivered_ce",  # u32, 192-199
    "bytes_sent", "bytes_retrans",  # u64, 200-215
    "dsack_dups", "reord_seen", "rcv_ooopack", "snd_wnd",  # u32, 216-231
)
_LAYOUT = "8B24I4Q6I4Q2I2Q4I"
_FULL = struct.Struct("=" + _LAYOUT)

# The fields a sample reads, skipping the rest with pad bytes (one unpack of 9 values: about 0.4 us, where the whole
# struct's 52 values take about 1 us): unacked @24, lost @32, rtt @68, rttvar @72, snd_cwnd @80, total_retrans @100,
# notsent_bytes @144, min_rtt @148, data_segs_out @156.
_HOT = struct.Struct("=24xI4xI32xII4xI16xI40xII4xI")
_HOT_OLD = struct.Struct("=24xI4xI32xII4xI16xI")  # a kernel older than 4.6: no notsent_bytes, min_rtt, data_segs_out


_CODES = "".join(code * int(n or 1) for n, code in re.findall(r"(\d*)([BIQ])", _LAYOUT))  # one letter a field
assert _FULL.size == TCP_INFO_LEN and len(_CODES) == len(_FIELDS)
assert _HOT.size == 160 and _HOT_OLD.size == 104


def parse_tcp_info(raw: bytes) -> dict[str, int]:
    """``struct tcp_info`` as a dict of its fields (times in microseconds, as the kernel gives them); the fields an
    older kernel does not fill (its struct is shorter) are left out."""
    if len(raw) >= TCP_INFO_LEN:
        return dict(zip(_FIELDS, _FULL.unpack_from(raw), strict=True))
    out: dict[str, int] = {}
    offset = 0
    for name, code in zip(_FIELDS, _CODES, strict=True):
        size = 1 if code == "B" else 4 if code == "I" else 8
        if offset + size > len(raw):
            break
        out[name] = struct.unpack_from("=" + code, raw, offset)[0]
        offset += size
    return out


def read_tcp_info(sock: Any) -> dict[str, int] | None:
    """The parsed ``TCP_INFO`` of a socket (or a transport's socket-like object), None where there is none."""
    if TCP_INFO is None:
        return None
    try:
        return parse_tcp_info(sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, TCP_INFO_LEN))
    except (OSError, AttributeError):
        return None


def _is_cycle(obj: Any) -> bool:
    kind = type(obj)
    return (kind.__module__, kind.__name__) == _UVICORN_CYCLE


def cycle_of(send: Any, depth: int = 4) -> Any | None:
    """uvicorn's response cycle behind an ASGI ``send``: the bound method's own object, or, when middlewares wrapped
    it in closures, the cycle of the ``send`` they close over (``depth`` wrappers deep at most: with tracing on,
    Starlette's exception and error middlewares and the trace context's make three)."""
    owner = getattr(send, "__self__", None)
    if owner is not None:
        return owner if _is_cycle(owner) else None
    if depth <= 0:
        return None
    for cell in getattr(send, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if _is_cycle(getattr(content, "__self__", None)):
            return content.__self__
        if getattr(content, "__closure__", None):
            found = cycle_of(content, depth - 1)
            if found is not None:
                return found
    return None


class NetworkSampler:
    """Samples one response's connection (``on_write`` at each body write, ``finish`` at the end) and sums it up.

    Running figures only: first / last / max / sum of the smoothed RTT, the retransmission and segment counters at
    the first and the last sample, and the maxima of what waits to be sent."""

    __slots__ = ("every_s", "waits", "flow", "_sock", "_transport", "_next", "_dead", "n", "rtt_first", "rtt_last",
                 "rtt_max", "rtt_sum", "rttvar_last", "rttvar_max", "min_rtt", "retrans_first", "retrans_last",
                 "segs_first", "segs_last", "unacked_max", "lost_max", "notsent_max", "buffer_max", "backlog_max",
                 "cwnd_min", "cwnd_last", "paused", "first_at", "last_at")

    def __init__(self, sock: Any, transport: Any, flow: Any, every_s: float = 0.1) -> None:
        self.every_s = every_s
        self.waits = 0  # body writes that found uvicorn's flow control paused (they waited for the client)
        self.flow = flow
        self._sock = sock
        self._transport = transport
        self._next = 0.0  # the first write samples
        self._dead = False
        self.n = 0
        self.rtt_first = self.rtt_last = self.rtt_max = self.rtt_sum = 0
        self.rttvar_last = self.rttvar_max = 0
        self.min_rtt: int | None = None
        self.retrans_first = self.retrans_last = 0
        self.segs_first: int | None = None
        self.segs_last: int | None = None
        self.unacked_max = self.lost_max = self.notsent_max = self.buffer_max = self.backlog_max = 0
        self.cwnd_min = self.cwnd_last = 0
        self.paused = 0  # samples taken while writing was paused
        self.first_at = self.last_at = 0.0

    @classmethod
    def for_send(cls, send: Any, every_s: float = 0.1) -> NetworkSampler | None:
        """A sampler for the connection behind ``send``, or None: not Linux, not uvicorn's httptools cycle, not TCP."""
        if TCP_INFO is None:
            return None
        cycle = cycle_of(send)
        if cycle is None:
            return None
        transport = getattr(cycle, "transport", None)
        if transport is None:
            return None
        sock = transport.get_extra_info("socket")
        if sock is None or getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
            return None  # a Unix socket has no TCP_INFO
        return cls(sock, transport, getattr(cycle, "flow", None), every_s)

    def on_write(self) -> None:
        """After a body write: sample if this is the first, or ``every_s`` has passed since the last sample."""
        now = perf_counter()
        if now >= self._next:
            self._next = now + self.every_s
            self.sample(now)

    def sample(self, now: float | None = None) -> bool:
        """Read the connection's state once; False when it cannot be read (the connection is gone)."""
        if self._dead:
            return False
        transport = self._transport
        try:
            if transport.is_closing():
                self._dead = True
                return False
            raw = self._sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, TCP_INFO_LEN)
        except (OSError, AttributeError, TypeError):
            self._dead = True
            return False
        if len(raw) >= 160:
            unacked, lost, rtt, rttvar, cwnd, retrans, notsent, min_rtt, segs = _HOT.unpack_from(raw)
        elif len(raw) >= 104:
            unacked, lost, rtt, rttvar, cwnd, retrans = _HOT_OLD.unpack_from(raw)
            notsent, min_rtt, segs = 0, None, None
        else:
            self._dead = True
            return False
        buffered = transport.get_write_buffer_size()
        now = perf_counter() if now is None else now
        if self.n == 0:
            self.rtt_first, self.retrans_first, self.segs_first, self.first_at = rtt, retrans, segs, now
            self.cwnd_min = cwnd
        self.n += 1
        self.last_at = now
        self.rtt_last, self.rttvar_last, self.retrans_last, self.segs_last, self.cwnd_last = (
            rtt, rttvar, retrans, segs, cwnd)
        self.rtt_sum += rtt
        if rtt > self.rtt_max:
            self.rtt_max = rtt
        if rttvar > self.rttvar_max:
            self.rttvar_max = rttvar
        if min_rtt is not None:
            self.min_rtt = min_rtt
        if unacked > self.unacked_max:
            self.unacked_max = unacked
        if lost > self.lost_max:
            self.lost_max = lost
        if notsent > self.notsent_max:
            self.notsent_max = notsent
        if buffered > self.buffer_max:
            self.buffer_max = buffered
        if notsent + buffered > self.backlog_max:
            self.backlog_max = notsent + buffered
        if cwnd < self.cwnd_min:
            self.cwnd_min = cwnd
        flow = self.flow
        if flow is not None and flow.write_paused:
            self.paused += 1
        return True

    def finish(self) -> dict[str, Any] | None:
        """The end sample, then the summary (None when no sample could be taken)."""
        self.sample()
        self._dead = True  # nothing after the end
        return self.summary()

    def summary(self) -> dict[str, Any] | None:
        """The record's ``network`` section (times in milliseconds), or None without a sample."""
        n = self.n
        if not n:
            return None
        out: dict[str, Any] = {
            "rtt_ms": {"first": round(self.rtt_first * 0.001, 3), "mean": round(self.rtt_sum * 0.001 / n, 3),
                       "max": round(self.rtt_max * 0.001, 3), "last": round(self.rtt_last * 0.001, 3)},
            "rttvar_ms": {"max": round(self.rttvar_max * 0.001, 3), "last": round(self.rttvar_last * 0.001, 3)},
            "retransmits": max(0, self.retrans_last - self.retrans_first),
            "max_unacked": self.unacked_max,
            "max_lost": self.lost_max,
            "max_notsent_bytes": self.notsent_max,
            "max_write_buffer_bytes": self.buffer_max,
            "max_backlog_bytes": self.backlog_max,
            "cwnd": {"min": self.cwnd_min, "last": self.cwnd_last},
            "paused_samples": self.paused,
            "paused_writes": self.waits,
            "samples": n,
            "span_s": round(self.last_at - self.first_at, 6),
        }
        if self.min_rtt is not None:
            out["rtt_ms"]["min"] = round(self.min_rtt * 0.001, 3)
        if self.segs_first is not None and self.segs_last is not None:
            out["segments_out"] = max(0, self.segs_last - self.segs_first)
        return out


# --- regions ---------------------------------------------------------------------------------------------------------
class RegionMap:
    """A request's region: the region header's value, else the client address's network in ``cidrs`` (the longest
    prefix that holds it), else ``"default"``.

    The client address is the connection's peer (the ASGI scope's ``client``), or the first hop of
    ``X-Forwarded-For`` when ``trust_forwarded`` says a trusted proxy in front sets it (as ``trust_lane_header``
    does for ``X-Lane``): from anyone else, the header is the client's own claim."""

    __slots__ = ("header", "trust_forwarded", "_nets", "_cache")

    CACHE = 4096  # client addresses remembered (a lookup walks the networks; a busy gateway sees the same clients)

    def __init__(self, header: str | None = "x-region", cidrs: Mapping[str, str] | None = None,
                 trust_forwarded: bool = False) -> None:
        self.header = header.strip().lower() if header else None
        self.trust_forwarded = trust_forwarded
        nets = [(ipaddress.ip_network(c, strict=False), clean_label(name)) for c, name in (cidrs or {}).items()]
        nets.sort(key=lambda item: item[0].prefixlen, reverse=True)  # the most specific network first
        self._nets = nets
        self._cache: dict[str, str] = {}

    @classmethod
    def from_config(cls, config: Any) -> RegionMap:
        return cls(getattr(config, "region_header", "x-region"), getattr(config, "region_cidrs", None),
                   bool(getattr(config, "trust_lane_header", False)))

    def region(self, headers: Mapping[str, str], client: Any = None) -> str:
        if self.header is not None:
            claimed = headers.get(self.header)
            if claimed:
                return clean_label(claimed)
        if not self._nets:
            return "default"
        host = None
        if self.trust_forwarded:
            fwd = headers.get("x-forwarded-for")
            if fwd:
                host = fwd.split(",", 1)[0].strip()
        if not host and client:
            host = client[0]
        return self.of_address(host) if host else "default"

    def of_address(self, host: str) -> str:
        """The region of one address (``"default"`` when no network holds it, or it is not an address)."""
        found = self._cache.get(host)
        if found is not None:
            return found
        try:
            addr = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            found = "default"
        else:
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                addr = addr.ipv4_mapped  # ::ffff:10.1.2.3 from a dual-stack listener
            found = next((name for net, name in self._nets if addr.version == net.version and addr in net), "default")
        if len(self._cache) >= self.CACHE:
            self._cache.clear()
        self._cache[host] = found
        return found


_MAPS: dict[int, tuple[Any, RegionMap]] = {}


def region_map(config: Any) -> RegionMap:
    """The region map of a server's config, built once per config object (it is read at every request)."""
    entry = _MAPS.get(id(config))
    if entry is None or entry[0] is not config:
        if len(_MAPS) > 64:  # configs come and go in tests; a server holds one
            _MAPS.clear()
        entry = _MAPS[id(config)] = (config, RegionMap.from_config(config))
    return entry[1]
