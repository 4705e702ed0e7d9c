"""The engine's requests, one entry each: a RequestState holds everything the engine keeps about
a request between its steps (its samples, their texts, the prompt's text, the weight versions
its tokens came from, its device-OOM retries, its pool when it pools), and RequestTable holds the
unfinished ones with one way out, finish()."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

from pagedjax.engine.output_processor import TextState
from pagedjax.pooling.params import PoolingParams
from pagedjax.pooling.poolers import PooledSequence
from pagedjax.scheduler import Request


@dataclasses.dataclass
class PoolingState:
    """A pooling request's pool (its final hidden states, as the steps compute them) and its
    parameters."""

    pool: PooledSequence
    params: PoolingParams


@dataclasses.dataclass
class RequestState:
    """One request (all its parallel samples) until it finishes."""

    request_id: str
    samples: list[Request]
    texts: dict[str, TextState] = dataclasses.field(default_factory=dict)  # by sample id
    prompt_text: str | None = None  # the text the prompt came from, when given as text
    versions: list[str] = dataclasses.field(default_factory=list)  # weights its tokens came from
    oom_retries: int = 0  # device OOMs its steps were recomputed after
    pooling: PoolingState | None = None
    # DELTA outputs (SamplingParams.output_kind): per sample, the tokens and characters of text
    # its outputs have held so far; and the prompt logprobs sent
    sent: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    prompt_logprobs_sent: int = 0

    @property
    def finished(self) -> bool:
        return all(sample.status.finished for sample in self.samples)

    def record_version(self, version: str) -> str | list[str]:
        """The versions this request's tokens were sampled under, version (the one served now)
        last: one, or (a `keep` request spanning an update) the list of them."""
        if not self.versions or self.versions[-1] != version:
            self.versions.append(version)
        return self.versions[0] if len(self.versions) == 1 else list(self.versions)


class RequestTable(Mapping[str, RequestState]):
    """request id -> RequestState for every unfinished request. finish() is the one way out: the
    entry goes, and forget(sample id) drops each sample's state kept elsewhere (token masks,
    a drafter's KV)."""

    def __init__(self, forget: Callable[[str], None] = lambda sample_id: None):
        self._states: dict[str, RequestState] = {}
        self._forget = forget
        self.groups = _Groups(self._states)

    def add(self, state: RequestState) -> None:
        if state.request_id in self._states:
            raise ValueError(f"request_id {state.request_id!r} is already in the engine")
        self._states[state.request_id] = state

    def finish(self, request_id: str) -> RequestState | None:
        """Takes request_id's entry out (None when there is none) and forgets its samples."""
        state = self._states.pop(request_id, None)
        if state is not None:
            for sample in state.samples:
                self._forget(sample.request_id)
        return state

    def sample_text(self, sample: Request) -> TextState:
        return self._states[sample.parent_id].texts[sample.request_id]

    def __getitem__(self, request_id: str) -> RequestState:
        return self._states[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)


class _Groups(Mapping[str, list[Request]]):
    """request id -> its samples: the table seen as LLMEngine.request_groups."""

    def __init__(self, states: dict[str, RequestState]):
        self._states = states

    def __getitem__(self, request_id: str) -> list[Request]:
        return self._states[request_id].samples

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)
