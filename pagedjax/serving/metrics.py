"""Prometheus metrics of a serving engine (the server's GET /metrics).

Names follow vLLM's (`vllm:` becomes `pagedjax:`), so dashboards and alerts carry over: gauges of
the queue, KV usage, device memory and the degradation level, the serving configuration's
version, counters of tokens (prompt tokens computed too), finished, rejected and cancelled
requests by reason, preemptions, KV allocation failures, device OOMs, prefix cache lookups and
evictions (the device's, and the tiers' below it: pagedjax.serving.tier_metrics), degradation steps, histograms of TTFT, inter-token latency and time per output token
(per token, as vLLM V1 observes them), a request's mean time per output token, prefill, decode,
inference, end-to-end and queue times, tokens per engine step, and the engine step's time.
Each server has its own registry (no global state), updated after every step from the thread
that gets its report (the engine thread, or the engine core's reader; prometheus_client's metrics
are thread-safe).
"""

from __future__ import annotations

import prometheus_client as prom

from pagedjax.engine.outputs import PoolingRequestOutput
from pagedjax.engine.stats import EngineStats
from pagedjax.frontend.engine_driver import StepInfo
from pagedjax.serving.lora_metrics import LoRAMetrics
from pagedjax.serving.tier_metrics import TierMetrics

# The `_created` timestamp series double every counter and histogram; vLLM turns them off too
# (a process-wide switch of prometheus_client).
prom.disable_created_metrics()

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# EngineStats totals -> the counter that follows each.
COUNTED = (("num_generated_tokens", "generation_tokens"), ("num_preemptions", "num_preemptions"),
           ("num_prefix_query_tokens", "prefix_cache_queries"),
           ("num_device_hit_tokens", "prefix_cache_hits"),
           ("num_external_query_tokens", "external_prefix_cache_queries"),
           ("num_prefix_host_hit_tokens", "external_prefix_cache_hits"),
           ("num_evictions", "prefix_cache_evictions"),
           ("num_allocation_failures", "kv_allocation_failures"), ("num_oom", "oom_errors"),
           ("num_prompt_tokens_computed", "prompt_tokens_computed"),
           ("num_spec_drafts", "spec_decode_num_drafts"),
           ("num_spec_draft_tokens", "spec_decode_num_draft_tokens"),
           ("num_spec_accepted_tokens", "spec_decode_num_accepted_tokens"),
           ("num_ahead_steps", "async_scheduled_steps"))
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


def _totals(stats: EngineStats) -> tuple[int, ...]:
    """The engine's running totals behind the counters (COUNTED's order, then scheduled
    tokens)."""
    return tuple(getattr(stats, name) for name, _ in COUNTED) + (stats.num_scheduled_tokens,)


class _Factory:
    """Metrics named pagedjax:<name> in one registry, labelled with the served model's name."""

    def __init__(self, registry: prom.CollectorRegistry, model_name: str):
        self.registry = registry
        self.labels, self.names = {"model_name": model_name}, ["model_name"]

    def gauge(self, name, doc):
        return prom.Gauge(f"pagedjax:{name}", doc, self.names,
                          registry=self.registry).labels(**self.labels)

    def counter(self, name, doc, extra=()):
        metric = prom.Counter(f"pagedjax:{name}", doc, self.names + list(extra),
                              registry=self.registry)
        return metric if extra else metric.labels(**self.labels)

    def histogram(self, name, doc, buckets):
        return prom.Histogram(f"pagedjax:{name}", doc, self.names, buckets=buckets,
                              registry=self.registry).labels(**self.labels)

    def per_replica(self, name, doc):  # data parallelism: one series a replica
        return prom.Gauge(f"pagedjax:replica_{name}", doc, self.names + ["replica"],
                          registry=self.registry)


