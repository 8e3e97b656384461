"""What users run: the ``bitmtp`` command line (``cli``), the programs behind its commands
(``chat``, ``demo``, ``serve``, ``bench`` + ``bench_report``, ``doctor``) and the OpenAI-compatible
HTTP server (``http_server``, ``openai_schema``)."""
