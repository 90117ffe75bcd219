"""Typed configuration of the tool server, validated once at start-up.

Knobs come from command-line flags (``python -m tool_server --help``); only secrets and upstream endpoints come
from the environment (or an ``--env-file``), and secrets never leave this process.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping
from urllib.parse import urlsplit


# The retriever backend's HTTP dialects and the endpoint path each one serves.
Dialect = Literal["search_r1", "flashrag"]
DIALECT_PATHS: dict[str, str] = {"search_r1": "/retrieve", "flashrag": "/batch_search"}


def split_retriever_url(url: str, dialect: str | None) -> tuple[str, Dialect]:
    """(base URL, dialect) from ``--retriever-url`` and ``--retriever-dialect``.

    The URL may be the server's base (``http://host:8000``) or its endpoint (``.../retrieve``, ``.../batch_search``);
    an endpoint path implies the dialect. Raises ValueError when the two disagree.
    """
    base = url.rstrip("/")
    implied = None
    for name, path in DIALECT_PATHS.items():
        if base.endswith(path):
            implied, base = name, base[: -len(path)]
    if dialect in (None, "auto"):
        return base, implied or "search_r1"
    if dialect not in DIALECT_PATHS:
        raise ValueError(f"retriever dialect {dialect!r} is not one of {sorted(DIALECT_PATHS)}")
    if implied is not None and implied != dialect:
        raise ValueError(f"the retriever URL {url!r} ends in {DIALECT_PATHS[implied]} (the {implied} dialect) but the "
                         f"dialect is {dialect!r}; drop the path or the dialect")
    return base, dialect


class ConfigError(ValueError):
    """A configuration value broke a rule; the message names the value, the rule and the fix."""


@dataclass(frozen=True)
class UpstreamLimits:
    """Cost and robustness limits of one paid upstream (Serper, Jina Reader, the summariser LLM).

    concurrency: at most this many requests in flight to the upstream (asyncio semaphore).
    rate_per_s, burst: token bucket; a 429 pauses the bucket for ``Retry-After`` seconds (or the back-off).
    attempt_timeout_s: hard timeout of one HTTP attempt (connect + full body).
    max_attempts: attempts per call; retries only on 429, 5xx, timeouts and connection errors.
    backoff_base_s, backoff_max_s: retry n sleeps U(0, min(max, base * 2**n)) ("full jitter").
    budget: upstream calls (attempts, since failed attempts may be billed too) allowed in this run; None = no cap.
    max_response_bytes: body bytes read from the upstream; JSON APIs fail beyond it, pages are truncated.
    """

    concurrency: int = 16
    rate_per_s: float = 100.0
    burst: int = 32
    attempt_timeout_s: float = 20.0
    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    budget: int | None = None
    max_response_bytes: int = 2_000_000

    def validate(self, name: str) -> None:
        _require(self.concurrency >= 1, f"{name}.concurrency={self.concurrency}", ">= 1", "use 1 or more")
        _require(self.rate_per_s > 0, f"{name}.rate_per_s={self.rate_per_s}", "> 0", "use a positive rate")
        _require(self.burst >= 1, f"{name}.burst={self.burst}", ">= 1", "use 1 or more")
        _require(self.attempt_timeout_s > 0, f"{name}.attempt_timeout_s={self.attempt_timeout_s}", "> 0",
                 "use a positive timeout")
        _require(self.max_attempts >= 1, f"{name}.max_attempts={self.max_attempts}", ">= 1", "use 1 or more")
        _require(0 <= self.backoff_base_s <= self.backoff_max_s,
                 f"{name}.backoff_base_s={self.backoff_base_s}, backoff_max_s={self.backoff_max_s}",
                 "0 <= base <= max", "lower the base or raise the max")
        _require(self.budget is None or self.budget >= 0, f"{name}.budget={self.budget}", ">= 0 or unset",
                 "omit the flag for no cap")
        _require(self.max_response_bytes >= 1024, f"{name}.max_response_bytes={self.max_response_bytes}",
                 ">= 1024", "raise it")


# z_0.99, the standard normal's 99th percentile (statistics.NormalDist().inv_cdf(0.99)): a log-normal's p99 is
# exp(mu + Z_99 * sigma), which is how --latency's p50 and p99 become mu and sigma
Z_99 = 2.3263478740408408


@dataclass(frozen=True)
class ToolLatency:
    """A web-like delay added to every call of ``tool`` (``--latency TOOL=P50:P99``, seconds): log-normal with
    median ``p50_s`` and 99th percentile ``p99_s``, i.e. mu = ln(p50), sigma = ln(p99 / p50) / z_0.99. p99 = p50 is a
    constant delay. How a call's draw is made and when it is waited: ``tool_server.latency``."""

    tool: str
    p50_s: float
    p99_s: float

    @property
    def mu(self) -> float:
        return math.log(self.p50_s)

    @property
    def sigma(self) -> float:
        return math.log(self.p99_s / self.p50_s) / Z_99

    @property
    def flag(self) -> str:
        return f"--latency {self.tool}={self.p50_s:g}:{self.p99_s:g}"

    @classmethod
    def parse(cls, text: str) -> "ToolLatency":
        """``TOOL=P50:P99`` (seconds, e.g. ``search=1:10``); ``ConfigError`` naming the flag and the fix."""
        tool, sep, quantiles = text.partition("=")
        p50, colon, p99 = quantiles.partition(":")
        if not sep or not colon or not tool.strip():
            raise ConfigError(f"--latency {text}: expected TOOL=P50:P99 in seconds, e.g. --latency search=1:10")
        try:
            spec = cls(tool.strip(), float(p50), float(p99))
        except ValueError:
            raise ConfigError(f"--latency {text}: P50 and P99 must be numbers of seconds, e.g. --latency "
                              f"{tool.strip()}=1:10") from None
        spec.validate()
        return spec

    def validate(self) -> None:
        # isfinite first: a NaN passes neither comparison, an infinite p99 makes sigma infinite
        _require(math.isfinite(self.p50_s) and math.isfinite(self.p99_s) and 0 < self.p50_s <= self.p99_s,
                 self.flag, "p99 >= p50 > 0 (finite seconds)",
                 f"e.g. --latency {self.tool}=1:10 (p50 1 s, p99 10 s); equal values give a constant delay")


