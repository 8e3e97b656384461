"""User-facing applications over the Engine: the HTTP server and its OpenAI schema."""
