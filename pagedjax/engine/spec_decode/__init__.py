"""Speculative decoding, one room: the configuration (config), the proposer step that gives
decoding requests their drafts (speculator), the proposers (ngram_proposer: prompt lookup and
Predicted Outputs; draft_model: a smaller model with its own paged KV) and the verifier
(rejection_sampler, run inside the sampler's program). The scheduler keeps only its NumPy
bookkeeping: drafts as extra query tokens of a step (pagedjax.scheduler.plan), the accepted
ones kept and the rest rolled back (pagedjax.scheduler.lifecycle.update), K's step shapes
(pagedjax.scheduler.buckets.speculative_shapes)."""
