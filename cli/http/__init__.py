"""`ringq serve`: the HTTP API (OpenAI-compatible Files, Batches, Chat; ringq's own /api/jobs)
and the web dashboard, on FastAPI and uvicorn. Routes live in one module per area; app.py puts
them together."""