class ServerMetrics:
    def __init__(self, stats: EngineStats, model_name: str, observer=None,
                 held_memory: tuple[int, int] = (0, 0)):
        """stats: the engine's running totals at the start (each step's report brings them
        after it); observer (a DegradationController): told each TTFT and inter-token latency
        observed and each device OOM counted; held_memory: the (weights, KV pool) bytes the
        engine holds (LLMEngine.held_memory)."""
        self.observer = observer
        self.registry = prom.CollectorRegistry()
        factory = _Factory(self.registry, model_name)
        self.labels = factory.labels
        self._define_gauges(factory)
        self.weights_bytes.set(held_memory[0])
        self.kv_cache_pool_bytes.set(held_memory[1])
        self._define_counters(factory)
        self._define_histograms(factory)
        self.tiers = TierMetrics(self.registry, self.labels)
        self.loras = LoRAMetrics(self.registry, self.labels)
        self._seen_first_token: set[str] = set()
        # request id -> sample index -> (its tokens observed, the engine time of the last)
        self._token_times: dict[str, dict[int, tuple[int, float]]] = {}
        self._last = _totals(stats)
        self._spec_counted_per_pos: list[int] = []  # what the per-position counter holds

    def _define_gauges(self, f: _Factory) -> None:
        self.num_requests_running = f.gauge("num_requests_running",
                                            "Sequences holding KV blocks in the running batch.")
        self.num_requests_waiting = f.gauge("num_requests_waiting",
                                            "Sequences waiting (queued, preempted or swapped).")
        self.num_requests_swapped = f.gauge("num_requests_swapped",
                                            "Preempted sequences whose KV is in the host pool.")
        self.kv_cache_usage_perc = f.gauge("kv_cache_usage_perc",
                                           "Fraction of usable KV blocks held (1 = full).")
        self.replica_gauges = {
            "num_requests_running": f.per_replica("num_requests_running",
                                                  "Running sequences of one engine replica."),
            "num_requests_waiting": f.per_replica("num_requests_waiting",
                                                  "Waiting sequences of one engine replica."),
            "kv_cache_usage_perc": f.per_replica("kv_cache_usage_perc",
                                                 "Fraction of one replica's usable KV blocks "
                                                 "held."),
            "kv_cache_usable_blocks": f.per_replica("kv_cache_usable_blocks",
                                                    "Usable KV blocks in one replica's pool."),
        }
        self.outstanding_tokens = f.gauge(
            "num_outstanding_tokens",
            "Tokens still to compute over unfinished requests (the admission budget's measure).")
        memory = ("device_memory_used_bytes", "Device memory in use over the engine's devices: "
                  "the backend's memory_stats, or (source=engine, backends that report none) "
                  "the weights and KV pool the engine holds.")
        self.device_memory = prom.Gauge(f"pagedjax:{memory[0]}", memory[1],
                                        f.names + ["source"], registry=self.registry)
        self.serving_config = prom.Info("pagedjax:serving_config", "The active serving "
                                        "configuration's version.", f.names,
                                        registry=self.registry).labels(**f.labels)
        self.weight_version = prom.Info("pagedjax:weight_version", "The version of the weights "
                                        "served (update_weights).", f.names,
                                        registry=self.registry).labels(**f.labels)
        self._weight_version: str | None = None
        self.degradation_level = f.gauge("degradation_level", "The instance's degradation "
                                         "level: 0 normal, 1 max_tokens cut, 2 + long-context "
                                         "shed, 3 + concurrency lowered.")
        self.weights_bytes = f.gauge("weights_bytes", "The model's weights over the engine's "
                                     "devices (as served: quantized ones at their size).")
        self.kv_cache_pool_bytes = f.gauge("kv_cache_pool_bytes", "The KV cache pool over the "
                                           "engine's devices, at its configured size (held "
                                           "whole from the start).")
        self.device_memory_limit = f.gauge("device_memory_limit_bytes",
                                           "What the backend lets JAX allocate over the "
                                           "engine's devices (0: not reported).")

    def _define_counters(self, f: _Factory) -> None:
        self.prompt_tokens = f.counter("prompt_tokens", "Prompt tokens of requests that "
                                       "produced their first token.")
        self.generation_tokens = f.counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = f.counter("num_preemptions", "Sequences preempted.")
        self.prefix_cache_queries = f.counter("prefix_cache_queries",
                                              "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = f.counter("prefix_cache_hits",
                                           "Prompt tokens found in the device's prefix cache.")
        self.external_prefix_cache_queries = f.counter(
            "external_prefix_cache_queries", "Prompt tokens looked up in the tiers below the "
            "device (host, disk: --kv-offload-gib), those the device did not hold.")
        self.external_prefix_cache_hits = f.counter(
            "external_prefix_cache_hits", "Prompt tokens found in the tiers below the device "
            "(loaded back instead of recomputed).")
        self._request_success = f.counter("request_success", "Finished requests by reason.",
                                          ["finished_reason"])
        self._requests_rejected = f.counter("requests_rejected",
                                            "Requests refused before queueing, by reason.",
                                            ["reason"])
        self._requests_cancelled = f.counter("requests_cancelled",
                                             "Requests ended before finishing, by reason "
                                             "(client_disconnect).", ["reason"])
        self.prefix_cache_evictions = f.counter("prefix_cache_evictions",
                                                "Cached KV blocks reused for other content.")
        self.kv_allocation_failures = f.counter(
            "kv_allocation_failures", "KV block allocations the free blocks could not meet "
            "(each preempts a sequence or keeps a request waiting).")
        self.oom_errors = f.counter("oom_errors", "Engine steps that ran out of device memory "
                                    "(their requests recomputed or failed; the engine serves on).")
        self.async_scheduled_steps = f.counter(
            "async_scheduled_steps", "Engine steps scheduled and dispatched while the step "
            "before them ran (--async-scheduling).")
        self.degradation_changes = f.counter("degradation_changes", "Automatic degradation "
                                             "steps, by direction (degrade, recover).",
                                             ["direction"])
        self.prompt_tokens_computed = f.counter(
            "prompt_tokens_computed", "Prompt tokens computed by engine steps (prefix-cache "
            "hits excluded, recomputation after preemption included).")
        self.spec_decode_num_drafts = f.counter(
            "spec_decode_num_drafts", "Speculative decoding: rows of steps that verified drafts.")
        self.spec_decode_num_draft_tokens = f.counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.")
        self.spec_decode_num_accepted_tokens = f.counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.")
        self._spec_accepted_per_pos = f.counter(
            "spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: draft tokens "
            "accepted, by their position in a row's drafts.", ["position"])
        self.spec_acceptance_rate = f.gauge(
            "spec_decode_acceptance_rate", "Speculative decoding since start: accepted / "
            "verified draft tokens.")
        self.spec_mean_acceptance_length = f.gauge(
            "spec_decode_mean_acceptance_length", "Speculative decoding since start: tokens a "
            "verifying row produced on average (accepted drafts + 1).")

    def _define_histograms(self, f: _Factory) -> None:
        self.ttft = f.histogram("time_to_first_token_seconds",
                                "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = f.histogram("inter_token_latency_seconds",
                               "Time between two consecutive output tokens of a sample, "
                               "observed per token.", LATENCY_BUCKETS)
        self.tpot = f.histogram("time_per_output_token_seconds",
                                "Time per output token after the first, observed per token "
                                "(vLLM V1's; equal to inter_token_latency_seconds).",
                                LATENCY_BUCKETS)
        self.request_tpot = f.histogram("request_time_per_output_token_seconds",
                                        "A finished request's mean time per output token after "
                                        "its first (its longest sample).", LATENCY_BUCKETS)
        self.prefill_time = f.histogram("request_prefill_time_seconds",
                                        "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode_time = f.histogram("request_decode_time_seconds",
                                       "First token to finish.", LATENCY_BUCKETS)
        self.inference_time = f.histogram("request_inference_time_seconds",
                                          "First scheduled to finish.", LATENCY_BUCKETS)
        self.iteration_tokens = f.histogram("iteration_tokens_total",
                                            "Tokens computed by one engine step (prompt and "
                                            "generated).", TOKEN_BUCKETS)
        self.e2e = f.histogram("e2e_request_latency_seconds", "Arrival to finish.",
                               LATENCY_BUCKETS)
        self.queue_time = f.histogram("request_queue_time_seconds",
                                      "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.step_time = f.histogram("engine_step_seconds", "Wall time of one engine step.",
                                     LATENCY_BUCKETS)
        self.request_prompt_tokens = f.histogram("request_prompt_tokens",
                                                 "Prompt length of finished requests.",
                                                 TOKEN_BUCKETS)
        self.request_generation_tokens = f.histogram(
            "request_generation_tokens", "Tokens generated by finished requests (all samples).",
            TOKEN_BUCKETS)

    def rejected(self, reason: str) -> None:
        self._requests_rejected.labels(reason=reason, **self.labels).inc()

    def on_step(self, info: StepInfo) -> None:
        """Engine thread: after every step."""
        self.num_requests_running.set(info.num_running)
        self.num_requests_waiting.set(info.num_waiting)
        self.num_requests_swapped.set(info.num_swapped)
        self.kv_cache_usage_perc.set(info.kv_usage)
        self.outstanding_tokens.set(info.outstanding_tokens)
        for index, load in enumerate(info.replicas):
            for name, value in (("num_requests_running", load.num_running),
                                ("num_requests_waiting", load.num_waiting),
                                ("kv_cache_usage_perc", load.kv_usage),
                                ("kv_cache_usable_blocks", load.usable_blocks)):
                self.replica_gauges[name].labels(replica=str(index), **self.labels).set(value)
        if info.step_time_s is not None:
            self.step_time.observe(info.step_time_s)
        stats = info.stats
        assert stats is not None, "a step report carries the engine's stats"
        totals = _totals(stats)
        for (_, attribute), count, before in zip(COUNTED, totals, self._last):
            if count > before:
                getattr(self, attribute).inc(count - before)
                if attribute == "oom_errors" and self.observer is not None:
                    self.observer.oom(count - before)
        if info.step_time_s is not None:
            self.iteration_tokens.observe(totals[-1] - self._last[-1])
        self._last = totals
        self._spec_gauges(stats)
        self.tiers.update(stats.kv_tiers)
        self.loras.update(stats.loras)
        if info.weight_version != self._weight_version:
            self._weight_version = info.weight_version
            self.weight_version.info({"version": info.weight_version})
        used, limit, source = info.memory
        self.device_memory.labels(source=source, **self.labels).set(used)
        self.device_memory_limit.set(limit or 0)
        now = info.time
        for out in info.outputs:
            if out.request_id not in self._seen_first_token:
                self._seen_first_token.add(out.request_id)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if out.metrics.ttft is not None:
                    self.ttft.observe(out.metrics.ttft)
                    if self.observer is not None:
                        self.observer.observe("ttft", out.metrics.ttft)
            if not isinstance(out, PoolingRequestOutput):  # no tokens: its TTFT is its pool's
                self._observe_tokens(out, now)
            if out.finished:
                self._finished(out)

    def _spec_gauges(self, stats: EngineStats) -> None:
        if not stats.num_spec_drafts:
            return
        self.spec_acceptance_rate.set(stats.spec_acceptance_rate)
        self.spec_mean_acceptance_length.set(stats.spec_mean_acceptance_length)
        counted = self._spec_counted_per_pos
        for position, count in enumerate(stats.spec_accepted_per_position):
            series = self._spec_accepted_per_pos.labels(position=str(position), **self.labels)
            if position == len(counted):
                counted.append(0)  # the series exists from its first draft, at 0
            if count > counted[position]:
                series.inc(count - counted[position])
                counted[position] = count

    def _observe_tokens(self, out, now: float) -> None:
        """Inter-token latency, per token: each sample's new tokens since its last ones share
        the time since then (one token a step: the step-to-step gap); a sample's first token
        is TTFT's, not an interval."""
        samples = self._token_times.setdefault(out.request_id, {})
        for choice in out.outputs:
            seen, last = samples.get(choice.index, (0, None))
            new = choice.num_tokens - seen
            if new <= 0:
                continue
            if last is not None:
                gap = (now - last) / new
                for _ in range(new):
                    self.itl.observe(gap)
                    self.tpot.observe(gap)
                    if self.observer is not None:
                        self.observer.observe("itl", gap)
            samples[choice.index] = (choice.num_tokens, now)

    def _finished(self, out) -> None:
        m = out.metrics
        self._seen_first_token.discard(out.request_id)
        self._token_times.pop(out.request_id, None)
        self._request_success.labels(finished_reason=out.finish_reason or "abort",
                                     **self.labels).inc()
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        pooling = isinstance(out, PoolingRequestOutput)
        self.request_generation_tokens.observe(
            0 if pooling else sum(c.num_tokens for c in out.outputs))
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            if m.finish_time is not None:
                self.inference_time.observe(m.finish_time - m.first_scheduled_time)
        if m.finish_time is not None and m.first_token_time is not None and not pooling:
            self.decode_time.observe(m.finish_time - m.first_token_time)
            longest = max(c.num_tokens for c in out.outputs)
            if longest > 1:
                self.request_tpot.observe((m.finish_time - m.first_token_time) / (longest - 1))

    def forget(self, request_id: str, reason: str = "client_disconnect") -> None:
        """A request that ended without a finished output (aborted by its client, or shed)."""
        self._seen_first_token.discard(request_id)
        self._token_times.pop(request_id, None)
        self._request_success.labels(finished_reason="abort", **self.labels).inc()
        self._requests_cancelled.labels(reason=reason, **self.labels).inc()

    def degradation_changed(self, level: int, direction: str, why: str) -> None:
        self.degradation_level.set(level)
        self.degradation_changes.labels(direction=direction, **self.labels).inc()

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)
