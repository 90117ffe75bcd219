"""Tool-server throughput under a concurrency limit, and what a cache hit costs against a bare round trip.

Starts a fake Serper on 127.0.0.1 that answers every request after ``--latency`` seconds (200 ms), starts the
real tool server (``python -m tool_server --backend web``, subprocess, port 0) with ``--search-concurrency C``,
then fires ``--requests`` (256) concurrent distinct searches through ``ToolClient``:

    throughput_vs_bound    = (requests / wall time) / (C / latency)     -- 1.0 = the limit is the only cost
    cache_hit_vs_bare_http = wall time of the same searches again (all cache hits) / wall time of as many bare
                             round trips (``GET /health``) to the same server through the same client, timed
                             in alternating pairs, 5 pairs per trial  -- 1.0 = a cache hit costs no more than
                             reaching the server at all

Both sides of the cache figure are CPU-bound on the same three processes, so the ratio holds as the machine's speed
moves. The speed-up a user sees from the cache (cold run / all-hits run) divides a run bound by the fake upstream's
latency by one bound by CPU, so it tracks the CPU's speed (8.3-12.1x over five runs on one machine): it is printed
on the line above the last with the absolute times.

It also checks that the fake never saw more than C requests at once and that each query cost one upstream call.
Last line: ``tool server: throughput_vs_bound=<f> cache_hit_vs_bare_http=<r>``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from benchmark_report import Rounds, check_rounds, machine_line  # noqa: E402

from tool_server import ToolClient  # noqa: E402
from tool_server.process import start_tool_server  # noqa: E402

PAIRS_PER_TRIAL = 5  # (all-hits run, bare run) pairs after each cold run


class SlowSerper:
    """Minimal HTTP/1.1 keep-alive server: Serper-shaped JSON after a fixed latency; tracks peak concurrency.

    Runs in its own process so the benchmark client's CPU work cannot delay its answers. ``GET /_stats`` returns
    {"calls", "peak"}; ``GET /_reset`` zeroes them.
    """

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.in_flight = 0
        self.peak = 0
        self.calls = 0
        self.arrivals: list[float] = []  # request arrival times, for the hand-over gap diagnostic

    async def serve_forever(self, port_out) -> None:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port_out.put(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    def _answer(self, method: str, path: str, body: bytes) -> bytes | None:
        if method == "GET" and path == "/_stats":
            return json.dumps({"calls": self.calls, "peak": self.peak, "arrivals": self.arrivals}).encode()
        if method == "GET" and path == "/_reset":
            self.calls = self.peak = 0
            self.arrivals = []
            return b"{}"
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                method, path, _ = line.decode("latin-1").split(" ", 2)
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                request = await reader.readexactly(length)
                body = self._answer(method, path, request)
                if body is None:
                    query = json.loads(request)["q"]
                    self.calls += 1
                    self.arrivals.append(time.perf_counter())
                    self.in_flight += 1
                    self.peak = max(self.peak, self.in_flight)
                    await asyncio.sleep(self.latency_s)
                    self.in_flight -= 1
                    body = json.dumps({"organic": [{"title": f"About {query}", "link": f"https://example.com/{k}",
                                                    "snippet": f"Result {k} for {query}."}
                                                   for k in range(5)]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # shutdown cancels idle keep-alive connections
        finally:
            writer.close()


def run_fake(latency_s: float, port_out) -> None:
    asyncio.run(SlowSerper(latency_s).serve_forever(port_out))


def tool_server_args(fake_url: str, concurrency: int) -> tuple[list[str], dict[str, str]]:
    """The web backend's arguments and environment, Serper pointed at the fake."""
    env = {**os.environ, "SERPER_KEY_ID": "bench-key", "JINA_API_KEYS": "bench-key", "API_KEY": "bench-key",
           "API_BASE": fake_url + "/v1", "SUMMARY_MODEL_NAME": "none"}
    return ["--backend", "web", "--serper-base-url", fake_url, "--allow-private-upstreams", "--search-concurrency",
            str(concurrency), "--search-rate", "100000", "--log-level", "WARNING"], env


async def bare_round_trips(client: ToolClient, n: int) -> float:
    """``n`` concurrent ``GET /health`` through the client's pools: the server's HTTP floor, no tool, no cache."""
    start = time.perf_counter()
    await asyncio.gather(*(client.get_json("/health") for _ in range(n)))
    return time.perf_counter() - start


async def fire(client: ToolClient, queries: list[str]) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(*(client.call("search", {"query": q}) for q in queries))
    elapsed = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} searches failed, first: {failed[0].text[:200]}")
    return elapsed


