"""`llmc serve`: an OpenAI-compatible HTTP server over LLM (FastAPI + uvicorn, the serve extra).

app.py: routes and responses; protocol.py: request models; loop.py: the engine loop and its
thread frontend; process.py: the engine process `llmc serve` runs;
metrics.py: Prometheus metrics; loadtest.py: the load and fault test client.
"""
