"""Operations: Prometheus metrics at /metrics (prometheus-client, its own registry) and one log
line per finished request (logger "ktransformers.server", INFO).

Metrics (prefix kt_): requests_total{api, finish_reason}, prompt_tokens_total,
generation_tokens_total, prompt_cached_tokens_total and prefix_cache_hits_total (requests that
found part of their prompt in the prefix cache), requests_running, requests_waiting,
kv_cache_usage_ratio (pages held by running requests over all), and the histograms
time_to_first_token_seconds, time_per_output_token_seconds (a request's decode time over its
tokens after the first) and e2e_request_latency_seconds."""
from __future__ import annotations

import logging

log = logging.getLogger("ktransformers.server")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)


class Metrics:
    """The server's metrics; the scheduler calls `finished` (from its thread) when a request
    ends. Without prometheus-client only the log lines remain."""

    def __init__(self, scheduler, model_name: str):
        self.scheduler, self.model_name = scheduler, model_name
        self.registry = None
        scheduler.on_finish.append(self.finished)
        try:
            import prometheus_client as pc
        except ImportError:
            return
        r = self.registry = pc.CollectorRegistry()
        self.requests = pc.Counter("kt_requests", "Finished requests", ["api", "finish_reason"], registry=r)
        self.prompt_tokens = pc.Counter("kt_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = pc.Counter("kt_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = pc.Counter("kt_prompt_cached_tokens", "Prompt tokens found in the prefix cache",
                                        registry=r)
        self.prefix_hits = pc.Counter("kt_prefix_cache_hits", "Requests that found part of their prompt cached",
                                      registry=r)
        pc.Gauge("kt_requests_running", "Requests being computed", registry=r).set_function(
            lambda: len(scheduler.running))
        pc.Gauge("kt_requests_waiting", "Requests queued", registry=r).set_function(lambda: scheduler.waiting)
        pc.Gauge("kt_kv_cache_usage_ratio", "KV cache pages held by running requests, of all",
                 registry=r).set_function(self._cache_usage)
        self.ttft = pc.Histogram("kt_time_to_first_token_seconds", "Time to the first token", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.tpot = pc.Histogram("kt_time_per_output_token_seconds", "Decode time per token after the first",
                                 buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = pc.Histogram("kt_e2e_request_latency_seconds", "Submission to the last token",
                                buckets=LATENCY_BUCKETS, registry=r)

    def _cache_usage(self) -> float:
        cache = self.scheduler.engine.cache
        return 1.0 - self.scheduler.free_pages() / max(cache.num_pages, 1)

    def finished(self, r) -> None:
        """A request ended (the scheduler's thread): its metrics and its log line."""
        reason = r.finish_reason or "error"
        n = len(r.tokens)
        ttft = (r.t_first - r.t_submit) if r.t_first is not None else None
        decode_s = (r.t_done - r.t_first) if r.t_first is not None and r.t_done is not None else 0.0
        rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        log.info("request %d: %s, prompt %d tokens (%d cached), %d generated, TTFT %s, %.1f tok/s, finish %s",
                 r.id, r.api, len(r.prompt_ids), r.cached_tokens, n,
                 f"{ttft * 1e3:.0f} ms" if ttft is not None else "-", rate, reason)
        if self.registry is None:
            return
        self.requests.labels(r.api, reason).inc()
        self.prompt_tokens.inc(len(r.prompt_ids))
        self.generation_tokens.inc(n)
        if r.cached_tokens:
            self.cached_tokens.inc(r.cached_tokens)
            self.prefix_hits.inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if n > 1 and decode_s > 0:
            self.tpot.observe(decode_s / (n - 1))
        if r.t_done is not None:
            self.e2e.observe(r.t_done - r.t_submit)

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of /metrics."""
        import prometheus_client as pc
        return pc.generate_latest(self.registry), pc.CONTENT_TYPE_LATEST
