"""Speculative decoding's proposer step, which gives each decoding request its drafts before
the scheduler runs (the configuration: pagedjax.engine.spec_decode.config).

A request's drafts ride in its next step as extra query tokens (scheduler.plan: K draft
columns), the sampler verifies them (pagedjax.engine.spec_decode.rejection_sampler) and the scheduler keeps
the accepted ones and rolls the rest back (scheduler.lifecycle.update). The proposers:

- `ngram` (prompt lookup): the longest suffix of the request's tokens found earlier in them
  (pagedjax.engine.spec_decode.ngram_proposer), on the host.
- `draft_model`: a smaller model with the target's vocabulary, drafting greedily with its own
  paged KV (pagedjax.engine.spec_decode.draft_model).
- a request's own `prediction` (OpenAI's Predicted Outputs), in any speculative engine: its
  drafts come from the predicted output, matched against its output as it grows
  (NgramProposer.propose_in).

Drafts are deterministic, so verification couples them with plain sampling: the tokens are
those plain decoding gives, greedy or seeded (rejection_sampler's docstring). A proposer is
anything with the draft model's interface (propose a batch, forget a request, warm up): an
EAGLE-style head, which reads the target's hidden states, would be one more, given the
forward's hidden states at the sampled positions (it returns only logits today).
"""

from __future__ import annotations

from pagedjax.engine.spec_decode.config import SpeculativeConfig
from pagedjax.scheduler import Request, RequestStatus


class Speculator:
    """Gives the running requests that are decoding their drafts for the next step."""

    def __init__(self, config: SpeculativeConfig, token_masks, drafter=None):
        """token_masks (pagedjax.engine.token_masks.TokenMasks): a grammar-constrained
        request's drafts are cut at the first its grammar refuses. drafter: the draft model's
        proposer (pagedjax.engine.spec_decode.draft_model), for method draft_model."""
        self.config = config
        self.proposer = config.proposer()
        self.token_masks = token_masks
        self.drafter = drafter

    def forget(self, request_id: str) -> None:
        """A request finished: the draft model frees what it held for it."""
        if self.drafter is not None:
            self.drafter.forget(request_id)

    def propose(self, running: list[Request]) -> None:
        """Sets spec_token_ids of each running request in its decode phase that has none:
        at most num_speculative_tokens, and fewer than the tokens max_tokens still allows (its
        next step adds one token of the target's after them). Nothing when more sequences run
        than disable_by_batch_size."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        batch = []  # the draft model's
        for request in running:
            if (request.spec_token_ids or request.status is not RequestStatus.RUNNING
                    or request.num_tokens - request.num_computed_tokens != 1):
                continue
            room = request.sampling_params.max_tokens - request.num_output_tokens - 1
            if room <= 0:
                continue
            prediction = request.sampling_params.prediction
            if prediction is not None:
                self._set(request, self.proposer.propose_in(prediction, request.output_token_ids,
                                                            room).tolist())
            elif self.drafter is not None:
                k = self.config.num_speculative_tokens
                assert k is not None  # SpeculativeConfig checked it (>= 1)
                batch.append((request, min(room, k)))
            else:
                self._set(request, self.proposer.propose(
                    request.prompt_token_ids + request.output_token_ids, room).tolist())
        if batch:
            drafts = self.drafter.propose(batch)
            for request, _ in batch:
                self._set(request, drafts.get(request.request_id, []))

    def _set(self, request: Request, drafts: list[int]) -> None:
        if drafts:
            drafts = drafts[:self.token_masks.num_valid(request, drafts)]
        request.spec_token_ids = drafts
