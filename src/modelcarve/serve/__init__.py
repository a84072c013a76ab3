"""The HTTP layer over the generation engine: an OpenAI-compatible server and the bench-serve client.

    protocol.py   request bodies and response shapes, as vLLM's OpenAI server has them
    errors.py     OpenAI-style JSON errors with their HTTP statuses
    handlers.py   what each route does with a parsed request: prompt, sampling, the engine's results as responses
    metrics.py    the prometheus_client registry behind ``GET /metrics``
    bridge.py     the engine on rank 0: one stepping thread, queues to the HTTP side, drain
    app.py        the FastAPI routes
    server.py     a rank's life for ``modelcarve serve``: uvicorn on rank 0 (signals, drain), followers elsewhere
    bench.py      ``modelcarve bench-serve``: load over HTTP and its statistics (report/bench.py prints them)

This package sits between ``commands/`` and ``verify``/``runtime`` (pyproject's layer contract).
"""
