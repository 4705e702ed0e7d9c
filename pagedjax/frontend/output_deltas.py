"""A request's outputs as deltas over the engine core's channel (pagedjax.frontend.engine_core).

A request with DELTA outputs (SamplingParams.output_kind: what the server asks) gets outputs
that hold only what is new already; DeltaEncoder sends them as they are, its prompt (ids, text,
cache salt) only the first time, and DeltaDecoder puts the prompt back.

A request with CUMULATIVE outputs (every token so far, every step) would cost O(L^2) bytes over
L tokens sent whole across a process boundary. DeltaEncoder (the core's side) sends its prompt
once and then, per output, only what is new: each sample's new token ids, logprobs and text, and
the prompt logprobs computed since; DeltaDecoder (the server's side) rebuilds the cumulative
RequestOutputs, equal to the engine's.

A sample's text is sent whole when it is not an extension of what was sent (it never shrinks in
practice: a tail that could become a stop string is held back, not retracted), and a finished
request's samples whole when they are not the ones streamed so far (best_of > n keeps the n most
likely at the end).
"""

from __future__ import annotations

import dataclasses

from pagedjax.engine.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput

__all__ = ["DeltaDecoder", "DeltaEncoder"]


@dataclasses.dataclass
class _Sent:
    """What one request's receiver holds: per sample, its token ids and text."""

    tokens: list[list[int]]
    texts: list[str | None]
    num_prompt_logprobs: int = 0


# A choice on the wire: (index, start, new token ids, new logprobs, text start, new text,
# finish_reason, cumulative_logprob, stop_reason); start 0 / text start 0 replace it whole.
# A request on the wire: (request_id, head, choices, finished, metrics, error, prompt-logprob
# start, new prompt logprobs); head: (prompt_token_ids, prompt, cache_salt) the first time, else
# None. A DELTA request's output: (request_id, head, the output without its prompt). A pooling
# request's output: (request_id, the PoolingRequestOutput), once.


class DeltaEncoder:
    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        # DELTA requests (expect_deltas) -> whether their prompt was sent
        self._deltas: dict[str, bool] = {}

    def expect_deltas(self, request_id: str) -> None:
        """request_id's outputs are DELTA ones (its SamplingParams.output_kind)."""
        self._deltas[request_id] = False

    def encode(self, out: RequestOutput | PoolingRequestOutput) -> tuple:
        if isinstance(out, PoolingRequestOutput):  # sent once, whole: (its id, it)
            return out.request_id, out
        if out.request_id in self._deltas:
            return self._encode_delta(out)
        sent = self._sent.get(out.request_id)
        head = None
        if sent is None:
            head = (out.prompt_token_ids, out.prompt, out.cache_salt)
            sent = self._sent[out.request_id] = _Sent([], [])
        choices = [self._choice(sent, i, c, out.finished) for i, c in enumerate(out.outputs)]
        del sent.tokens[len(out.outputs):], sent.texts[len(out.outputs):]
        prompt_start, new_prompt = 0, None
        if out.prompt_logprobs is not None:
            prompt_start = sent.num_prompt_logprobs
            if len(out.prompt_logprobs) < prompt_start:
                prompt_start = 0
            new_prompt = out.prompt_logprobs[prompt_start:]
            sent.num_prompt_logprobs = len(out.prompt_logprobs)
        if out.finished:
            del self._sent[out.request_id]
        return (out.request_id, head, choices, out.finished, out.metrics, out.error,
                prompt_start, new_prompt)

    def _encode_delta(self, out: RequestOutput) -> tuple:
        head = None
        if not self._deltas[out.request_id]:
            head = (out.prompt_token_ids, out.prompt, out.cache_salt)
            self._deltas[out.request_id] = True
        if out.finished:
            del self._deltas[out.request_id]
        return out.request_id, head, dataclasses.replace(
            out, prompt_token_ids=[], prompt=None, cache_salt=None)

    @staticmethod
    def _choice(sent: _Sent, i: int, c: CompletionOutput, finished: bool) -> tuple:
        if i < len(sent.tokens):
            before, text_before = sent.tokens[i], sent.texts[i]
            start = len(before)
            if len(c.token_ids) < start or (finished and c.token_ids[:start] != before):
                start = 0  # not the sample streamed at this index: sent whole
            sent.tokens[i], sent.texts[i] = c.token_ids, c.text
        else:
            start, text_before = 0, None
            sent.tokens.append(c.token_ids)
            sent.texts.append(c.text)
        text_start = 0
        if c.text is not None and text_before and start and c.text.startswith(text_before):
            text_start = len(text_before)
        return (c.index, start, c.token_ids[start:],
                None if c.logprobs is None else c.logprobs[start:],
                text_start, None if c.text is None else c.text[text_start:],
                c.finish_reason, c.cumulative_logprob, c.stop_reason)

    def forget(self, request_id: str) -> None:
        """A request that ends without a finished output (aborted)."""
        self._sent.pop(request_id, None)
        self._deltas.pop(request_id, None)


