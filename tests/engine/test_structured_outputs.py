"""Structured outputs through llguidance: sampled (not greedy) outputs of a random model under a
JSON schema, a regex, a choice and an EBNF grammar always match it; under preemption and
chunked prefill too; a grammar that does not compile is refused by name and queues nothing."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
from helpers import run_requests as run

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.models import get_config, init_model
from pagedjax.text.tokenizer import ByteTokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "enum": ["ann", "bob", "cy"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}}}}
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{3}"
GRAMMAR = """
start: term (op term)? (op term)?
term: NUMBER | "(" NUMBER op NUMBER ")"
op: "+" | "-"
NUMBER: /[1-9][0-9]?/
"""  # finite, so a random model's samples end well inside max_tokens
ARITH = re.compile(r"[0-9+\-()]+")


@pytest.fixture(scope="module")
def byte_model():
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257)
    return init_model(config, seed=5)



def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in ("red", "green", "blue"), text
    else:
        assert ARITH.fullmatch(text) and eval(text) is not None, text  # noqa: S307 - digits, + - ( )


SPECS = {"json": dict(json=SCHEMA, disable_any_whitespace=True), "regex": dict(regex=REGEX),
         "choice": dict(choice=["red", "green", "blue"]), "grammar": dict(grammar=GRAMMAR)}


def requests(tok, seeds, max_tokens=96):
    out = []
    for kind, spec in SPECS.items():
        for seed in seeds:
            prompt = tok.encode(f"{kind} number {seed}: ")
            out.append((kind, prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                     seed=seed, structured_outputs=spec)))
    return out


def test_every_sampled_output_matches_its_grammar(byte_model):
    tok = ByteTokenizer()
    engine = LLMEngine(byte_model, EngineConfig(max_model_len=160, max_num_seqs=8,
                                                block_size=8), tokenizer=tok)
    cases = requests(tok, seeds=(1, 2))
    unconstrained = run(engine, [(p, dataclasses.replace(sp, structured_outputs=None))
                                 for _, p, sp in cases[:2]])
    # the random model alone writes no JSON (not JSON, or JSON the schema refuses)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        check("json", unconstrained[0].outputs[0].text)
    outs = run(engine, [(p, sp) for _, p, sp in cases])
    for (kind, _, _), out in zip(cases, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check(kind, out.outputs[0].text)
    # n > 1: each sample its own matcher
    many = run(engine, [(cases[0][1], dataclasses.replace(cases[0][2], n=3))])[0]
    assert len({o.text for o in many.outputs}) > 1
    for sample in many.outputs:
        check("json", sample.text)


def test_grammars_hold_under_preemption_and_chunked_prefill(byte_model):
    """A pool too small for the batch (requests are preempted and recomputed) and a token
    budget that chunks every prompt: the matchers keep their state across both."""
    tok = ByteTokenizer()
    engine = LLMEngine(byte_model, EngineConfig(
        max_model_len=160, max_num_seqs=8, block_size=8, num_blocks=24,
        max_num_batched_tokens=16, enable_chunked_prefill=True, enable_prefix_caching=False),
        tokenizer=tok)
    cases = requests(tok, seeds=(3, 4), max_tokens=64)
    long = [(kind, tok.encode(chr(97 + i) * 40) + p, sp) for i, (kind, p, sp) in enumerate(cases)]
    outs = run(engine, [(p, sp) for _, p, sp in long])
    assert engine.stats.num_preemptions > 0
    for (kind, _, _), out in zip(long, outs):
        assert out.outputs[0].finish_reason == "stop", (kind, out.outputs[0].text)
        check(kind, out.outputs[0].text)


@pytest.mark.parametrize("spec, field", [
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(json={"type": "object", "properties": 5}), "structured_outputs.json"),
    (dict(grammar="start: missing_rule"), "structured_outputs.grammar"),
    (dict(regex="a", choice=["b"]), "structured_outputs"),
])
def test_a_grammar_that_does_not_compile_is_refused_by_name(byte_model, spec, field):
    engine = LLMEngine(byte_model, EngineConfig(max_model_len=64, max_num_seqs=2,
                                                block_size=8), tokenizer=ByteTokenizer())
    with pytest.raises(ValueError) as error:
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=spec))
    assert error.value.field == field and field in str(error.value)
    assert not engine.has_unfinished() and not engine.token_masks._states


HOSTILE_400 = {  # nothing to generate at all: refused before anything is queued
    "guided_regex": r"[^\s\S]",
    "guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5,
                                                           "maximum": 1}}, "required": ["a"]},
}
HOSTILE_DEAD_END = {  # past llguidance's budgets once generation starts: finished, not failed
    "guided_regex": "(a{1000}){1000}",
    "guided_grammar": 'start: x\nx: "a" x',  # no finite derivation
}


def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("stream", [False, True])
def test_hostile_structured_outputs_are_a_400_or_finish_cleanly(byte_model, stream):
    """A grammar that can produce nothing is the client's 400 naming its field; one that dead-
    ends on llguidance's limits during generation finishes with "stop" and the text so far
    (streamed: a last chunk with that finish_reason, then [DONE]); no 5xx, no parser internals,
    no body over 2 KB. A schema nested past the JSON parser's depth says so."""
    from fastapi.testclient import TestClient

    from pagedjax import LLM
    from pagedjax.serving import completions
    from pagedjax.serving.app import OpenAIServer

    llm = LLM(byte_model, tokenizer="byte", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=64)
    base = {"prompt": "copy:ab=", "max_tokens": 8, "stream": stream}
    with TestClient(OpenAIServer(llm.engine, "tiny").build_app()) as client:
        for field, value in HOSTILE_400.items():
            response = client.post("/v1/completions", json={**base, field: value})
            assert response.status_code == 400, (field, response.text)
            assert response.json()["error"]["param"] == field and len(response.content) < 2048
        for field, value in HOSTILE_DEAD_END.items():
            response = client.post("/v1/completions", json={**base, field: value})
            assert response.status_code == 200 and len(response.content) < 2048, response.text
            if stream:
                events = response.text.strip().split("\n\n")
                assert events[-1] == "data: [DONE]" and "error" not in response.text
                last = json.loads(events[-2][6:])["choices"][0]
            else:
                last = response.json()["choices"][0]
            assert last["finish_reason"] == "stop"
        deep = client.post("/v1/completions", json={**base, "guided_json": _nested(120)})
        assert deep.status_code == 400 and "deeper than this server parses" in deep.text
        assert not llm.engine.has_unfinished()
    # each request names its own structured field in its errors: the endpoint's table of
    # field names is not rewritten by one (the others would name its field)
    assert completions.PARAMS_OF == {"prompt_token_ids": "prompt", "prompts": "prompt"}