async def measure(args: argparse.Namespace, url: str, fake_url: str) -> tuple:
    """The timed runs against the started server: (its /stats, cold, cached and bare times, the fake's peak
    concurrency, its calls and the last trial's arrival times)."""
    async with ToolClient(url, max_connections=args.requests) as client, httpx.AsyncClient() as probe:
        # steady state, as in training: open the client's connections before timing
        await bare_round_trips(client, args.requests)
        # and the server's connections to the upstream, and its first-call code paths
        await fire(client, [f"warm-up query {i}" for i in range(args.concurrency)])
        await probe.get(fake_url + "/_reset")
        colds, warms, bares, peak = [], [], [], 0
        for trial in range(args.trials):
            queries = [f"benchmark query number {i} of trial {trial}" for i in range(args.requests)]
            colds.append(await fire(client, queries))
            upstream = (await probe.get(fake_url + "/_stats")).json()
            peak = max(peak, upstream["peak"])
            for _ in range(PAIRS_PER_TRIAL):
                warms.append(await fire(client, queries))
                bares.append(await bare_round_trips(client, args.requests))
        upstream_calls = upstream["calls"]
        arrivals = sorted(upstream["arrivals"])[-args.requests:]  # the last trial
        stats = await client.get_json("/stats")
    return stats, colds, warms, bares, peak, upstream_calls, arrivals


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16, help="the tool server's --search-concurrency C")
    p.add_argument("--latency", type=float, default=0.2, help="fake upstream latency in seconds")
    p.add_argument("--trials", type=int, default=3,
                   help="fresh query sets (>= 3); min / median / max over them, the median in the last line")
    args = p.parse_args()
    check_rounds(args.trials, "--trials")
    print(machine_line("3 processes (client event loop, tool server, fake upstream), one event loop each"))

    ctx = multiprocessing.get_context("spawn")
    port_out = ctx.Queue()
    fake = ctx.Process(target=run_fake, args=(args.latency, port_out), daemon=True)
    fake.start()
    try:
        fake_url = f"http://127.0.0.1:{port_out.get(timeout=30)}"
        server_args, env = tool_server_args(fake_url, args.concurrency)
        with start_tool_server(server_args, env=env) as url:
            stats, colds, warms, bares, peak, upstream_calls, arrivals = await measure(args, url, fake_url)
    finally:
        fake.terminate()
        fake.join(10)

    bound = args.concurrency / args.latency
    cold, warm = statistics.median(colds), statistics.median(warms)
    throughput = args.requests / cold
    vs_bound = Rounds(args.requests / c / bound for c in colds)
    hit_speedup = Rounds(c / statistics.median(warms[i * PAIRS_PER_TRIAL:(i + 1) * PAIRS_PER_TRIAL])
                         for i, c in enumerate(colds))
    vs_bare = Rounds(w / b for w, b in zip(warms, bares))
    print(f"requests={args.requests} C={args.concurrency} upstream_latency={args.latency * 1000:.0f}ms "
          f"trials={args.trials} (median reported)")
    print(f"cold   s per trial: {' '.join(f'{t:.3f}' for t in colds)}  -> {throughput:.1f} req/s; bound {bound:.1f} "
          f"req/s (ideal {args.requests / bound:.3f}s)")
    print(f"cached s per run:   {' '.join(f'{t:.3f}' for t in warms)}  -> {args.requests / warm:.1f} req/s; "
          f"hit_rate={stats['cache']['hit_rate']:.3f}")
    print(f"bare   s per run:   {' '.join(f'{t:.3f}' for t in bares)}  -> {args.requests / statistics.median(bares):.1f} "
          f"req/s (GET /health, same client and server)")
    rounds = args.requests // args.concurrency
    if rounds > 1:
        # time for one upstream slot to go round once: latency + the server's hand-over; the rest of the gap to the
        # bound is the ramp-up while the server ingests a burst of `requests` arriving at once
        cycle = (arrivals[-1] - arrivals[args.concurrency - 1]) / (rounds - 1)
        ramp = arrivals[args.concurrency - 1] - arrivals[0]
        print(f"last trial: steady-state slot cycle {cycle * 1000:.1f} ms (latency {args.latency * 1000:.0f} ms), "
              f"ramp-up {ramp * 1000:.0f} ms until all {args.concurrency} slots were busy")
    want = args.requests * args.trials
    print(f"upstream calls={upstream_calls} (want {want})  peak upstream concurrency={peak} (limit {args.concurrency})")
    print(f"throughput_vs_bound per trial {vs_bound.describe('.3f')}; cache_hit_vs_bare_http per pair "
          f"{vs_bare.describe('.2f')}")
    print(f"absolute (this machine, moves with its speed): cache_hit_speedup (cold run / all-hits run) per trial "
          f"{hit_speedup.describe('.1f', 'x')}; {args.requests / warm:.0f} cached searches/s")
    if upstream_calls != want or peak > args.concurrency:
        raise SystemExit("FAIL: the concurrency limit or the one-call-per-query guarantee was violated")
    print(f"tool server: throughput_vs_bound={vs_bound.median:.3f} cache_hit_vs_bare_http={vs_bare.median:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
