"""Reading a server-sent event stream in tests, as a raw HTTP client would: the server's and the edge's OpenAI
endpoints are both checked this way beside the openai package."""

import json

import httpx


def sse_events(url: str, body: dict, timeout_s: float) -> list:
    """A streamed POST over raw httpx: every `data:` payload (JSON decoded, "[DONE]" as is); any other non-empty
    line fails the test."""
    out = []
    with httpx.stream("POST", url, json=body, timeout=timeout_s) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == "", line
    return out
