"""``turbospark serve``: an OpenAI-compatible HTTP server over one install's session pool.

``protocol`` validates requests and shapes responses, ``scheduler`` runs the
model on one worker thread that decodes every active request in one batched
forward, each on its session slot, ``app`` is the Starlette app and ``transport`` its
connection bounds on uvicorn, ``httpd`` runs them. Start one in-process with::

    server = Server.from_install("smollm2", port=0, session_slots=4).start()
    ...  # OpenAI(base_url=server.url + "/v1", api_key="-")
    server.close()
"""

from __future__ import annotations

from turbospark_core.server.httpd import DEFAULT_MAX_BODY, Server, serve
from turbospark_core.server.protocol import APIError

__all__ = ["DEFAULT_MAX_BODY", "APIError", "Server", "serve"]