@dataclass(frozen=True)
class LatencyConfig:
    """Seeded web-like latency added to tool calls, for rehearsals and asynchronous-trainer benchmarks on a local
    backend that answers in milliseconds (``docs/guide/tool_server.md``, "Web-like latency"). Off unless ``tools``
    names one.

    tools: one ``ToolLatency`` per delayed tool (``--latency TOOL=P50:P99``, repeatable); a tool not named waits
        nothing.
    seed: every draw is a function of (seed, tool, the call's canonical arguments, how many times that same call
        came before), so a run's delays do not depend on the order concurrent calls arrive (``--latency-seed``).
    cap_s: no delay is longer than this (``--latency-cap-s``; None: no cap). The default 120 s stays below the
        agent's default ``tool_timeout_s`` (150 s), so an injected delay alone never times a call out; it cuts only
        the far tail (a draw beyond 120 s has odds of about 1 in 10,000 for visit p50 3 s / p99 30 s).
    """

    tools: tuple[ToolLatency, ...] = ()
    seed: int = 0
    cap_s: float | None = 120.0

    def for_tool(self, name: str) -> ToolLatency | None:
        return next((spec for spec in self.tools if spec.tool == name), None)

    def validate(self) -> None:
        seen: set[str] = set()
        for spec in self.tools:
            spec.validate()
            _require(spec.tool not in seen, spec.flag, "given once per tool",
                     f"keep one --latency {spec.tool}=... flag")
            seen.add(spec.tool)
        if self.cap_s is not None:
            _require(math.isfinite(self.cap_s) and self.cap_s > 0, f"--latency-cap-s {self.cap_s:g}",
                     "> 0 seconds", "pass a positive cap, or 0 for no cap")
            for spec in self.tools:
                # a cap below a p99 would serve another distribution than the one the flag states
                _require(spec.p99_s <= self.cap_s, f"--latency-cap-s {self.cap_s:g} with {spec.flag}",
                         "at least every p99", f"raise --latency-cap-s to {spec.p99_s:g} or more, or lower the p99")

    def describe(self) -> str:
        """What the start line shows: ``latency: off``, or each tool's distribution, the cap and the seed."""
        if not self.tools:
            return "latency: off"
        tools = ", ".join(f"{s.tool} lognormal p50 {s.p50_s:g}s p99 {s.p99_s:g}s" for s in self.tools)
        cap = "no cap" if self.cap_s is None else f"cap {self.cap_s:g}s"
        return f"latency: {tools}; {cap}; seed {self.seed}"


