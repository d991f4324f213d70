"""``X-Kairos-Ignored-Params``: the response header naming the parameters a request set that Kairos
accepted without acting on them (support ``ignored`` in
:data:`~kairos.services.ingress.openai_api.params.PARAMETERS`; ``reasoning_effort`` without the
model's chat template), comma-separated in the table's order.

The completion handler stores :attr:`~kairos.services.ingress.openai_api.params.ParsedRequest.ignored`
on the request (:data:`IGNORED_PARAMS`) once it is validated; :func:`add_ignored_params_header`, an
``on_response_prepare`` hook, puts it on whatever answer goes out: the JSON body, the SSE stream's
headers or an error after validation.
"""

from __future__ import annotations

from aiohttp import web

#: the response header
HEADER = "X-Kairos-Ignored-Params"
#: set on a completion request once it is validated: the parameter names to report (may be empty)
IGNORED_PARAMS = web.RequestKey("kairos_ignored_params", tuple)


async def add_ignored_params_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: :data:`HEADER` when the request set parameters Kairos ignored."""
    names = request.get(IGNORED_PARAMS)
    if names:
        response.headers[HEADER] = ",".join(names)