@dataclasses.dataclass
class _Received:
    head: tuple
    tokens: list[list[int]]
    logprobs: list[list | None]
    texts: list[str | None]
    prompt_logprobs: list | None = None


class DeltaDecoder:
    def __init__(self) -> None:
        self._received: dict[str, _Received] = {}

    def decode(self, wire: tuple) -> RequestOutput | PoolingRequestOutput:
        if isinstance(wire[-1], PoolingRequestOutput):
            return wire[-1]
        if isinstance(wire[-1], RequestOutput):
            return self._decode_delta(*wire)
        (request_id, head, choices, finished, metrics, error, prompt_start,
         new_prompt) = wire
        got = self._received.get(request_id)
        if got is None:
            got = self._received[request_id] = _Received(head, [], [], [])
        outputs = [self._choice(got, choice) for choice in choices]
        del got.tokens[len(choices):], got.logprobs[len(choices):], got.texts[len(choices):]
        if new_prompt is not None:
            if got.prompt_logprobs is None:
                got.prompt_logprobs = []
            del got.prompt_logprobs[prompt_start:]
            got.prompt_logprobs.extend(new_prompt)
        if finished:
            self._received.pop(request_id, None)
        prompt_token_ids, prompt, cache_salt = got.head
        return RequestOutput(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), outputs=outputs,
            finished=finished, metrics=metrics, prompt=prompt, error=error,
            cache_salt=cache_salt,
            prompt_logprobs=None if new_prompt is None else list(got.prompt_logprobs or []))

    def _decode_delta(self, request_id: str, head: tuple | None,
                      out: RequestOutput) -> RequestOutput:
        """A DELTA output, its prompt put back (sent with its first output)."""
        got = self._received.get(request_id)
        if got is None:
            assert head is not None, f"{request_id}'s first output came without its prompt"
            got = self._received[request_id] = _Received(head, [], [], [])
        if out.finished:
            del self._received[request_id]
        prompt_token_ids, prompt, cache_salt = got.head
        return dataclasses.replace(out, prompt_token_ids=prompt_token_ids, prompt=prompt,
                                   cache_salt=cache_salt)

    @staticmethod
    def _choice(got: _Received, choice: tuple) -> CompletionOutput:
        (index, start, tokens, logprobs, text_start, text, finish_reason, cumulative,
         stop_reason) = choice
        i = index
        if i == len(got.tokens):
            got.tokens.append([])
            got.logprobs.append(None)
            got.texts.append(None)
        del got.tokens[i][start:]
        got.tokens[i].extend(tokens)
        if logprobs is not None:
            if got.logprobs[i] is None:
                got.logprobs[i] = []
            del got.logprobs[i][start:]
            got.logprobs[i].extend(logprobs)
        if text is not None:
            got.texts[i] = (got.texts[i] or "")[:text_start] + text
        return CompletionOutput(index=index, token_ids=list(got.tokens[i]),
                                finish_reason=finish_reason, cumulative_logprob=cumulative,
                                logprobs=None if logprobs is None else list(got.logprobs[i]),
                                text=got.texts[i], stop_reason=stop_reason)

    def forget(self, request_id: str) -> None:
        self._received.pop(request_id, None)
