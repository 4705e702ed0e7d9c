"""Host-side scheduling: requests, KV block management, continuous batching, batch plans.

Pure Python and NumPy: nothing here imports jax, so it can be tested, replayed and simulated alone.
"""

from pagedjax.scheduler.block_pool import NULL_BLOCK, BlockPool
from pagedjax.scheduler.buckets import ShapeBuckets, pad_to_bucket, power_of_two_buckets
from pagedjax.scheduler.errors import RequestError
from pagedjax.scheduler.kv_cache_manager import KVCacheManager, cdiv
from pagedjax.scheduler.lifecycle import (abort_request, add_request, check_admission,
                                          check_request, update)
from pagedjax.scheduler.output_kind import RequestOutputKind
from pagedjax.scheduler.plan import (ARRAY_FIELDS, FORWARD_FIELDS, SAMPLING_FIELDS, STATIC_FIELDS,
                                     BatchPlan, build_plan)
from pagedjax.scheduler.request import (Request, RequestStatus, SamplingParams, fold_seed,
                                        make_samples)
from pagedjax.scheduler.schedule import schedule
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.state import (DECODE, DECODE_FIRST, MIXED, POLICIES, PREFILL, PREFILL_FIRST,
                                      VICTIM_POLICIES, ScheduledSeq, SchedulerConfig,
                                      SchedulerOutput, SchedulerState)
from pagedjax.scheduler.structured_outputs import StructuredOutputs

__all__ = [
    "NULL_BLOCK", "BlockPool", "ShapeBuckets", "pad_to_bucket", "power_of_two_buckets",
    "KVCacheManager", "cdiv", "ARRAY_FIELDS", "FORWARD_FIELDS", "SAMPLING_FIELDS", "DECODE",
    "PREFILL", "STATIC_FIELDS", "BatchPlan",
    "build_plan", "Request", "RequestStatus", "SamplingParams", "DECODE_FIRST", "MIXED",
    "POLICIES", "PREFILL_FIRST", "VICTIM_POLICIES", "ScheduledSeq", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "SchedulerState", "abort_request", "add_request",
    "check_admission", "check_request", "RequestError", "fold_seed",
    "schedule", "update", "make_samples", "StructuredOutputs", "RequestOutputKind",
]
