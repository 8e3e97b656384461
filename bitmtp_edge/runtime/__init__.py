"""The on-device runtime: the reference model (``model``), loading it from an artifact
(``load``), visibility masks (``masks``), the decoding loop and its policies (``decoding``,
``decoding_rules``), sampling (``sampling``), the replay state (``replay``), the KV store (``kv``),
incremental detokenisation (``detokenize``), chat templates (``chat_template``) and the ``Engine``
(``engine``) that ties them to a backend (``bitmtp_edge.backends``)."""
