"""Prometheus metrics of one server, in a registry of its own (no process-global state)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "llmaccel"
# seconds; the CPU serves tiny models in milliseconds and big ones in seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


# the engine's step counters (LLM.metrics() keys) the loop publishes, exported as
# llmaccel_engine_<key>_total; the load test reads their change over a run
STEP_COUNTERS = ("eager_steps", "eager_tokens", "decode_steps", "decode_row_steps")


class _EngineCollector:
    """Engine figures read at scrape time from the loop's latest snapshot."""

    GAUGES = {"requests_running": ("running", "sequences holding KV blocks"),
              "requests_waiting": ("waiting", "sequences queued for the engine"),
              "kv_blocks_used": ("kv_blocks_used", "KV cache blocks in use"),
              "kv_blocks_total": ("kv_blocks_total", "KV cache blocks in all")}
    COUNTERS = {"prompt_tokens": ("prompt_tokens", "prompt tokens admitted"),
                "generation_tokens": ("generated_tokens", "tokens generated"),
                "preemptions": ("preemptions", "sequences preempted (recomputed later)"),
                "engine_steps": ("steps", "engine steps (a decode group counts once)"),
                "engine_busy_seconds": ("busy_s", "seconds the engine loop spent in steps"),
                "engine_eager_steps": ("eager_steps", "steps on the runtime graph, run eagerly or as a lone "
                                       "prompt's graph: prefill, mixed, speculative verification, and "
                                       "decode steps that no decode shape takes (all of a KIVI cache's)"),
                "engine_eager_tokens": ("eager_tokens", "tokens those steps computed"),
                "engine_decode_steps": ("decode_steps", "decode sub-steps (a decode group runs several)"),
                "engine_decode_row_steps": ("decode_row_steps", "decode sub-steps times their rows (padding "
                                            "rows of a bucket not counted)"),
                "cuda_graphs_captured": ("graphs_captured", "CUDA graphs captured (a step shape's "
                                         "first use: an eager run plus a capture)"),
                "cuda_graph_capture_seconds": ("graph_capture_s", "seconds the engine spent on step "
                                               "shapes' first uses (compiles and captures)")}

    def __init__(self, loop):
        self.loop = loop

    def collect(self):
        snap = self.loop.snapshot
        for name, (key, doc) in self.GAUGES.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=snap.get(key, 0))
        total = snap.get("kv_blocks_total", 0)
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_usage_ratio", "KV blocks used / total",
                                value=snap.get("kv_blocks_used", 0) / total if total else 0.0)
        for name, (key, doc) in self.COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=snap.get(key, 0))


class ServeMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by status code", ["status"], registry=r)
        self.finished = Counter(f"{PREFIX}_sequences_finished", "sequences by finish reason "
                                "(stop, length, abort: client gone, error: failed)", ["reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "first to last token over the tokens after the first", buckets=TPOT_BUCKETS,
                              registry=r)

    def record(self, kind: str, value) -> None:
        """One observation of the engine loop: ttft / tpot seconds, or a finish reason."""
        if kind == "ttft":
            self.ttft.observe(value)
        elif kind == "tpot":
            self.tpot.observe(value)
        else:
            self.finished.labels(reason=value).inc()

    def watch(self, loop) -> None:
        """Export the engine loop's gauges and counters."""
        self.registry.register(_EngineCollector(loop))