@dataclass(frozen=True)
class Secrets:
    """Credentials of the web backend. ``repr`` hides them so they cannot leak through logs or tracebacks."""

    serper_key: str = field(repr=False)
    jina_key: str = field(repr=False)
    api_key: str = field(repr=False)
    api_base: str
    summary_model: str
    proxy: str | None = field(default=None, repr=False)

    # variable -> what needs it; the start-up error lists every missing one at once.
    REQUIRED = {
        "SERPER_KEY_ID": "search (Serper API key)",
        "JINA_API_KEYS": "visit (Jina Reader API key)",
        "API_KEY": "visit summariser (OpenAI-compatible API key)",
        "API_BASE": "visit summariser (OpenAI-compatible base URL, including /v1)",
        "SUMMARY_MODEL_NAME": "visit summariser (model name)",
    }

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Secrets":
        missing = [f"  {k}: needed by {what}" for k, what in cls.REQUIRED.items() if not env.get(k, "").strip()]
        if missing:
            raise ConfigError("--backend web needs these environment variables (set them in .env or pass "
                              "--env-file), which are missing or empty:\n" + "\n".join(missing))
        return cls(serper_key=env["SERPER_KEY_ID"].strip(), jina_key=env["JINA_API_KEYS"].strip(),
                   api_key=env["API_KEY"].strip(), api_base=env["API_BASE"].strip().rstrip("/"),
                   summary_model=env["SUMMARY_MODEL_NAME"].strip(), proxy=env.get("PROXY", "").strip() or None)

    def values(self) -> list[str]:
        """Every secret string, for redaction of logs and messages."""
        return [v for v in (self.serper_key, self.jina_key, self.api_key, self.proxy) if v]


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs; built by ``__main__`` (or tests) and validated by ``validate()``.

    backend: "local" (BM25 over ``corpus``; free, offline), "web" (Serper + Jina Reader + summariser) or "retriever"
        (search forwarded to a Search-R1 ``/retrieve`` or FlashRAG ``/batch_search`` server at ``retriever_url``).
    index_dir: where the local backend caches its BM25 index (``<index_dir>/<corpus name>.bm25/<key>/``, loaded
        memory-mapped on later starts; the key covers the corpus file and the BM25/tokenizer settings, see
        ``backends/local.py``); None = the corpus's own folder.
    retriever_url, retriever_dialect: the retrieval server (base URL or endpoint URL) and its dialect, "search_r1",
        "flashrag" or "auto" (implied by an endpoint path, else search_r1). The URL's own origin may be loopback or
        private (retrievers run beside the trainer); a redirect elsewhere is checked like any other URL.
    retriever_passage_chars: cut each retrieved passage to this many characters (0: whole passages, as Search-R1
        shows them; a cut is counted in ``/stats`` under ``passages_cut``).
    cache_path: SQLite file shared by every worker of a job (WAL mode); None = in-memory, lost at exit.
    cache_ttl_s: cached answers older than this are refetched; None = never expire.
    search_deadline_s / visit_deadline_s: hard wall-clock limit per query / per URL, retries included. Keep them
        below the client's ``timeout_s`` (60 s by default) so the server, not the client, ends a slow call, with a
        structured error. (The reference allowed 1000 s per Jina request and up to 24 requests per URL.)
    page_token_budget, chars_per_token: a page is cut to budget * chars_per_token characters before the
        summariser sees it (tiktoken would need a network download; 4 chars/token is the cl100k English average).
    allow_private_upstreams: let the *configured* upstream base URLs (serper/jina/API_BASE) point at loopback or
        private addresses (local fakes, an in-cluster LLM). Never applies to model-chosen visit URLs or redirects
        to other hosts.
    python_sandbox: how the ``python`` tool isolates model-written code (``docs/guide/security.md``). "bwrap" (the
        default): in bubblewrap's user, mount, PID and network namespaces; the server refuses to start where they
        cannot be built, naming what is missing. "unsafe": without them, behind the process, rlimit and audit-hook
        layers only (the code can read what the server can); a warning is logged at every start. "off": the
        python tool answers every call with an error.
    budgets: the ``--budget-<name>`` caps of the registered tools' budget flags (``tools.budget_flags()``), by
        name; a name left out is not capped. ``__main__`` also puts "search", "visit" and "summary" into the limits
        of the backends' upstreams (serper, jina, summarizer, retriever) below, which is where those backends read
        them; a tool that calls an outside service itself (``tools.upstream_tool``) reads its own here.
    endpoints: base URLs of the outside services of such tools, by upstream name (from each tool's
        ``base_url_env``); one left out is the tool's ``default_base_url``. ``allow_private_upstreams`` covers them.
    latency: web-like delays added to tool calls (``LatencyConfig``); off by default. Which tools exist is only known
        from the registry, so ``tool_server.app.build_service`` checks that each one is served.
    """

    backend: Literal["local", "web", "retriever"] = "local"
    corpus: Path | None = None
    index_dir: Path | None = None
    retriever_url: str | None = None
    retriever_dialect: Literal["auto", "search_r1", "flashrag"] = "auto"
    retriever_passage_chars: int = 0
    host: str = "127.0.0.1"
    port: int = 8765
    cache_path: str | None = None
    cache_ttl_s: float | None = None
    default_topk: int = 5
    max_topk: int = 50
    max_queries: int = 32
    max_urls: int = 8
    max_query_chars: int = 1_000
    max_goal_chars: int = 2_000
    max_url_chars: int = 2_048
    max_request_bytes: int = 1_000_000
    max_text_chars: int = 200_000
    search_deadline_s: float = 30.0
    visit_deadline_s: float = 55.0
    page_token_budget: int = 24_000
    chars_per_token: int = 4
    summary_temperature: float = 0.7
    summary_attempts: int = 3
    serper_base_url: str = "https://google.serper.dev"
    jina_base_url: str = "https://r.jina.ai"
    allow_private_upstreams: bool = False
    python_sandbox: Literal["bwrap", "unsafe", "off"] = "bwrap"
    budgets: Mapping[str, int | None] = field(default_factory=dict)
    endpoints: Mapping[str, str] = field(default_factory=dict)
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    serper: UpstreamLimits = field(default_factory=lambda: UpstreamLimits(attempt_timeout_s=10.0))
    jina: UpstreamLimits = field(default_factory=lambda: UpstreamLimits(concurrency=8, attempt_timeout_s=25.0))
    summarizer: UpstreamLimits = field(default_factory=lambda: UpstreamLimits(concurrency=8,
                                                                              attempt_timeout_s=40.0))
    # a local retriever answers in milliseconds (BM25, e5 on GPU) to ~3 s (flat e5 on CPU; docs/design/sources.md,
    # "Retrieval costs"): more concurrency and rate than Serper, the same 10 s attempt timeout
    retriever: UpstreamLimits = field(default_factory=lambda: UpstreamLimits(concurrency=32, rate_per_s=1000.0,
                                                                             burst=64, attempt_timeout_s=10.0))

    def validate(self) -> None:
        _require(self.backend in ("local", "web", "retriever"), f"backend={self.backend!r}",
                 "one of 'local', 'web', 'retriever'", "pass --backend local, web or retriever")
        if self.backend == "retriever":
            self._validate_retriever()
        if self.backend == "local":
            _require(self.corpus is not None, "corpus=None", "set for --backend local",
                     "pass --corpus data/wiki_passages_1000.jsonl")
            _require(Path(self.corpus).is_file(), f"corpus={str(self.corpus)!r}", "an existing JSONL file",
                     "check the path (relative paths are resolved from the current directory)")
            _require(self.index_dir is None or not Path(self.index_dir).is_file(),
                     f"index_dir={str(self.index_dir)!r}", "a folder (created if missing)",
                     "point --index-dir at a folder, not a file")
        _require(self.python_sandbox in ("bwrap", "unsafe", "off"), f"python_sandbox={self.python_sandbox!r}",
                 "one of 'bwrap', 'unsafe', 'off'", "pass --python-sandbox bwrap (the default), unsafe or off")
        _require(0 <= self.port <= 65535, f"port={self.port}", "0..65535", "use 0 to pick a free port")
        _require(1 <= self.default_topk <= self.max_topk, f"default_topk={self.default_topk}",
                 f"1..max_topk ({self.max_topk})", "lower it")
        for name in ("max_queries", "max_urls", "max_query_chars", "max_goal_chars", "max_url_chars",
                     "max_request_bytes", "max_text_chars", "page_token_budget", "chars_per_token",
                     "summary_attempts"):
            value = getattr(self, name)
            _require(value >= 1, f"{name}={value}", ">= 1", "use a positive value")
        for name in ("search_deadline_s", "visit_deadline_s"):
            value = getattr(self, name)
            _require(value > 0, f"{name}={value}", "> 0", "use a positive number of seconds")
        _require(self.cache_ttl_s is None or self.cache_ttl_s > 0, f"cache_ttl_s={self.cache_ttl_s}",
                 "> 0 or unset", "omit it to never expire")
        for name in ("serper_base_url", "jina_base_url"):
            url = getattr(self, name)
            parts = urlsplit(url)
            _require(parts.scheme in ("http", "https") and bool(parts.hostname), f"{name}={url!r}",
                     "an absolute http(s) URL", "e.g. https://google.serper.dev")
        for name, budget in self.budgets.items():
            _require(budget is None or budget >= 0, f"budgets[{name!r}]={budget}", ">= 0 or unset",
                     f"omit --budget-{name} for no cap")
        for name, url in self.endpoints.items():
            parts = urlsplit(url)
            _require(parts.scheme in ("http", "https") and bool(parts.hostname), f"endpoints[{name!r}]={url!r}",
                     "an absolute http(s) URL", "fix the base URL variable of the tool that calls it")
        self.latency.validate()
        self.serper.validate("serper")
        self.jina.validate("jina")
        self.summarizer.validate("summarizer")
        self.retriever.validate("retriever")

    def _validate_retriever(self) -> None:
        _require(bool(self.retriever_url), "retriever_url=None", "set for --backend retriever",
                 "pass --retriever-url http://HOST:PORT (a Search-R1 /retrieve or FlashRAG /batch_search server) or "
                 "set RETRIEVER_URL in .env")
        _require(self.retriever_passage_chars >= 0, f"retriever_passage_chars={self.retriever_passage_chars}",
                 ">= 0", "pass --retriever-passage-chars 0 for whole passages, or a positive cap")
        parts = urlsplit(self.retriever_url)
        _require(parts.scheme in ("http", "https") and bool(parts.hostname), f"retriever_url={self.retriever_url!r}",
                 "an absolute http(s) URL", "e.g. http://127.0.0.1:8000 or http://127.0.0.1:8000/retrieve")
        try:
            split_retriever_url(self.retriever_url, self.retriever_dialect)
        except ValueError as exc:
            raise ConfigError(f"retriever_url={self.retriever_url!r}, retriever_dialect={self.retriever_dialect!r}: "
                              f"{exc}") from None

    @property
    def max_page_chars(self) -> int:
        return self.page_token_budget * self.chars_per_token


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines (``export`` prefix, quotes and ``#`` comments allowed) without touching os.environ."""
    values: dict[str, str] = {}
    for lineno, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"{path}:{lineno}: expected KEY=VALUE; fix or remove that line")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def _require(ok: bool, value: str, rule: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{value}: must be {rule}; {fix}")
