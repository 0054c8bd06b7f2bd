"""One HTTP request's ext_proc stream: its phases, in the order Envoy sends them.

1. request headers: the path, the session header, the subset hint. With a buffered request body
   (``BUFFERED``) Envoy waits for this answer before it sends the body, so the headers pass at once;
   in ``FULL_DUPLEX_STREAMED`` the answer waits for the whole body.
2. request body: buffered here up to ``max_body_bytes``; at its end the picker decides and holds the
   worker, and the choice goes back on the body's answer (buffered) or on the deferred headers'
   answer followed by the body itself (full duplex, where Envoy forwards only what it is sent).
3. response headers: the endpoint the data plane reports as the one that served (the hold moves there
   if it differs), the status; ``X-Herd-Worker`` names the worker to the client, as herd's gateway does.
4. response body: passes; its end releases the hold with the answer's outcome and charges the
   tenant the tokens the answer's usage reports (``Picker.finished``; a stream's events are counted
   when it carries no usage, a whole answer's JSON is read up to ``max_body_bytes``). With a response
   body mode of ``NONE`` Envoy ends the stream after the response headers, which then releases it:
   a streamed answer is then counted only until its headers, and the tenant is charged its prompt.

Whatever ends the stream first (the response's end, an immediate response, Envoy closing it, the
client leaving) releases the hold, exactly once.
"""

from __future__ import annotations

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)

from herd.api.errors import HttpError
from herd.api.protocol import WORKER_HEADER
from herd.orchestrator.admission.usage import StreamTally, Usage, usage_of
from herd.orchestrator.breaker import answer_outcome
from herd.orchestrator.epp import wire
from herd.orchestrator.epp.picker import Picked, Picker
from herd.orchestrator.validation import WIRE_MODELS

__all__ = ["Exchange"]

_FULL_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED


class Exchange:
    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.is_request_full_duplex = False
        self.is_response_full_duplex = False
        self.path = ""
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.picked: Picked | None = None
        self.status = 0
        self.has_retry_after = False
        self.tally = StreamTally()
        self.answer = bytearray()
        """A whole (not streamed) answer's body, kept for its usage up to ``max_body_bytes``."""
        self.is_stream = False

    async def handle(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        """The answers to one message from Envoy (none while a full-duplex body is still arriving)."""
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self.is_request_full_duplex = config.request_body_mode == _FULL_DUPLEX
            self.is_response_full_duplex = config.response_body_mode == _FULL_DUPLEX
        match message.WhichOneof("request"):
            case "request_headers":
                return self._request_headers(message)
            case "request_body":
                return await self._request_body(message.request_body)
            case "request_trailers":
                return [ProcessingResponse(request_trailers=TrailersResponse())]
            case "response_headers":
                return self._response_headers(message)
            case "response_body":
                return self._response_body(message.response_body)
            case "response_trailers":
                self._end()
                return [ProcessingResponse(response_trailers=TrailersResponse())]
        return []

    def close(self) -> None:
        """The stream ended: release the worker if the response's end did not."""
        if self.picked is not None:
            self.picked.route.release("none")

    def _request_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        headers: HttpHeaders = message.request_headers
        self.headers = wire.header_map(headers)
        self.path = self.headers.get(":path", "").split("?", 1)[0]
        self.subset = wire.subset_hint(message.metadata_context)
        method = self.headers.get(":method", "")
        if method != "POST" or self.path not in WIRE_MODELS:
            routes = " and ".join(f"POST {path}" for path in WIRE_MODELS)
            error = HttpError(404, f"herd's endpoint picker routes {routes}; {method} {self.path} is not one")
            return [wire.immediate(error)]
        if headers.end_of_stream:
            return [wire.immediate(HttpError(400, f"POST {self.path} needs a JSON body"))]
        return [] if self.is_request_full_duplex else [wire.continue_headers(is_request=True)]

    async def _request_body(self, body: HttpBody) -> list[ProcessingResponse]:
        if self.path not in WIRE_MODELS:  # a body before the request's headers
            return [wire.immediate(HttpError(400, "the request body came before its headers"))]
        if self.picked is not None:  # a body that ended once already: it was routed then
            return [] if self.is_request_full_duplex else [wire.continue_body(is_request=True)]
        self.body += body.body
        limit = self.picker.settings.max_body_bytes
        if len(self.body) > limit:
            return [
                wire.immediate(HttpError(413, f"the request body exceeds {limit} bytes; send a shorter one"))
            ]
        if not body.end_of_stream:
            return [] if self.is_request_full_duplex else [wire.continue_body(is_request=True)]
        try:
            self.picked = await self.picker.pick(self.path, bytes(self.body), self.headers, self.subset)
        except HttpError as error:
            return [wire.immediate(error)]
        chosen = wire.destination(self.picked.address, in_body=not self.is_request_full_duplex)
        if not self.is_request_full_duplex:
            return [chosen]
        return [chosen, *wire.body_chunks(bytes(self.body), is_request=True, end_of_stream=True)]

    def _response_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        headers = wire.header_map(message.response_headers)
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0
        self.has_retry_after = "retry-after" in headers
        self.is_stream = headers.get("content-type", "").startswith("text/event-stream")
        picked = self.picked
        if picked is None:
            return [wire.continue_headers(is_request=False)]
        served = wire.served_endpoint(message.metadata_context)
        if served is not None:
            self.picker.moved(picked, served)
        picked.route.hold.prefilled()  # the worker has answered: its prompt is no longer queued work
        if message.response_headers.end_of_stream:
            self._end()
        added = {**picked.quota_headers, WORKER_HEADER: picked.route.worker.id}
        return [wire.continue_headers(is_request=False, set_headers=added)]

    def _response_body(self, body: HttpBody) -> list[ProcessingResponse]:
        if self.is_stream:
            self.tally.observe(body.body)
        elif len(self.answer) + len(body.body) <= self.picker.settings.max_body_bytes:
            self.answer += body.body
        if body.end_of_stream:
            self._end()
        if self.is_response_full_duplex:
            return wire.body_chunks(body.body, is_request=False, end_of_stream=body.end_of_stream)
        return [wire.continue_body(is_request=False)]

    def _end(self) -> None:
        """The response is complete: release the worker with what its answer says about it, and
        charge the tenant what the answer used."""
        picked = self.picked
        if picked is None or not self.status or not picked.route.hold.is_held:
            return
        picked.route.release(answer_outcome(self.status, has_retry_after=self.has_retry_after))
        num_prompt = picked.ticket.num_prompt_tokens
        if self.status != 200:
            usage = Usage(0, 0)
        elif self.is_stream:
            usage = self.tally.total(num_prompt)
        else:
            usage = usage_of(bytes(self.answer)) or Usage(num_prompt, 0)
        self.picker.finished(picked, usage)
