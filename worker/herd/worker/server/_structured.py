"""From a request's ``response_format``, ``structured_outputs`` or forced tool call to a compiled grammar.

``grammar_spec`` is the pure part: which constraint a request asks for, as a ``GrammarSpec`` that
names the field it came from. A ``required`` tool choice constrains the output to a JSON array of
``{"name", "parameters"}`` objects, one per call (one at most without ``parallel_tool_calls``), and a
named one to the arguments object of that function, as vLLM does: both are plain JSON whatever the
model family, so they parse the same way everywhere. ``Grammars`` compiles a spec on the server's
prompt threads (never on the engine's step thread), through one ``GrammarCompiler`` per worker
whose LRU cache makes a repeated schema free; a spec that does not compile is a 400 naming the field
before the request reaches the engine.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from herd.api.body import json_value
from herd.api.errors import HttpError
from herd.api.openai import ChatCompletionRequest, NamedToolChoice, SamplingFields, Tool
from herd.api.prompt import PromptThreads
from herd.worker.engine_protocol import ServingEngine
from herd.worker.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from herd.worker.sampling_params import InvalidParamError

__all__ = ["Grammars", "grammar_spec", "tool_call_schema"]

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_spec(request: SamplingFields) -> GrammarSpec | None:
    """The constraint ``request`` puts on its output, or None for free text."""
    if isinstance(request, ChatCompletionRequest):
        choice = request.effective_tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            return GrammarSpec.json_schema(
                tool_call_schema(request.tools or [], choice, request), "tool_choice"
            )
    if (outputs := request.structured_outputs) is not None:
        return _structured_outputs_spec(outputs.json_, outputs.regex, outputs.choice, outputs.grammar)
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec.json_schema(ANY_OBJECT, "response_format")
    assert response_format.json_schema is not None  # the wire model checks it
    return GrammarSpec.json_schema(response_format.json_schema.schema_ or ANY_OBJECT, "response_format")


def _structured_outputs_spec(
    schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None, grammar: str | None
) -> GrammarSpec:
    if regex is not None:
        return GrammarSpec("regex", regex, "structured_outputs.regex")
    if choice is not None:
        return GrammarSpec("choice", json.dumps(choice), "structured_outputs.choice")
    if grammar is not None:
        return GrammarSpec("grammar", grammar, "structured_outputs.grammar")
    if isinstance(schema, str):
        try:
            schema = json_value(schema, what="structured_outputs.json")
        except ValueError as error:
            raise HttpError(400, str(error), param="structured_outputs.json") from None
    if not isinstance(schema, dict):
        raise HttpError(
            400, "structured_outputs.json must be a JSON schema object", param="structured_outputs.json"
        )
    return GrammarSpec.json_schema(schema, "structured_outputs.json")


def tool_call_schema(
    tools: list[Tool], choice: str | NamedToolChoice, request: ChatCompletionRequest
) -> dict[str, Any]:
    """The JSON schema of a forced tool call: the named function's arguments, or for ``required``
    an array of ``{"name", "parameters"}`` calls of any of ``tools``."""
    by_name = {tool.function.name: tool.function.parameters or ANY_OBJECT for tool in tools}
    if isinstance(choice, NamedToolChoice):
        return by_name[choice.function.name]
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in by_name.items()
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class Grammars:
    """The worker's grammar compiler, built at the first constrained request (the engine is loaded
    by then), and the threads that compile."""

    def __init__(self, engine: ServingEngine, threads: PromptThreads) -> None:
        self._engine = engine
        self._threads = threads
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    async def compile_for(self, request: SamplingFields) -> CompiledGrammar | None:
        """The compiled grammar of ``request``'s constraint, None for free text; 400 naming the field
        of a constraint that does not compile."""
        spec = grammar_spec(request)
        if spec is None:
            return None
        try:
            return await self._threads.run(self._compile, spec)
        except InvalidParamError as error:
            raise HttpError(400, str(error), param=error.param) from None

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            if self._compiler is None:
                renderer = self._engine.renderer
                vocab_size = max(self._engine.info.vocab_size or 0, renderer.vocab_size)
                self._compiler = GrammarCompiler(
                    renderer.tokenizer.to_str(), vocab_size, renderer.eos_token_ids
                )
            compiler = self._compiler
        return compiler.compile(spec)
